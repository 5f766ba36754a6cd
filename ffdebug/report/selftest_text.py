"""`ffdebug selftest`'s text: a table per model, then the rates (docs/architecture.md "Layers", the report/ row)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from ffdebug.report.safe_text import esc

if TYPE_CHECKING:
    from ffdebug.selftest.cases import ModelReport
    from ffdebug.selftest.run import SelftestResult

MARK = {
    "holds": "[green]✓ holds[/green]",
    "fails": "[red]✗ fails[/red]",
    "no effect": "· no effect",
    "skipped": "· skipped",
}


def _model_table(report: ModelReport) -> Table:
    title = f"{report.spec}: {report.model_class}, {report.layers} layers, {report.parameters:,} parameters"
    table = Table(title=esc(title), header_style="bold")
    for column in ("", "case", "expected", "bisect said"):
        table.add_column(column, overflow="fold")  # wrapped at 80 columns, never cut
    for case in report.cases:
        got = esc(case.got) + (f" [dim]({esc(case.where)})[/dim]" if case.where else "")
        table.add_row(MARK.get(case.status, case.status), esc(case.name), esc(case.expected), got)
    return table


def print_selftest(result: SelftestResult, console: Console | None = None, detail: bool = True) -> None:
    console = console or Console()
    for report in result.reports:
        if not report.built:
            console.print(f"[red]✗ {esc(report.spec)}[/red]: {esc(report.error or '')}", highlight=False)
            continue
        if detail:
            console.print(_model_table(report))
            for note in report.notes:
                console.print(f"  note: {note}", highlight=False, markup=False)
    s = result.summary
    rates = ", ".join(f"{group} {rate}" for group, rate in s.groups.items())
    lines = [f"{s.built} of {s.attempted} model(s) built; cases holding: {rates or 'none run'}."]
    if result.zoo or len(result.reports) > 1:
        per_case = "; ".join(f"{name} {rate}" for name, rate in s.cases.items())
        lines.append(f"Per case: {per_case}.")
    failing = [f"{r.spec}: {c.name}" for r in result.reports for c in r.cases if c.status == "fails"]
    verdict = "PASSED" if result.holds() else f"FAILED ({len(failing)} case(s) do not hold)"
    console.print(" ".join(lines) + f" {verdict}", highlight=False)
