"""`ffdebug slot-invariance`: every batch slot of a run against slot 0 and a single-prompt run."""

from __future__ import annotations

import os

import typer

from ffdebug.cli.common import (
    ALLOW_PARTIAL_OPT,
    FAIL_ON_HELP,
    STAGES_OPT,
    STEP_OPT,
    check_fail_on,
    parse_step_filter,
)
from ffdebug.verdict import Severity

HELP = """Batch invariance: run the same prompt in every slot of a batch (and once alone), dump it,
and check that every slot gives the same tensors as slot 0, stage by stage. Names the first stage
that is not bit-identical and classifies it: numerical (inside the ok band: batch-variant kernels, a
kernel-stack property, not a model bug) or slot_bug (slot-dependent logic: masks, positions, cache).

[bold]Examples[/bold]

  ffdebug slot-invariance --dir /tmp/dump --slots 4               # D/target, batch of 4 copies
  ffdebug slot-invariance --dir D --side ref --slots 4 --single /tmp/single/ref
  ffdebug slot-invariance /tmp/dump/target --slots 8 --slot-dim 0 --exact --json

Token-flattened dumps (\\[num_tokens, hidden]) are split into equal chunks along --slot-dim.
Run-to-run determinism: ffdebug compare RUN1 RUN2 --exact.

Exit codes: 0 below --fail-on (with --exact: all bit-identical) and every stage compared; 1
otherwise; 2 bad input; 3 the slots were fed different input ids; 4 incomplete: stages not split
into slots, statistics only, missing from the single-prompt run, or a side that did not finish
(--allow-partial makes it 0).
"""


def _side_path(path: str | None, directory: str | None, side: str | None) -> str:
    from ffdebug.errors import FFDebugError
    from ffdebug.store.reader import sides_in

    if path and directory:
        raise FFDebugError("give either a side directory or --dir, not both")
    if path:
        return path
    if not directory:
        raise FFDebugError("give the batched run's side directory, or --dir D (with --side)")
    found = sides_in(directory)
    if side:
        if side not in found:
            raise FFDebugError(
                f"{directory}: side {side!r} not found (sides present: {', '.join(found) or 'none'})"
            )
        return os.path.join(directory, side)
    if "target" in found:
        return os.path.join(directory, "target")
    if len(found) == 1:
        return os.path.join(directory, found[0])
    raise FFDebugError(f"{directory}: sides {', '.join(found) or 'none'}; choose one with --side")


def register(app: typer.Typer) -> None:
    @app.command("slot-invariance", help=HELP)
    def slot_invariance_command(
        path: str = typer.Argument(None, help="Side directory of the batched run (or use --dir)."),
        dir: str = typer.Option(None, "--dir", help="Dump directory; the side is --side (default target)."),
        side: str = typer.Option(None, "--side", help="Side under --dir (default: target, or the only one)."),
        slots: int = typer.Option(..., "--slots", help="Batch size of the run (every slot the same prompt)."),
        slot_dim: int = typer.Option(0, "--slot-dim", help="Dim of the batch slots in the dumped tensors."),
        single: str = typer.Option(None, "--single", help="Side directory of a single-prompt run."),
        stages: list[str] = STAGES_OPT,
        step: list[str] = STEP_OPT,
        call: int = typer.Option(None, "--call", help="Which call (default: the first non-warm-up one)."),
        exact: bool = typer.Option(False, "--exact", help="Any bit difference fails."),
        fail_on: str = typer.Option(
            Severity.DRIFT.value,
            "--fail-on",
            help=FAIL_ON_HELP + " Default drift: identical prompts must agree.",
        ),
        allow_partial: bool = ALLOW_PARTIAL_OPT,
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        from ffdebug.bisection.invariance import slot_invariance

        result = slot_invariance(
            _side_path(path, dir, side),
            slots=slots,
            slot_dim=slot_dim,
            single=single,
            stages=tuple(stages or ()),
            step=parse_step_filter(step),
            call=call,
            fail_on=check_fail_on(fail_on),
            exact=exact,
            allow_partial=allow_partial,
        )
        from ffdebug.report.bisect_text import conclude, print_invariance
        from ffdebug.report.sink import Output

        conclude(result)
        Output(json=json_out).show(result, print_invariance)
        raise typer.Exit(result.exit_code())
