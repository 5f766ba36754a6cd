"""`ffdebug compare`: per-stage float64 comparison of two sides."""

from __future__ import annotations

import typer

from ffdebug.cli.common import (
    FAIL_ON_HELP,
    check_fail_on,
    emit_json,
    handles_errors,
    parse_step_filter,
    resolve_sides,
)

HELP = """Compare a reference dump with a target dump, stage by stage, in float64.

[bold]Examples[/bold]

  ffdebug compare ref-vs-target --dir /tmp/dump
  ffdebug compare /tmp/dump/ref /tmp/dump/target --layers 0-3 --stages 'L*.ffn_*'
  ffdebug compare ref-vs-target --dir D --threshold 'final.logits:cos>=0.999,rel<=0.05' --json
  ffdebug compare run1 run2 --exact          # run-to-run determinism: any bit difference fails

Exit codes: 0 nothing at or above --fail-on; 1 a difference at or above it; 2 bad input; 3 the two
sides were fed different input ids (fix tokenization first).
"""


def register(app: typer.Typer) -> None:
    @app.command("compare", help=HELP)
    @handles_errors
    def compare_command(
        sides: list[str] = typer.Argument(
            None, help="'ref-vs-target' (with --dir) or REF_SIDE_DIR TARGET_SIDE_DIR"
        ),
        dir: str = typer.Option(None, "--dir", help="Dump directory holding the side folders."),
        layers: str = typer.Option(None, "--layers", help="Layers to compare: '0,2,5-7,-1'."),
        stages: list[str] = typer.Option(None, "--stages", help="Glob over stage keys (repeatable)."),
        step: list[str] = typer.Option(None, "--step", help="Keep records tagged key=value (repeatable)."),
        rank: int = typer.Option(None, "--rank", help="Compare this rank only."),
        threshold: list[str] = typer.Option(
            None, "--threshold", help="'GLOB:cos>=X,rel<=Y' ok band per stage."
        ),
        noise: str = typer.Option(
            None, "--noise", help="A noise side (ref run twice or in the target dtype)."
        ),
        exact: bool = typer.Option(False, "--exact", help="Any bit difference counts (determinism check)."),
        fail_on: str = typer.Option(
            None, "--fail-on", help=FAIL_ON_HELP + " Default diverge (drift with --exact)."
        ),
        problems: bool = typer.Option(False, "--problems", help="Show only stages that are not ok."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output with the stable keys."),
    ) -> None:
        from ffdebug.compare.engine import compare

        fail = check_fail_on(fail_on or ("drift" if exact else "diverge"))
        ref, tgt = resolve_sides(sides, dir)
        result = compare(
            ref,
            tgt,
            layers=layers,
            stages=tuple(stages or ()),
            step=parse_step_filter(step),
            rank=rank,
            thresholds=tuple(threshold or ()),
            noise=noise,
            exact=exact,
            fail_on=fail,
        )
        if json_out:
            emit_json(result.to_json())
        else:
            from ffdebug.report.text import print_compare

            print_compare(result, only_problems=problems)
        raise typer.Exit(1 if result.failed() else 0)
