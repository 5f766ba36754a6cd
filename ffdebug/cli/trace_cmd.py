"""`ffdebug trace`: shape, dtype, statistics and requires_grad of every module output and tap of one step."""

from __future__ import annotations

from typing import Optional

import typer

HELP = """Run one training step (or a function of yours) and print, for every module output and every
ffdebug.tap: shape, dtype, mean, std, min, max, NaN count and requires_grad, plus a summary of every
mask (positions counted, first counted position). A first look before a bisect.

ENTRY is MODULE:FUNCTION or FILE.py:FUNCTION, called without arguments (ARGS after `--` become its
sys.argv); a dict of tensors it returns is traced too. --train CONFIG runs one optimizer step of the
reference trainer instead.

[bold]Examples[/bold]

  ffdebug trace --train examples/grpo/full/sd3_tiny/default.yaml
  ffdebug trace debug_step.py:one_step --params
  ffdebug trace mypkg.debug:one_step --modules '*.attn*' --json
  ffdebug trace reference_trainer.cli:main -- train CONFIG --max-steps 1

Each tap (and returned tensor) is matched to the module output it is: "the output of
TinyLM.model.norm" (the same tensor or storage), "a view of …", "equal to the output of …" (a
bit-equal copy), or "no module output equals it". The match holds the module outputs (references,
no copies) up to --match-memory MiB, oldest dropped first; 0 turns it off.

Rows are per module and per context (grad mode, `phase` tag): a rollout under no_grad and the
training forward of the same module are two rows; further calls are counted. Exit 1 when the traced
function raised (the trace up to that point is printed).
"""


def register(app: typer.Typer) -> None:
    """Add the `trace` command to `app`."""

    @app.command("trace", help=HELP)
    def trace_command(
        entry: Optional[str] = typer.Argument(None, help="MODULE:FUNCTION or FILE.py:FUNCTION to run."),
        args: list[str] = typer.Argument(
            None, help="Arguments for ENTRY (after --), passed as its sys.argv."
        ),
        train: Optional[str] = typer.Option(
            None, "--train", help="Reference-trainer config: trace one optimizer step."
        ),
        steps: int = typer.Option(1, "--steps", help="With --train: optimizer steps to run."),
        modules: list[str] = typer.Option(
            None, "--modules", help="Glob over module names to keep (repeatable)."
        ),
        depth: Optional[int] = typer.Option(
            None, "--depth", help="Keep modules at most this deep below their root."
        ),
        all_calls: bool = typer.Option(
            False, "--all-calls", help="One row per call instead of per module and context."
        ),
        params: bool = typer.Option(
            False, "--params", help="Also list the parameters of every traced root module."
        ),
        match_memory: float = typer.Option(
            512, "--match-memory", help="MiB of module outputs held to match taps to them (0: off)."
        ),
        max_rows: int = typer.Option(200, "--max-rows", help="Rows to print (JSON has all)."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        import tempfile

        from ffdebug.errors import FFDebugError
        from ffdebug.report.sink import Output
        from ffdebug.report.trace_text import print_trace
        from ffdebug.trace import trace, train_entry

        if (entry is None) == (train is None):
            raise FFDebugError("give either ENTRY (MODULE:FUNCTION or FILE.py:FUNCTION) or --train CONFIG")
        if steps < 1:
            raise FFDebugError(f"--steps {steps} is invalid: run at least one optimizer step")
        with tempfile.TemporaryDirectory(prefix="ffdebug-trace-") as tmp:
            argv = list(args or [])
            if train is not None:
                entry, argv = train_entry(train, steps, tmp)
            result = trace(entry, argv or None, tuple(modules or ()), depth, all_calls, params, match_memory)
        Output(json=json_out).show(result, print_trace, max_rows=max_rows)
        raise typer.Exit(1 if result.error else 0)
