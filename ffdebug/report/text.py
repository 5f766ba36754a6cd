"""Rich tables and the closing sentence for compare results."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ffdebug.report.safe_text import esc, key_markup, shown_key
from ffdebug.results import CompareResult, StageResult
from ffdebug.verdict import Severity

MARKS = {
    Severity.OK: ("✓", "green"),
    Severity.DRIFT: ("~", "yellow"),
    Severity.DIVERGE: ("!", "dark_orange"),
    Severity.BUG: ("✗", "red"),
    Severity.SCRAMBLE: ("✗✗", "magenta"),
}


def fmt(x, spec: str = ".6f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if spec == "%":
            return f"{x * 100:.3g}%"
        return format(x, spec)
    return str(x)


def severity_cell(sev: Severity | str) -> str:
    sev = str(sev)
    mark, colour = MARKS.get(sev, ("?", "white"))
    return f"[{colour}]{mark} {sev}[/{colour}]"


def stage_label(e: StageResult, multi_call: bool = False) -> str:
    label = key_markup(e.stage if e.layer is not None else e.key)
    extras = []
    if e.call is not None and multi_call:
        extras.append(f"call {e.call}")
    if e.step:
        extras.append(esc(",".join(f"{k}={v}" for k, v in e.step.items())))
    if e.rank:
        extras.append(f"rank {e.rank}")
    return label + (f" [dim]({'; '.join(extras)})[/dim]" if extras else "")


def stage_note(e: StageResult) -> str:
    """Why a row's numbers are special: shape mismatch, NaN/Inf positions, statistics only."""
    if e.finding == "shape_mismatch":
        return f"[red]shape {e.ref.shape} vs {e.target.shape}[/red]"
    if e.finding == "dtype_kind":
        return f"[red]dtype {e.ref.dtype} vs {e.target.dtype}[/red]"
    flags = []
    if e.nan_mismatch:
        flags.append(f"NaN differs at {e.nan_mismatch}")
    if e.inf_mismatch:
        flags.append(f"Inf differs at {e.inf_mismatch}")
    if flags:
        return f"[red]{', '.join(flags)}[/red]"
    if e.stats_only:
        return "[dim]statistics only[/dim]"
    if e.cos is None and e.rel is None:
        return f"[red]{esc(e.notes[0]) if e.notes else 'no finite values'}[/red]"
    return ""


NUMBER_COLUMNS = ("cos", "rel", "max_abs")


def compare_table(
    stages: list[StageResult], title: str | None = None, only_problems: bool = False, width: int | None = None
) -> Table:
    """One row per stage. Nothing is cut: every column folds (docs/cli.md "CLI conventions"). Within
    `width` (the terminal's, 80 when piped) the class column is capped so it gives way first, rich
    then narrows the widest column (the stage key) before any number, and a row's note (NaN,
    shape, stats) goes under its key. No column has a minimum width: one that rich could not honour
    would push the table past the terminal, where the console crops it."""
    multi_call = len({e.call for e in stages}) > 1
    shown = [e for e in stages if not (only_problems and e.ok)]
    cells = [stage_label(e, multi_call) + (f"\n{note}" if (note := stage_note(e)) else "") for e in shown]
    numbers = [(fmt(e.cos), fmt(e.rel, "%"), fmt(e.max_abs, ".3g")) for e in shown]
    widths = [max([len(col), *(len(row[i]) for row in numbers)]) for i, col in enumerate(NUMBER_COLUMNS)]
    marks = max((Text.from_markup(severity_cell(e.severity)).cell_len for e in shown), default=4)
    keys = max((Text.from_markup(c).cell_len for cell in cells for c in cell.split("\n")[:1]), default=5)
    class_width = 28
    if width is not None:  # 7 columns: 3 cells of padding + border each, plus the closing border
        room = max(16, width - 22 - marks - 5 - sum(widths))  # what the class and stage columns share
        stage_width = min(keys, 48, max(10, room - 5))  # the stage key's share; the class gets the rest
        class_width = max(5, min(28, room - stage_width))
    table = Table(title=title, show_lines=False, header_style="bold")
    table.add_column("", overflow="fold")
    table.add_column("layer", justify="right", overflow="fold")
    table.add_column("class", max_width=class_width, overflow="fold")
    table.add_column("stage", overflow="fold")
    for col in NUMBER_COLUMNS:
        table.add_column(col, justify="right", overflow="fold")
    for e, cell, nums in zip(shown, cells, numbers):
        table.add_row(
            severity_cell(e.severity),
            "" if e.layer is None else str(e.layer),
            esc(e.layer_class or ""),
            cell,
            *nums,
        )
    return table


def numbers(e: StageResult) -> str:
    """`cos 0.999000, rel 1.2%` (whichever exist)."""
    parts = []
    if e.cos is not None:
        parts.append(f"cos {e.cos:.6f}")
    if e.rel is not None:
        parts.append(f"rel {e.rel * 100:.3g}%")
    return ", ".join(parts)


def describe_stage(e: StageResult) -> str:
    """`layer 2 (moe), ffn_out: bug (cos …, rel …)`, or `final.logits: drift (…)` outside layers."""
    cls = f" ({e.layer_class})" if e.layer_class else ""
    nums = [numbers(e)] if numbers(e) else []
    if e.finding == "shape_mismatch":
        nums.append(f"shape {e.ref.shape} vs {e.target.shape}")
    if e.finding == "dtype_kind":
        nums.append(f"dtype {e.ref.dtype} vs {e.target.dtype}")
    where = f"layer {e.layer}{cls}, {e.stage}" if e.layer is not None else e.key
    if e.per_rank:
        where += f" on target rank {e.rank}"
    return f"{where}: {e.severity}" + (f" ({', '.join(nums)})" if nums else "")


def coverage_word(result) -> str:
    """The sentence's ending: `FAILED`; `; also not compared: …. FAILED` when a failed run also left
    things out; `FAILED (incomplete: …)` for exit 4; `PASSED (partial, allowed by --allow-partial:
    …)` when it was allowed; else `PASSED`."""
    code = result.exit_code()
    missing = "; ".join(result.coverage.missing)
    if code == 1:
        return (f"Also not compared: {missing}. " if missing else "") + "FAILED"
    if code == 4:
        return f"FAILED (incomplete: {missing})"
    return "PASSED" + (f" (partial, allowed by --allow-partial: {missing})" if missing else "")


def _at(result: CompareResult, e) -> str:
    """`describe_stage`, with the call named when the comparison holds more than one call, and
    which sequences' tokens are wrong when some are not (`comparison/token_runs.py`)."""
    from ffdebug.comparison.token_runs import sentence

    calls = {(s.call, tuple(sorted(s.step.items()))) for s in result.stages}
    tokens = sentence(e.token_runs)
    at = (f"call {e.call}, " if len(calls) > 1 and e.call is not None else "") + describe_stage(e)
    return at + (f" ({tokens})" if tokens else "")


def generation_sentence(gen, stages) -> str:
    """`Generation diverged at call k (…); first divergence of call k-1: …` (compare and bisect)."""
    before = [s for s in stages if not s.ok and s.call == gen.call - 1]
    first = before[0] if before else next((s for s in stages if not s.ok), None)
    head = gen.sentence()
    head = head[0].upper() + head[1:]
    if first is None:
        return f"{head}; every stage of the calls before it is ok"
    return f"{head}; first divergence of call {first.call}: {describe_stage(first)}"


def generation_conclusion(result: CompareResult, word: str) -> str:
    """`Generation diverged at call k (…); first divergence of call k-1 at …. FAILED`."""
    return f"{generation_sentence(result.generation, result.stages)}. {word}"


def compare_conclusion(result: CompareResult) -> str:
    first = result.first_divergence
    word = coverage_word(result)
    n = len(result.stages)
    how = " on statistics only (no cos; a rotation or permutation is invisible)" if result.stats_only else ""
    if result.generation is not None:
        return generation_conclusion(result, word)
    if first is None:
        tail = ""
        if result.warmup_skipped:
            tail = f" ({result.warmup_skipped} warm-up call(s) set aside)"
        return f"All {n} stages compared{how} are ok{tail}. {word}"
    inv = result.first_non_invariant
    if inv is not None:
        why = (
            "numerical: not bit-identical but inside the ok band (a rounding-size difference: another reduction "
            "order or kernel, or a real change too small for the bands; two deterministic runs of the same "
            "code are bit-identical)"
            if inv.invariance == "numerical"
            else "divergent: outside the ok band, the runs compute different things"
        )
        where = f"layer {inv.layer}, {inv.stage}" if inv.layer is not None else inv.key
        return f"First non-invariant stage: {where} ({why}); over {n} stages{how}. {word}"
    return (
        f"First divergence at {_at(result, first)}; verdict {result.verdict} over {n} stages{how} "
        f"(fail-on {result.fail_on}). {word}"
    )


def print_coverage(coverage, console: Console) -> None:
    """What was left out (every item, wrapped), and what a selection set aside."""
    for sentence in coverage.missing:
        console.print(Text("not compared: ", style="yellow") + Text(sentence), soft_wrap=False)
    for sentence in coverage.selected_out:
        console.print(Text(f"selected out: {sentence}", style="dim"))


def print_compare(result: CompareResult, console: Console | None = None, only_problems: bool = False) -> None:
    console = console or Console()
    title = f"{result.ref_path}  vs  {result.target_path}"
    console.print(compare_table(result.stages, title=title, only_problems=only_problems, width=console.width))
    for note in result.notes:
        console.print(f"[dim]note: {esc(note)}[/dim]")
    for label, keys in (("ref", result.only_ref), ("target", result.only_target)):
        if keys:  # every key, wrapped (long ones elided with their hash; --json holds them whole)
            shown = ", ".join(shown_key(k) for k in keys)
            console.print(Text(f"only in {label} ({len(keys)}): ", style="yellow") + Text(shown))
    print_coverage(result.coverage, console)
    console.print(compare_conclusion(result), highlight=False, markup=False)
