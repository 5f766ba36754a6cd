"""Progress of long commands on stderr, never on stdout (docs/cli.md "Progress").

`Progress(task, unit)` is the `ffdebug.progress_hook.ProgressHook` the CLI hands compare, bisect,
weights-diff and inspect. On a terminal it shows a rich bar once the work has lasted `delay`
seconds (short runs show nothing). Without a terminal it writes one line every
`FFDEBUG_PROGRESS_INTERVAL` seconds (0: one per item) through the `ffdebug.progress` logger::

    compare: 120/200 stages, 610 MiB/1.0 GiB, 380 MiB/s, 1.6 s

A level above INFO on that logger (or on `ffdebug`) silences the lines and the bar alike: the CLI
sets it from `-q` / `-v` (`ffdebug/logs.py`, whose stderr handler writes the lines as
`ffdebug: compare: 120/200 stages, ...`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TYPE_CHECKING

from ffdebug.logs import PROGRESS, get_logger
from ffdebug.progress_hook import FORK_SAFE

if TYPE_CHECKING:
    from types import TracebackType

    from rich.progress import Progress as RichProgress

BAR_DELAY_S = 1.0  # work shorter than this shows no bar
BAR_REFRESH_S = 0.1  # the bar is redrawn this often


def size(nbytes: float) -> str:
    """Binary units, three digits: 512 B, 9.5 KiB, 610 MiB, 1.0 GiB."""
    value, unit = float(nbytes), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"


class Progress:
    """Progress of one command's work; use as a context manager around the analysis call."""

    def __init__(
        self,
        task: str,
        unit: str,
        *,
        interval: float | None = None,
        tty: bool | None = None,
        delay: float = BAR_DELAY_S,
    ) -> None:
        """`task` and `unit` name the work (`compare`, `stages`); `interval` and `tty` default to
        `FFDEBUG_PROGRESS_INTERVAL` and whether stderr is a terminal."""
        from ffdebug._env import progress_interval

        self.task, self.unit, self.delay = task, unit, delay
        self.interval = progress_interval() if interval is None else interval
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.logger = get_logger(PROGRESS)
        self.enabled = self.logger.isEnabledFor(logging.INFO)
        self.total: int | None = None
        self.total_bytes = 0
        self.done = 0
        self.done_bytes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = self._begun = time.monotonic()
        self._thread: threading.Thread | None = None
        self._bar: RichProgress | None = None
        self._bar_task = None

    # -- the hook the analysis calls ----------------------------------------------------------------

    def begin(self, total: int, total_bytes: int = 0) -> None:
        """`total` items start (`total_bytes` payload bytes)."""
        with self._lock:
            self.total, self.total_bytes = total, total_bytes
            self.done = self.done_bytes = 0
            self._begun = time.monotonic()
            self._update_bar()

    def advance(self, nbytes: int = 0) -> None:
        """One item done, `nbytes` read for it."""
        with self._lock:
            self.done += 1
            self.done_bytes += nbytes
            self._update_bar()
            if self.enabled and not self.tty and self.interval == 0:
                self.logger.info(self.line())

    # -- what is shown ------------------------------------------------------------------------------

    def line(self) -> str:
        """`compare: 120/200 stages, 610 MiB/1.0 GiB, 380 MiB/s, 1.6 s` (bytes left out when unknown)."""
        total = "?" if self.total is None else str(self.total)
        detail = self._detail()
        parts = [f"{self.task}: {self.done}/{total} {self.unit}", *([detail] if detail else [])]
        return ", ".join([*parts, f"{time.monotonic() - self._started:.1f} s"])

    def _detail(self) -> str:
        if not self.total_bytes:
            return ""
        seconds = max(time.monotonic() - self._begun, 1e-9)
        return f"{size(self.done_bytes)}/{size(self.total_bytes)}, {size(self.done_bytes / seconds)}/s"

    def _update_bar(self) -> None:
        if self._bar is not None:
            self._bar.update(self._bar_task, total=self.total, completed=self.done, detail=self._detail())

    def _show_bar(self) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as RichProgress

        with self._lock:
            if self._stop.is_set():
                return
            self._bar = RichProgress(
                TextColumn(f"[bold]{self.task}[/]"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn(self.unit),
                TextColumn("{task.fields[detail]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
                auto_refresh=False,  # redrawn by `_bar_loop`
            )
            self._bar_task = self._bar.add_task(self.task, total=self.total, detail="")
            self._update_bar()
            self._bar.start()

    def _bar_loop(self) -> None:
        """On a terminal: the bar once the work has lasted `delay`, redrawn every `BAR_REFRESH_S`
        by this thread — rich's own refresh thread is off, so the only thread beside the work is
        this one, which compare's forked workers may fork beside (`FORK_SAFE`)."""
        if self._stop.wait(self.delay):
            return
        self._show_bar()
        while not self._stop.wait(BAR_REFRESH_S):
            with self._lock:
                if self._bar is not None:
                    self._bar.refresh()

    def _tick(self) -> None:
        """Without a terminal: a line every `interval` seconds until the work ends."""
        while not self._stop.wait(self.interval):
            with self._lock:
                self.logger.info(self.line())

    # -- lifetime -----------------------------------------------------------------------------------

    def __enter__(self) -> Progress:
        """Start the clock, and the bar's thread (terminal) or the line ticker (no terminal)."""
        self._started = self._begun = time.monotonic()
        if not self.enabled:
            return self
        if self.tty:
            self._thread = threading.Thread(target=self._bar_loop)
        elif self.interval > 0:
            self._thread = threading.Thread(target=self._tick)
        if self._thread is not None:
            self._thread.daemon = True
            self._thread.name = "ffdebug-progress"
            setattr(self._thread, FORK_SAFE, True)  # compare's forked workers never call into it
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Stop the ticker and take the bar away (it is transient: the command's output follows)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self._bar is not None:
                self._bar.stop()
                self._bar = None
