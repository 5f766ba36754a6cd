"""`ffdebug demo`'s text: what it runs, the comparison, and whether the injected bug was located
(docs/architecture.md "Layers", the report/ row)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console

from ffdebug.report.text import print_compare

if TYPE_CHECKING:
    from ffdebug.demo import DemoRun


def print_demo_start(console: Console) -> None:
    """The two progress lines shown while the sides are dumped (stderr under --json)."""
    console.print(
        "[bold]ffdebug demo[/bold]: tiny DeepSeek-V3-style LM (1 dense + 3 MoE layers); "
        "target forgets routed_scaling_factor in the MoE router."
    )
    console.print("dumping ref and target (one process each, FFDEBUG_FWD_DUMP_* env vars) …")


def print_demo(run: DemoRun, console: Console | None = None) -> None:
    """The comparison table, then the expected and found first divergence and the commands to re-run."""
    from ffdebug.demo import EXPECTED

    console = console or Console()
    print_compare(run.compare, console=console)
    first = run.compare.first_divergence
    where = (first.layer, first.layer_class, first.stage) if first else (None, None, None)
    console.print(
        f"\nDumps in {run.directory}. The injected bug was expected at layer {EXPECTED['layer']} "
        f"({EXPECTED['layer_class']}), {EXPECTED['stage']}; ffdebug's first divergence is layer "
        f"{where[0]} ({where[1]}), {where[2]}: "
        f"{'located' if run.located else 'NOT located'} in {run.elapsed_s:.1f} s.",
        highlight=False,
    )
    console.print(f"\nBisect: {run.bisect['conclusion']}", highlight=False, markup=False)
    console.print(
        f"Re-run the comparison: ffdebug compare ref-vs-target --dir {run.directory}; the bisect: "
        f"ffdebug bisect --dir {run.directory} --html report.html",
        highlight=False,
    )
