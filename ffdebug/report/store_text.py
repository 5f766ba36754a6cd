"""Text for the commands that read one store: `ffdebug inspect`'s table and `ffdebug import`'s
summary (docs/architecture.md "Layers", the report/ row)."""

from __future__ import annotations


def _where(row: dict) -> str:
    """Layer, call, rank and step tags of a row, e.g. `layer 2 call 1 rank 0 step=3`."""
    parts = [f"layer {row['layer']}"] if row["layer"] is not None else []
    parts += [f"call {row['call']}"] if row["call"] is not None else []
    parts.append(f"rank {row['rank']}")
    parts += [f"{k}={v}" for k, v in (row["step"] or {}).items()]
    return " ".join(parts)


NUMBER_COLUMNS = ("mean", "std", "min", "max", "absmax")
KEY_MIN_WIDTH = 24  # narrower than this, a table's key column reads worse than a line of its own


def _cells(r: dict) -> tuple[str, ...]:
    """dtype, shape, the five statistics (`.4g`) and nan/inf of one row, as plain strings."""
    from ffdebug.report.text import fmt

    s = r["stats"] or {}
    numbers = tuple(fmt(s.get(col), ".4g") for col in NUMBER_COLUMNS)
    return (r["dtype"] or "-", str(r["shape"]), *numbers, f"{s.get('nan', 0)}/{s.get('inf', 0)}")


def _key_cell(r: dict) -> str:
    """The key (markup-safe), `(stats)` for a stats-only record, disagreements, where it was taken."""
    from ffdebug.report.safe_text import esc, key_markup

    cell = key_markup(r["key"]) + ("" if r["payload"] else " [dim](stats)[/dim]")
    for wrong in r["disagreements"]:
        cell += f"\n[red]manifest disagrees: {esc(wrong)}[/red]"
    return cell + f"\n[dim]{esc(_where(r))}[/dim]"


def _table_fits(cells: list[tuple[str, ...]], width: int) -> bool:
    """Whether a table keeps every number, dtype and shape on one line with a usable key column:
    each column as wide as its widest cell or header, 3 characters of border and padding each."""
    headers = ("dtype", "shape", *NUMBER_COLUMNS, "nan/inf")
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    return sum(widths) + KEY_MIN_WIDTH + 3 * (len(headers) + 1) + 1 <= width


def print_inspect(info: dict) -> None:
    """One table of every tensor (manifest disagreements in red), then the store's notes and
    problems. When the terminal is too narrow for the table to keep its numbers whole (80 columns,
    piped), each tensor is a key line and a line of `name=value` words instead: wrapped between
    words, never inside a number."""
    from rich.console import Console
    from rich.table import Table

    from ffdebug.report.safe_text import esc

    rows, complete = info["tensors"], info["complete"]
    console = Console()
    cells = [_cells(r) for r in rows]
    title = esc(f"{info['path']} ({info['kind']}, side {info['side']})")
    if _table_fits(cells, console.width):
        table = Table(title=title, header_style="bold")
        for col in ("key", "dtype", "shape", *NUMBER_COLUMNS, "nan/inf"):
            left = col in ("key", "dtype", "shape")
            table.add_column(col, justify="left" if left else "right", overflow="fold")  # wrapped, never cut
        for r, c in zip(rows, cells):
            table.add_row(_key_cell(r), *(esc(x) for x in c))
        console.print(table)
    else:
        console.print(f"[bold]{title}[/bold]")
        for r, (dtype, shape, *rest) in zip(rows, cells):
            numbers = " ".join(f"{col}={v}" for col, v in zip((*NUMBER_COLUMNS, "nan/inf"), rest))
            console.print(_key_cell(r), overflow="fold")
            console.print(esc(f"  {dtype} {shape.replace(' ', '')} {numbers}"), overflow="fold")
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
