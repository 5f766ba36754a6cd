"""`ffdebug selftest`'s one entry: the models of the specs (or a zoo sample), their cases, one result."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ffdebug.selftest.cases import ModelReport, SelftestOptions, run_model
from ffdebug.selftest.models import SelftestError
from ffdebug.selftest.zoo import Summary, summarise

MODEL_SECONDS = 180  # the zoo's limit for one architecture (a tiny model takes 3-20 s on one core)


@contextlib.contextmanager
def _time_limit(seconds: int | None, spec: str) -> Iterator[None]:
    """A SelftestError when the block runs past `seconds` (SIGALRM; the main thread on Unix only,
    elsewhere no limit): a zoo architecture whose tiny model is not tiny in time is recorded, not waited on."""
    usable = seconds and hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def expire(signum, frame):
        raise SelftestError(f"{spec}: ran past {seconds} s (the tiny model is not tiny in time)")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class SelftestResult:
    """Every model's report and the rates over them. Exit 0 when every case of every built model
    holds; 1 when one does not; an explicit spec whose model cannot be built is exit 2 (raised
    before any case), while the zoo records such architectures with why."""

    reports: list[ModelReport] = field(default_factory=list)
    zoo: bool = False

    @property
    def summary(self) -> Summary:
        return summarise(self.reports)

    def holds(self) -> bool:
        return all(r.holds() for r in self.reports if r.built)

    def exit_code(self) -> int:
        return 0 if self.holds() else 1

    def to_json(self) -> dict:
        return {
            "holds": self.holds(),
            "zoo": self.zoo,
            "summary": self.summary.to_json(),
            "models": [r.to_json() for r in self.reports],
        }


def selftest(
    specs: list[str],
    options: SelftestOptions | None = None,
    *,
    zoo: bool = False,
    on_model: Callable[[int, int, str], None] | None = None,
) -> SelftestResult:
    """Run every spec (`models.resolve`); with `zoo`, the specs are architectures of the sweep and a
    model that cannot be built is recorded, not raised. `on_model(i, n, spec)` is told before each."""
    from ffdebug.selftest.models import SelftestError, resolve

    options = options or SelftestOptions()
    if not zoo:
        for spec in specs:  # every spec resolves before the first model runs
            resolve(spec)
    result = SelftestResult(zoo=zoo)
    for i, spec in enumerate(specs):
        if on_model is not None:
            on_model(i, len(specs), spec)
        try:
            with _time_limit(MODEL_SECONDS if zoo else None, spec):
                report = run_model(spec, options)
        except SelftestError as e:
            if not zoo:
                raise
            report = ModelReport(spec, error=str(e))
        if report.error is not None and not zoo:
            raise SelftestError(report.error)
        result.reports.append(report)
    return result
