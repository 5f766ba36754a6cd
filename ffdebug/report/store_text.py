"""Text for the commands that read one store: `ffdebug inspect`'s table and `ffdebug import`'s
summary (docs/architecture.md "report/")."""

from __future__ import annotations


def _where(row: dict) -> str:
    """Layer, call, rank and step tags of a row, e.g. `layer 2 call 1 rank 0 step=3`."""
    parts = [f"layer {row['layer']}"] if row["layer"] is not None else []
    parts += [f"call {row['call']}"] if row["call"] is not None else []
    parts.append(f"rank {row['rank']}")
    parts += [f"{k}={v}" for k, v in (row["step"] or {}).items()]
    return " ".join(parts)


def print_inspect(info: dict) -> None:
    """One table of every tensor (manifest disagreements in red), then the store's notes and problems."""
    from rich.console import Console
    from rich.table import Table

    from ffdebug.report.safe_text import esc, key_markup
    from ffdebug.report.text import fmt

    rows, complete = info["tensors"], info["complete"]
    console = Console()
    table = Table(title=esc(f"{info['path']} ({info['kind']}, side {info['side']})"), header_style="bold")
    for col in ("key", "dtype", "shape", "mean", "std", "min", "max", "absmax", "nan/inf"):
        left = col in ("key", "dtype", "shape")
        table.add_column(col, justify="left" if left else "right", overflow="fold")  # wrapped, never cut
    for r in rows:
        s = r["stats"] or {}
        cell = key_markup(r["key"]) + ("" if r["payload"] else " [dim](stats)[/dim]")
        for wrong in r["disagreements"]:
            cell += f"\n[red]manifest disagrees: {esc(wrong)}[/red]"
        cell += f"\n[dim]{esc(_where(r))}[/dim]"
        table.add_row(
            cell,
            esc(r["dtype"] or "-"),
            str(r["shape"]),
            fmt(s.get("mean"), ".4g"),
            fmt(s.get("std"), ".4g"),
            fmt(s.get("min"), ".4g"),
            fmt(s.get("max"), ".4g"),
            fmt(s.get("absmax"), ".4g"),
            f"{s.get('nan', 0)}/{s.get('inf', 0)}",
        )
    console.print(table)
    if info["kind"] == "store" and not complete:
        console.print(
            f"[yellow]note: the run did not finish cleanly (no final status); {len(rows)} complete "
            f"tensors listed{', 1 partial manifest line skipped' if info['incomplete_lines'] else ''}[/yellow]"
        )
    for problem in info["problems"]:
        console.print(f"[yellow]problem: {esc(problem)}[/yellow]")
    for rank, st in sorted(info["status"].items()):
        if st.get("over_budget"):
            console.print(
                f"[yellow]note: {esc(rank)}: {esc(st['over_budget'])} capture(s) over the byte budget "
                "were counted, not written[/yellow]"
            )


def print_imported(imported: dict) -> None:
    """One line per side written (records, format, path), its problems below."""
    for w in imported["sides"]:
        print(f"{w['side']}: {w['records']} records ({w['format']}) -> {w['path']}")
        for p in w["problems"]:
            print(f"  problem: {p}")
