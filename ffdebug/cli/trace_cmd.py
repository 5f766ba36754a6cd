"""`ffdebug trace`: shape, dtype, statistics and requires_grad of every module output and tap of one step."""

from __future__ import annotations

from typing import Optional

import typer

from ffdebug.cli.common import emit_json, handles_errors

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

Rows are per module and per context (grad mode, `phase` tag): a rollout under no_grad and the
training forward of the same module are two rows; further calls are counted. Exit 1 when the traced
function raised (the trace up to that point is printed).
"""


def _print(result, max_rows: int) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ffdebug.report.text import fmt

    console = Console(highlight=False)
    if not result.rows and not result.masks:
        console.print(
            "[yellow]nothing traced: no torch module ran a forward and no ffdebug.tap was called "
            "(a compiled model bypasses module hooks)[/yellow]"
        )
    if result.rows:
        table = Table(title=f"trace of {result.entry}", header_style="bold")
        for col in ("name", "class", "shape", "dtype", "mean", "std", "min", "max", "nan", "grad", "calls"):
            table.add_column(col, justify="left" if col in ("name", "class", "shape", "dtype") else "right")
        for r in result.rows[:max_rows]:
            s = r.stats
            context = []
            if not r.grad_enabled:
                context.append("no_grad")
            if r.phase:
                context.append(r.phase)
            name = escape(r.name) + (f" [dim]({', '.join(context)})[/dim]" if context else "")
            if r.kind != "module":
                name = f"[bold]{name}[/bold] [dim]{r.kind}[/dim]"
            nan = (s.get("nan") or 0) + (s.get("inf") or 0)
            table.add_row(
                name,
                r.module_class or "",
                str(r.shape),
                r.dtype,
                fmt(s.get("mean"), ".4g"),
                fmt(s.get("std"), ".4g"),
                fmt(s.get("min"), ".4g"),
                fmt(s.get("max"), ".4g"),
                f"[red]{nan}[/red]" if nan else "0",
                "✓" if r.requires_grad else "·",
                str(r.calls),
            )
        console.print(table)
        if len(result.rows) > max_rows:
            console.print(
                f"[dim]{len(result.rows) - max_rows} more row(s): raise --max-rows or use --json[/dim]"
            )
    if result.params:
        table = Table(title="parameters", header_style="bold")
        for col in ("name", "shape", "dtype", "mean", "std", "min", "max", "grad"):
            table.add_column(col, justify="left" if col in ("name", "shape", "dtype") else "right")
        for p in result.params[:max_rows]:
            s = p.stats
            table.add_row(
                escape(p.name),
                str(p.shape),
                p.dtype,
                fmt(s.get("mean"), ".4g"),
                fmt(s.get("std"), ".4g"),
                fmt(s.get("min"), ".4g"),
                fmt(s.get("max"), ".4g"),
                "✓" if p.requires_grad else "·",
            )
        console.print(table)
    if result.masks:
        console.print("[bold]masks[/bold]")
        for m in result.masks:
            console.print(f"  {escape(m.describe())}")
    else:
        console.print(
            "[dim]masks: none seen (tap the loss mask as ffdebug.tap('loss_mask', mask) to summarise it)[/dim]"
        )
    if result.error:
        console.print(f"[red]the traced function raised: {escape(result.error)}[/red]")
    console.print(f"[dim]{len(result.rows)} row(s) in {result.elapsed_s:.1f} s[/dim]")


def register(app: typer.Typer) -> None:
    @app.command("trace", help=HELP)
    @handles_errors
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
        max_rows: int = typer.Option(200, "--max-rows", help="Rows to print (JSON has all)."),
        json_out: bool = typer.Option(False, "--json", help="Machine-readable output."),
    ) -> None:
        import tempfile

        from ffdebug.errors import FFDebugError
        from ffdebug.trace import trace, train_entry

        if (entry is None) == (train is None):
            raise FFDebugError("give either ENTRY (MODULE:FUNCTION or FILE.py:FUNCTION) or --train CONFIG")
        if steps < 1:
            raise FFDebugError(f"--steps {steps} is invalid: run at least one optimizer step")
        with tempfile.TemporaryDirectory(prefix="ffdebug-trace-") as tmp:
            argv = list(args or [])
            if train is not None:
                entry, argv = train_entry(train, steps, tmp)
            result = trace(entry, argv or None, tuple(modules or ()), depth, all_calls, params)
        if json_out:
            emit_json(result.to_json())
        else:
            _print(result, max_rows)
        raise typer.Exit(1 if result.error else 0)
