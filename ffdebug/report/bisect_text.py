"""Rich output and the closing sentence for bisect and slot-invariance results (no torch)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ffdebug.comparison.token_runs import sentence as token_sentence
from ffdebug.report.safe_text import esc, key_markup
from ffdebug.report.text import (
    compare_table,
    coverage_word,
    fmt,
    generation_sentence,
    numbers,
    print_coverage,
    severity_cell,
)
from ffdebug.results import SLOT_MEANING, BisectResult, InvarianceResult
from ffdebug.verdict import PatternName

PATTERN_WORDS = {
    PatternName.MATCH: "no layer introduces error beyond noise",
    PatternName.JUMP: "a jump (one layer introduces the error)",
    PatternName.LAYER_CLASS: "a layer-class pattern",
    PatternName.DRIFT: "drift (rounding of the dtypes compounding, within precision)",
    PatternName.UNDETERMINED: "undetermined (error beyond precision the layer budget cannot place)",
}


def bisect_sentence(result: BisectResult) -> str:
    """One plain sentence: layer, class, stage, pattern, then PASSED / FAILED."""
    word = coverage_word(result)
    first, p = result.first_divergence, result.pattern
    if result.generation is not None:  # the rule compare uses (results.stages.fails)
        return f"{generation_sentence(result.generation, result.stages)}; pattern {p}, {_verdict(result)}. {word}"
    if first is None:
        tail = f" ({result.warmup_skipped} warm-up call(s) set aside)" if result.warmup_skipped else ""
        what = (
            "the sides match"
            if p is PatternName.MATCH
            else f"pattern {p}: {result.reason}, every stage inside the ok band"
        )
        return f"No divergence: {what}{tail}; verdict {result.verdict}. {word}"
    if first.layer is None:
        where = f"{first.key} (outside the layers)"
    else:
        where = f"layer {first.layer} ({first.layer_class or 'no class'}), {first.stage}"
    if first.per_rank:
        where += f" on target rank {first.rank}"
    tokens = token_sentence(first.token_runs)
    if tokens:
        where += f" ({tokens})"
    sub = result.sub_stage
    inside = ""
    if sub is not None and first.layer is not None:
        said = numbers(sub) or "; ".join(sub.notes[:1])  # a shape mismatch has no numbers
        said = f" ({said})" if said else ""
        if sub.stage != first.stage:
            inside = f"; inside it, {sub.stage} is the first sub-stage to lose accuracy{said}"
        else:
            inside = f" is the first sub-stage to lose accuracy{said}"
    if result.missing_inside:
        families: dict[str, list[str]] = {}  # moe.shared.gate.out, moe.shared.out -> moe.shared.*
        for k in result.missing_inside:
            families.setdefault(".".join(k.split(".")[:2]), []).append(k)
        shown = [ks[0] if len(ks) == 1 else f"{fam}.* ({len(ks)} stages)" for fam, ks in families.items()]
        inside += f"; the target wrote none of {', '.join(shown[:4])} there (dumped by the reference only)"
    if p is PatternName.LAYER_CLASS:
        pattern = f"pattern layer_class: {result.reason}, so the {first.layer_class} code path is implicated"
    elif p is PatternName.JUMP:
        pattern = f"pattern jump: {result.reason}"
    elif p is PatternName.DRIFT:
        pattern = f"pattern drift: {result.reason}"
    elif p is PatternName.UNDETERMINED:
        pattern = f"pattern undetermined: {result.reason}"
    else:
        pattern = "pattern match: no layer introduces error, the difference is outside the layers"
    signal = f" (bug signal: {result.signal})" if result.signal else ""
    return (
        f"First divergence at {where}{inside}; {pattern}{signal}; "
        f"{first.severity} ({numbers(first)}), {_verdict(result)}. {word}"
    )


def conclude(result: BisectResult | InvarianceResult) -> BisectResult | InvarianceResult:
    """Write the closing sentence into the result (the analysis itself renders nothing)."""
    if isinstance(result, InvarianceResult):
        result.conclusion = invariance_sentence(result)
    else:
        result.conclusion = bisect_sentence(result)
    return result


def _verdict(result: BisectResult) -> str:
    raised = (
        result.signal
        and result.first_divergence is not None
        and result.first_divergence.severity != result.verdict
    )
    return f"verdict {result.verdict}" + (" (raised by the bug signal)" if raised else "")


def layers_table(result) -> Table:
    table = Table(title="layers (block output vs reference)", header_style="bold")
    for col in ("", "layer", "class", "cos out", "rel in", "rel out", "added", "introduces", "local?"):
        justify = "left" if col in ("", "class", "introduces", "local?") else "right"
        table.add_column(col, justify=justify, overflow="fold")  # wrapped at 80 columns, never cut
    for r in result.layers:
        table.add_row(
            severity_cell(r.severity),
            str(r.layer),
            esc(r.layer_class or ""),
            fmt(r.cos_out),
            fmt(r.rel_in, "%"),
            fmt(r.rel_out, "%"),
            fmt(r.added, "%"),
            "[red]yes[/red]" if r.introduces else "",
            r.local or "",
        )
    return table


def first_divergence_or_partial(result: BisectResult) -> bool:
    """Something to locate: a divergence, or a comparison that is not complete."""
    return result.first_divergence is not None or not result.complete


def _no_layer_table(result: BisectResult) -> str:
    """Why there is no layer table, true to what the stores hold."""
    from ffdebug.bisection.training import is_trainer_run

    if not any(e.layer is not None for e in result.stages):
        if len(result.calls) > 1:  # the stages are the reported call's; another call may hold layers
            if result.call.call is None:
                return "No layer table: the call reported holds taps made outside a model's forward only."
            return (
                f"No layer table: the call reported (call {result.call.call}) holds no layer stage (L<n>.*)."
            )
        return "No layer table: neither store holds a layer stage (L<n>.*)."
    if is_trainer_run(result.stages):
        return (
            "No layer table: a training run's layer stages (L<n>.*) belong to many forwards; they are "
            "bisected in training order (the training-order line below)."
        )
    return "No layer table: the layer stages (L<n>.*) were compared, but no layer was paired on both sides."


def print_bisect(
    result: BisectResult, console: Console | None = None, all_stages: bool = False, html: str | None = None
) -> None:
    """The layer table, the stages, the notes and the one-sentence conclusion; `html`: the report written."""
    console = console or Console()
    if result.layers:
        console.print(layers_table(result))
    elif first_divergence_or_partial(result):  # an empty table would look like a rendering fault
        console.print(_no_layer_table(result))
    first = result.first_divergence
    if first is not None and first.layer is not None and not all_stages:
        rows = [e for e in result.stages if e.layer == first.layer]
        console.print(
            compare_table(rows, title=f"inside layer {first.layer} (execution order)", width=console.width)
        )
    elif all_stages or first is not None:
        console.print(
            compare_table(result.stages, title="stages", only_problems=not all_stages, width=console.width)
        )
    for c in result.per_class:
        console.print(
            f"class {esc(c.layer_class)}: layers {_ranges(c.layers)}; first bad layer "
            f"{c.first_bad_layer if c.first_bad_layer is not None else '-'}; introducing "
            f"{_ranges(c.introducing) or '-'}",
            highlight=False,
        )
    for s in result.shards:
        status = "matches" if s["matches"] else "does NOT match"
        how = s.get("explained_by") or s.get("reading") or "no reading"
        console.print(
            f"shards: {key_markup(s['key'])} over {s['ranks']} ranks {status} as {how}", highlight=False
        )
    for a in result.attribution or []:
        console.print(
            f"attribution: layer {a['layer']} re-run on the reference input: rel {fmt(a['local_rel'], '%')} "
            f"(dumped {fmt(a['dumped_rel'], '%')}) -> {a['verdict']}",
            highlight=False,
        )
    for note in result.notes:
        console.print(f"[dim]note: {esc(note)}[/dim]")
    print_coverage(result.coverage, console)
    console.print(result.conclusion or bisect_sentence(result), highlight=False, markup=False)
    if html:
        print(f"HTML report: {html}")


def _ranges(xs: list[int]) -> str:
    xs = sorted(xs)
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def invariance_sentence(result: InvarianceResult) -> str:
    word = coverage_word(result)
    first = result.first_non_invariant
    if first is None:
        return f"All {len(result.stages)} stages are bit-identical across {result.slots} slots. {word}"
    c = first.compare
    return (
        f"First non-invariant stage: {first.stage.key} (slot {c.slot} vs {c.against}), "
        f"{first.classification}: {SLOT_MEANING[first.classification]} ({numbers(c)}). {word}"
    )


def print_invariance(result: InvarianceResult, console: Console | None = None) -> None:
    console = console or Console()
    table = Table(title=f"slot invariance ({result.slots} slots, dim {result.slot_dim})", header_style="bold")
    for col in ("", "layer", "stage", "worst slot", "cos", "rel", "bit-equal", "vs single"):
        table.add_column(col, overflow="fold")
    for s in result.stages:
        w = s.worst
        table.add_row(
            severity_cell(w.severity),
            "" if s.layer is None else str(s.layer),
            key_markup(s.key),
            str(w.slot),
            fmt(w.cos),
            fmt(w.rel, "%"),
            fmt(w.bit_equal, ".3f"),
            "-" if s.single is None else str(s.single.severity),
        )
    console.print(table)
    for note in result.notes:
        console.print(f"[dim]note: {esc(note)}[/dim]")
    print_coverage(result.coverage, console)
    console.print(invariance_sentence(result), highlight=False, markup=False)
