"""ffdebug's messages through `logging` (docs/cli.md "CLI conventions"): the one place that sets them up.

Every library message goes to a logger under `ffdebug` (`ffdebug.capture`, `ffdebug.store`, ...;
`ffdebug.progress` carries the progress lines at INFO). Nothing else in the package prints a warning.

* Library use (an engine or trainer that imported ffdebug): the `ffdebug` logger has our stderr
  handler, which stands aside as soon as the user configured logging themselves (a handler on the
  root logger or on `ffdebug`), so `logging.basicConfig(...)`, their own handlers and
  `logging.disable(...)` decide (pytest's log capture is such a handler: tests read library
  messages with `caplog`). Its level is left unset: the root's (WARNING by default) applies.
* The CLI calls `configure(verbosity)` once: our handler always writes, at INFO by default
  (progress and warnings), DEBUG with `-v`, errors only with `-q`. Records still propagate (a
  handler on the root, pytest's log capture for one, sees them too).

Lines read `ffdebug: warning: MESSAGE` (`ffdebug: MESSAGE` at INFO), on whatever `sys.stderr` is
when the message is written (so pytest's capture and `contextlib.redirect_stderr` see them).
"""

from __future__ import annotations

import logging
import sys

ROOT = "ffdebug"
PROGRESS = "ffdebug.progress"  # progress lines, at INFO
TRAINER = "ffdebug.trainer"  # the reference trainer's lines (its per-step log), at INFO


class _Format(logging.Formatter):
    """`ffdebug: warning: MESSAGE`; INFO lines carry no level word."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        program = "reference-trainer" if record.name.startswith(TRAINER) else ROOT
        if record.levelno == logging.INFO:
            return f"{program}: {message}"
        return f"{program}: {record.levelname.lower()}: {message}"


class StderrHandler(logging.StreamHandler):
    """Writes to the current `sys.stderr`. `standalone=False` (library use) stands aside when the
    user configured a handler of their own; the CLI sets `standalone=True`."""

    def __init__(self) -> None:
        super().__init__()
        self.standalone = False
        self.setFormatter(_Format())

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ assigns one: always the current stderr
        pass

    def user_configured(self) -> bool:
        """True when a handler other than ours would receive the record."""
        others = [h for h in logging.getLogger(ROOT).handlers if h is not self]
        return bool(others or logging.getLogger().handlers)

    def emit(self, record: logging.LogRecord) -> None:
        if self.standalone or not self.user_configured():
            super().emit(record)


def handler() -> StderrHandler:
    """Our handler on the `ffdebug` logger, installed on first use."""
    root = logging.getLogger(ROOT)
    for h in root.handlers:
        if isinstance(h, StderrHandler):
            return h
    h = StderrHandler()
    root.addHandler(h)
    return h


def get_logger(name: str) -> logging.Logger:
    """The logger `ffdebug.NAME` (our stderr handler in place): what library modules log through.
    A name already under `ffdebug` (`PROGRESS`, `TRAINER`'s children) is taken as it is."""
    handler()
    if not name or name == ROOT or name.startswith(f"{ROOT}."):
        return logging.getLogger(name or ROOT)
    return logging.getLogger(f"{ROOT}.{name}")


def level_for(verbosity: int) -> int:
    """-1 (`-q`): errors only; 0: INFO (progress and warnings); 1 or more (`-v`): DEBUG."""
    if verbosity < 0:
        return logging.ERROR
    return logging.DEBUG if verbosity > 0 else logging.INFO


def configure(verbosity: int = 0) -> None:
    """The CLI's logging: our handler writes whatever else is configured, at `level_for(verbosity)`."""
    h = handler()
    h.standalone = True
    logging.getLogger(ROOT).setLevel(level_for(verbosity))


def reset() -> None:
    """Back to library use (the state before any `configure`): for tests and embedding programs."""
    handler().standalone = False
    logging.getLogger(ROOT).setLevel(logging.NOTSET)


handler()  # on import: a module that logs through logging.getLogger("ffdebug.<part>") directly gets it too
