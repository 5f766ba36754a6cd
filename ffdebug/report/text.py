"""Rich tables and the closing sentence for compare results."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

MARKS = {
    "ok": ("✓", "green"),
    "drift": ("~", "yellow"),
    "diverge": ("!", "dark_orange"),
    "bug": ("✗", "red"),
    "scramble": ("✗✗", "magenta"),
}


def fmt(x, spec: str = ".6f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if spec == "%":
            return f"{x * 100:.3g}%"
        return format(x, spec)
    return str(x)


def severity_cell(sev: str) -> str:
    mark, colour = MARKS.get(sev, ("?", "white"))
    return f"[{colour}]{mark} {sev}[/{colour}]"


def stage_label(e: dict) -> str:
    label = e["stage"] if e.get("layer") is not None else e["key"]
    extras = []
    if e.get("call") is not None and e.get("_multi_call"):
        extras.append(f"call {e['call']}")
    if e.get("step"):
        extras.append(",".join(f"{k}={v}" for k, v in e["step"].items()))
    if e.get("rank"):
        extras.append(f"rank {e['rank']}")
    return label + (f" [dim]({'; '.join(extras)})[/dim]" if extras else "")


def stage_note(e: dict) -> str:
    """Why a row's numbers are special: shape mismatch, NaN/Inf positions, statistics only."""
    if e.get("finding") == "shape_mismatch":
        return f"[red]shape {e['shape_ref']} vs {e['shape_target']}[/red]"
    flags = []
    if e.get("nan_mismatch"):
        flags.append(f"NaN differs at {e['nan_mismatch']}")
    if e.get("inf_mismatch"):
        flags.append(f"Inf differs at {e['inf_mismatch']}")
    if flags:
        return f"[red]{', '.join(flags)}[/red]"
    if e.get("stats_only"):
        return "[dim]statistics only[/dim]"
    if e.get("cos") is None and e.get("rel") is None:
        return f"[red]{e['notes'][0] if e.get('notes') else 'no finite values'}[/red]"
    return ""


NUMBER_WIDTHS = (("cos", 8), ("rel", 6), ("max_abs", 8))


def compare_table(
    stages: list[dict], title: str | None = None, only_problems: bool = False, width: int | None = None
) -> Table:
    """One row per stage. Numbers and stage keys are never cut: within `width` (the terminal's)
    the class column gives way first, and a row's note (NaN, shape, stats) goes under its key."""
    multi_call = len({e.get("call") for e in stages}) > 1
    shown = [dict(e, _multi_call=multi_call) for e in stages if not (only_problems and e["severity"] == "ok")]
    cells = [stage_label(e) + (f"\n{note}" if (note := stage_note(e)) else "") for e in shown]
    marks = max((Text.from_markup(severity_cell(e["severity"])).cell_len for e in shown), default=4)
    keys = max((Text.from_markup(c).cell_len for cell in cells for c in cell.split("\n")[:1]), default=5)
    class_width = 28
    if width is not None:  # 7 columns: 3 cells of padding + border each, plus the closing border
        class_width = max(5, min(28, width - 22 - marks - 5 - keys - sum(w for _, w in NUMBER_WIDTHS)))
    table = Table(title=title, show_lines=False, header_style="bold")
    table.add_column("", no_wrap=True, min_width=marks)
    table.add_column("layer", justify="right", no_wrap=True, min_width=5)
    table.add_column("class", max_width=class_width, no_wrap=True, overflow="ellipsis")
    table.add_column("stage", min_width=min(keys, 48), overflow="fold")
    for col, w in NUMBER_WIDTHS:
        table.add_column(col, justify="right", no_wrap=True, min_width=w)
    for e, cell in zip(shown, cells):
        table.add_row(
            severity_cell(e["severity"]),
            "" if e.get("layer") is None else str(e["layer"]),
            e.get("layer_class") or "",
            cell,
            fmt(e.get("cos")),
            fmt(e.get("rel"), "%"),
            fmt(e.get("max_abs"), ".3g"),
        )
    return table


def describe_stage(e: dict) -> str:
    """`layer 2 (moe), ffn_out: bug (cos …, rel …)`, or `final.logits: drift (…)` outside layers."""
    cls = f" ({e['layer_class']})" if e.get("layer_class") else ""
    nums = []
    if e.get("cos") is not None:
        nums.append(f"cos {e['cos']:.6f}")
    if e.get("rel") is not None:
        nums.append(f"rel {e['rel'] * 100:.3g}%")
    if e.get("finding") == "shape_mismatch":
        nums.append(f"shape {e['shape_ref']} vs {e['shape_target']}")
    where = f"layer {e['layer']}{cls}, {e['stage']}" if e.get("layer") is not None else e["key"]
    return f"{where}: {e['severity']}" + (f" ({', '.join(nums)})" if nums else "")


def compare_conclusion(result) -> str:
    first = result.first_divergence
    word = "FAILED" if result.failed() else "PASSED"
    n = len(result.stages)
    how = " on statistics only (no cos; a rotation or permutation is invisible)" if result.stats_only else ""
    if first is None:
        tail = ""
        if result.warmup_skipped:
            tail = f" ({result.warmup_skipped} warm-up call(s) set aside)"
        return f"All {n} stages compared{how} are ok{tail}. {word}"
    inv = result.first_non_invariant
    if inv is not None:
        why = (
            "numerical: not bit-identical but inside the ok band (nondeterministic kernels or reduction order)"
            if inv["invariance"] == "numerical"
            else "divergent: outside the ok band, the runs compute different things"
        )
        where = f"layer {inv['layer']}, {inv['stage']}" if inv.get("layer") is not None else inv["key"]
        return f"First non-invariant stage: {where} ({why}); over {n} stages{how}. {word}"
    return (
        f"First divergence at {describe_stage(first)}; verdict {result.verdict} over {n} stages{how} "
        f"(fail-on {result.fail_on}). {word}"
    )


def print_compare(result, console: Console | None = None, only_problems: bool = False) -> None:
    console = console or Console()
    title = f"{result.ref_path}  vs  {result.target_path}"
    console.print(compare_table(result.stages, title=title, only_problems=only_problems, width=console.width))
    for note in result.notes:
        console.print(f"[dim]note: {note}[/dim]")
    if result.only_ref:
        console.print(
            f"[yellow]only in ref ({len(result.only_ref)}):[/yellow] {', '.join(result.only_ref[:12])}"
            + (" …" if len(result.only_ref) > 12 else "")
        )
    if result.only_target:
        console.print(
            f"[yellow]only in target ({len(result.only_target)}):[/yellow] "
            f"{', '.join(result.only_target[:12])}" + (" …" if len(result.only_target) > 12 else "")
        )
    console.print(compare_conclusion(result), highlight=False, markup=False)
