"""`ffdebug compare`: per-stage float64 comparison of two sides."""

from __future__ import annotations

import typer

from ffdebug.cli.common import (
    ALIAS_FILE_OPT,
    ALLOW_PARTIAL_OPT,
    DIR_OPT,
    EXCLUDE_OPT,
    FAIL_ON_HELP,
    JSON_OPT,
    LAYERS_OPT,
    MAP_OPT,
    NOISE_OPT,
    SIDES_ARG,
    STAGES_OPT,
    STEP_OPT,
    THRESHOLD_OPT,
    check_fail_on,
    selection_options,
)
from ffdebug.verdict import Severity

HELP = """Compare a reference dump with a target dump, stage by stage, in float64.

[bold]Examples[/bold]

  ffdebug compare ref-vs-target --dir /tmp/dump
  ffdebug compare /tmp/dump/ref /tmp/dump/target --layers 0-3 --stages 'L*.ffn_*'
  ffdebug compare ref-vs-target --dir D --threshold 'final.logits:cos>=0.999,rel<=0.05' --json
  ffdebug compare run1 run2 --exact          # run-to-run determinism: any bit difference fails
  ffdebug compare ref-vs-target --dir D --workers 2   # two workers comparing whole tensors
  ffdebug compare --dir D --exclude 'L*' --alias-file taps.txt   # a trainer's scalars only
  ffdebug compare ref-vs-target --dir D --noise /tmp/dump/ref_2threads   # error beyond noise: diverge
  ffdebug compare ref-vs-target --dir D --threshold 'L*.attn_out:rel<=0.02,atol=1e-4'
  ffdebug compare ref-vs-target --dir ATOM_DIR      # ATOM hook files vs its ref_ files, one directory
  ffdebug compare SGL/baseline SGL/target           # SGLang dumper runs (docs/peer-dumps.md "Peer dumps")

Trainer stores (docs/trainer-taps.md): the inputs (rollout.prompt_ids, rollout.noise, ...) are
compared first, exactly; different ones exit 3 (feed both runs the same prompts / noise).

A stage with one element off by a quarter of max(|ref value|, rms(ref)) or more (elem >= 0.25) is
at least diverge, elem >= 1 bug; shapes that differ only by size-1 dims are unified.

Exit codes: 0 nothing at or above --fail-on and everything compared; 1 a difference at or above
it, or a generation that diverged after its first call ("generation diverged at call k"); 2 bad
input; 3 the two sides were fed different external inputs at a first call (token ids: fix
tokenization first; pixel_values, attention_mask, position_ids: the input is named); 4
incomplete: what was compared is fine but something was left out (the output names it: a side that
did not finish, a stage kind on one side only, a rank or call not compared, final outputs never
dumped, statistics-only stages); --allow-partial makes it 0.

Progress goes to stderr: a bar on a terminal, else a line every FFDEBUG_PROGRESS_INTERVAL seconds
(0: one per stage; docs/cli.md "Progress").
"""


def register(app: typer.Typer) -> None:
    @app.command("compare", help=HELP)
    def compare_command(
        sides: list[str] = SIDES_ARG,
        dir: str = DIR_OPT,
        layers: str = LAYERS_OPT,
        stages: list[str] = STAGES_OPT,
        exclude: list[str] = EXCLUDE_OPT,
        step: list[str] = STEP_OPT,
        rank: int = typer.Option(None, "--rank", help="Compare this rank only."),
        threshold: list[str] = THRESHOLD_OPT,
        noise: str = NOISE_OPT,
        exact: bool = typer.Option(False, "--exact", help="Any bit difference counts (determinism check)."),
        fail_on: str = typer.Option(
            None, "--fail-on", help=FAIL_ON_HELP + " Default diverge (drift with --exact)."
        ),
        problems: bool = typer.Option(False, "--problems", help="Show only stages that are not ok."),
        maps: list[str] = MAP_OPT,
        alias_file: str = ALIAS_FILE_OPT,
        allow_partial: bool = ALLOW_PARTIAL_OPT,
        json_out: bool = JSON_OPT,
        workers: int = typer.Option(
            None,
            "--workers",
            min=1,
            help="Workers comparing whole tensors in parallel: forked processes on Linux, else "
            "threads (default: one per free core); the output is bit-identical at any count.",
        ),
    ) -> None:
        from ffdebug.across.cli import run_command
        from ffdebug.comparison.engine import compare

        fail = check_fail_on(fail_on or (Severity.DRIFT if exact else Severity.DIVERGE))
        options = selection_options(
            layers=layers,
            stages=stages,
            exclude=exclude,
            step=step,
            rank=rank,
            threshold=threshold,
            noise=noise,
            fail_on=fail,
            allow_partial=allow_partial,
            maps=maps,
            alias_file=alias_file,
        ) | {"exact": exact, "workers": workers}

        def render(result) -> int:
            from ffdebug.report.sink import Output
            from ffdebug.report.text import print_compare

            Output(json=json_out).show(result, print_compare, only_problems=problems)
            return result.exit_code()

        raise typer.Exit(run_command(compare, sides, dir, options, render))
