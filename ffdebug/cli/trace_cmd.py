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


_SHORT_DTYPES = {
    "float32": "f32",
    "float64": "f64",
    "float16": "f16",
    "bfloat16": "bf16",
    "int64": "i64",
    "int32": "i32",
}


def _cells(r, roots: list[str]) -> list[str]:
    """Table cells of one row; module names are shown below their root (`TinyLM.embed` -> `  embed`)."""
    from rich.markup import escape

    from ffdebug.report.text import fmt

    name = r.name
    if r.kind == "module":
        root = next((x for x in roots if name == x or name.startswith(x + ".")), None)
        if root is not None and name != root:
            name = "  " + name[len(root) + 1 :]
        name = escape(name)
    elif r.kind == "param":
        name = escape(name)
    else:
        name = f"[bold]{escape(name)}[/bold] [dim]{r.kind}[/dim]"
    s = r.stats
    nan = (s.get("nan") or 0) + (s.get("inf") or 0)
    return [
        name,
        "[" + ",".join(str(d) for d in r.shape) + "]",
        _SHORT_DTYPES.get(r.dtype, r.dtype),
        fmt(s.get("mean"), ".3g"),
        fmt(s.get("std"), ".3g"),
        fmt(s.get("min"), ".3g"),
        fmt(s.get("max"), ".3g"),
        f"[red]{nan}[/red]" if nan else "0",
        "✓" if r.requires_grad else "·",
        str(r.calls),
    ]


def _print(result, max_rows: int) -> None:
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(highlight=False)
    if not result.rows and not result.masks:
        console.print(
            "[yellow]nothing traced: no torch module ran a forward and no ffdebug.tap was called "
            "(a compiled model bypasses module hooks)[/yellow]"
        )
    if result.rows:
        console.print(f"[bold]trace of {escape(result.entry)}[/bold]")
        contexts: dict[tuple, list] = {}
        for r in result.rows[:max_rows]:
            contexts.setdefault((r.grad_enabled, r.phase), []).append(r)
        roots = sorted(
            {r.name.split(".")[0] for r in result.rows if r.kind == "module"}, key=len, reverse=True
        )
        for (grad, phase), rows in contexts.items():
            title = ("grad enabled" if grad else "no_grad") + (f", phase={phase}" if phase else "")
            table = Table(
                title=title,
                title_justify="left",
                header_style="bold",
                box=box.SIMPLE_HEAD,
                pad_edge=False,
                padding=(0, 1, 0, 0),
            )
            table.add_column("name", overflow="fold", min_width=16)
            for col in ("shape", "dtype", "mean", "std", "min", "max", "nan", "grad", "n"):
                table.add_column(col, justify="left" if col in ("shape", "dtype") else "right", no_wrap=True)
            for r in rows:
                table.add_row(*_cells(r, roots))
            console.print(table)
        if len(result.rows) > max_rows:
            console.print(
                f"[dim]{len(result.rows) - max_rows} more row(s): raise --max-rows or use --json[/dim]"
            )
    if result.params:
        table = Table(
            title="parameters",
            title_justify="left",
            header_style="bold",
            box=box.SIMPLE_HEAD,
            pad_edge=False,
            padding=(0, 1, 0, 0),
        )
        table.add_column("name", overflow="fold", min_width=16)
        for col in ("shape", "dtype", "mean", "std", "min", "max", "nan", "grad"):
            table.add_column(col, justify="left" if col in ("shape", "dtype") else "right", no_wrap=True)
        for p in result.params[:max_rows]:
            table.add_row(*_cells(p, [])[:-1])
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
    """Add the `trace` command to `app`."""

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
