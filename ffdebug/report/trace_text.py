"""`ffdebug trace`'s text: one table per context (grad mode, `phase` tag), parameters and mask
summaries (docs/architecture.md "Layers", the report/ row)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ffdebug.trace import TraceResult

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


def _columns(table, numbers: tuple[str, ...]) -> None:
    """The name column, then `numbers`; every column folds (docs/cli.md "CLI conventions"). None is
    no_wrap or has a minimum width: rich narrows the widest column (the name) first, and a number
    wraps only when the names are down to its width, rather than being cut."""
    table.add_column("name", overflow="fold")
    for col in numbers:
        table.add_column(col, justify="left" if col in ("shape", "dtype") else "right", overflow="fold")


def _sources(rows) -> list[tuple[str, str, list[str]]]:
    """(name, where it comes from, contexts) per tap or return, one line for the contexts where
    the same module outputs (or none) match it."""
    lines: dict[tuple, tuple[str, str, list[str]]] = {}
    for r in rows:
        if r.source is None:
            continue
        parts = [r.kind] if r.kind != "tap" else []
        parts += [f"phase={r.phase}"] if r.phase else []
        parts += [] if r.grad_enabled else ["no_grad"]
        key = (r.name, r.source.relation, r.source.modules)
        if key not in lines:
            lines[key] = (r.name, r.source.describe(), [])
        lines[key][2].append(" ".join(parts) or "grad enabled")
    return list(lines.values())


def print_trace(result: TraceResult, max_rows: int = 200) -> None:
    """Rows per context (grad mode, phase), the parameters, the masks, the error if the function raised."""
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
                padding=0,
            )
            _columns(table, ("shape", "dtype", "mean", "std", "min", "max", "nan", "grad", "n"))
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
            padding=0,
        )
        _columns(table, ("shape", "dtype", "mean", "std", "min", "max", "nan", "grad"))
        for p in result.params[:max_rows]:
            table.add_row(*_cells(p, [])[:-1])
        console.print(table)
    sourced = _sources(result.rows)
    if sourced:
        console.print("[bold]where the taps come from[/bold]")
        width = max(len(name) for name, _, _ in sourced)
        for name, text, contexts in sourced:
            console.print(
                f"  {escape(name.ljust(width))}  {escape(text)} [dim]({escape('; '.join(contexts))})[/dim]"
            )
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
