"""Rich tables and the closing sentence for compare results."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

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


def compare_table(stages: list[dict], title: str | None = None, only_problems: bool = False) -> Table:
    table = Table(title=title, show_lines=False, header_style="bold")
    for col, justify in (
        ("", "left"),
        ("layer", "right"),
        ("class", "left"),
        ("stage", "left"),
        ("cos", "right"),
        ("rel", "right"),
        ("max_abs", "right"),
    ):
        table.add_column(col, justify=justify, no_wrap=col in ("", "layer"))
    calls = {e.get("call") for e in stages}
    for e in stages:
        if only_problems and e["severity"] == "ok":
            continue
        e = dict(e, _multi_call=len(calls) > 1)
        note = " [dim](stats)[/dim]" if e.get("stats_only") else ""
        if e.get("finding") == "shape_mismatch":
            note = f" [red]shape {e['shape_ref']} vs {e['shape_target']}[/red]"
        table.add_row(
            severity_cell(e["severity"]),
            "" if e.get("layer") is None else str(e["layer"]),
            e.get("layer_class") or "",
            stage_label(e) + note,
            fmt(e.get("cos")),
            fmt(e.get("rel"), "%"),
            fmt(e.get("max_abs"), ".3g"),
        )
    return table


def describe_stage(e: dict) -> str:
    where = f"layer {e['layer']}" if e.get("layer") is not None else "stage"
    cls = f" ({e['layer_class']})" if e.get("layer_class") else ""
    nums = []
    if e.get("cos") is not None:
        nums.append(f"cos {e['cos']:.6f}")
    if e.get("rel") is not None:
        nums.append(f"rel {e['rel'] * 100:.3g}%")
    if e.get("finding") == "shape_mismatch":
        nums.append(f"shape {e['shape_ref']} vs {e['shape_target']}")
    stage = e["stage"] if e.get("layer") is not None else e["key"]
    return f"{where}{cls}, {stage}: {e['severity']}" + (f" ({', '.join(nums)})" if nums else "")


def compare_conclusion(result) -> str:
    first = result.first_divergence
    word = "FAILED" if result.failed() else "PASSED"
    n = len(result.stages)
    if first is None:
        tail = ""
        if result.warmup_skipped:
            tail = f" ({result.warmup_skipped} warm-up call(s) set aside)"
        return f"All {n} compared stages are ok{tail}. {word}"
    return (
        f"First divergence at {describe_stage(first)}; verdict {result.verdict} over {n} stages "
        f"(fail-on {result.fail_on}). {word}"
    )


def print_compare(result, console: Console | None = None, only_problems: bool = False) -> None:
    console = console or Console()
    title = f"{result.ref_path}  vs  {result.target_path}"
    console.print(compare_table(result.stages, title=title, only_problems=only_problems))
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
