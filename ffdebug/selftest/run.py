"""`ffdebug selftest`'s one entry: the models of the specs (or a zoo sample), their cases, one result."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ffdebug.selftest.cases import ModelReport, SelftestOptions, run_model
from ffdebug.selftest.zoo import Summary, summarise


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
            report = run_model(spec, options)
        except SelftestError as e:
            if not zoo:
                raise
            report = ModelReport(spec, error=str(e))
        if report.error is not None and not zoo:
            raise SelftestError(report.error)
        result.reports.append(report)
    return result
