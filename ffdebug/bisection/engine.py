"""`bisect(ref, target)`: the first layer that introduces error, per layer class, the pattern, and
the sub-stage inside the first bad layer (dump-bisect phases 4 and 5).

Pipeline:
  1. compare the two sides (input-ids gate, call pairing with warm-up set aside, ranks folded,
     float64 metrics, bands, noise calibration) — `ffdebug.comparison.engine.compare`;
  2. (in compare) multi-rank target stages: declared folds, replicas compared rank by rank, and
     partial sums / shard concatenations tried when they disagree (`compare.shards`);
  3. per paired call, the layer error budget and the pattern (`pattern`); optionally re-run the
     target blocks on the reference's inputs to tell local from inherited error (`attribution`);
  4. inside the focus layer, the first block-level stage and the first sub-stage whose own step
     loses accuracy (`substage`);
  5. the result: the stable JSON keys (docs/bisect.md "JSON") plus extras, and one sentence.
"""

from __future__ import annotations

from dataclasses import dataclass

from ffdebug import verdict as V
from ffdebug.bisection import budget, training
from ffdebug.bisection import pattern as pat
from ffdebug.bisection.substage import first_lossy, largest_scale_step, largest_step
from ffdebug.models.blocks import declared_class, parse_layer_class_spec
from ffdebug.progress_hook import ProgressHook
from ffdebug.results import (
    BisectResult,
    CallRef,
    CallSummary,
    ClassSummary,
    LayerRow,
    StageResult,
    worst_of,
)
from ffdebug.verdict import PatternName, Severity


def _relabel(stages: list[StageResult], spec: str | None) -> None:
    if not spec:
        return
    parsed = parse_layer_class_spec(spec)
    for e in stages:
        if e.layer is not None:
            e.layer_class = declared_class(parsed, e.layer) or e.layer_class


EXACT_PREFIX_SIGNAL = "error appears after exactly equal stages in the same dtype"
BEYOND_NOISE_SIGNAL = "the stage's error is beyond the noise run's (k x its error, or after its exact prefix)"


def break_in_exact_prefix(stages: list[StageResult]) -> StageResult | None:
    """The first stage (execution order) that is not exactly equal while every earlier one is, in
    the same dtype on both sides and outside the noise run's reach; None when there is no such
    stage. Nothing upstream differs, so this stage's own computation does: a bug signal however
    small its error (docs/bisect.md "Bisecting")."""
    e = V.exact_prefix_end(stages)
    return e if e is not None and not budget.within_noise(e) else None


def _not_drift_with(
    p: pat.Pattern, signal: str | None, first: StageResult | None, worst: Severity = Severity.OK
) -> pat.Pattern:
    """`drift` says precision alone; a bug signal, or a stage at `diverge` or worse, says
    otherwise, so the pattern becomes `undetermined` with what contradicts it in its reason."""
    if p.name is not PatternName.DRIFT or (signal is None and not worst.at_least(Severity.DIVERGE)):
        return p
    where = first.key if first is not None else "a stage"
    said = signal if signal is not None else f"{worst.value} by its bands, beyond what precision does"
    why = f"{p.reason}; but {where}: {said}"
    return pat.Pattern(
        PatternName.UNDETERMINED, p.focus, p.introducing, why, signal, p.saturated_after, p.decided
    )


def _in_layer(stages: list[StageResult], layer) -> list[StageResult]:
    return [e for e in stages if layer is not None and e.layer == layer]


@dataclass
class CallAnalysis:
    """One paired call's layer budget, pattern, first divergent stage and sub-stage."""

    rows: list[LayerRow]
    pattern: pat.Pattern
    first: StageResult | None
    sub: StageResult | None
    why_sub: str
    signal: str | None

    @property
    def clean(self) -> bool:
        return self.pattern.name is PatternName.MATCH and self.first is None


def _analyse_call(stages: list[StageResult], attribution: list[dict] | None) -> CallAnalysis:
    rows = budget.layer_rows(stages)
    by_key = {e.key: e for e in stages}
    for row in rows:
        step_at, row.max_step = largest_step(_in_layer(stages, row.layer))
        row.max_step_key = step_at.key if step_at is not None else None
        scale_at, row.scale_step = largest_scale_step(_in_layer(stages, row.layer))
        row.scale_step_key = scale_at.key if scale_at is not None else None
    for a in attribution or []:
        row = next((r for r in rows if r.layer == a["layer"]), None)
        if row is not None:
            row.local, row.local_rel = a["verdict"], a["local_rel"]
    budget.mark_introducing(rows, by_key)
    _inside_an_exact_layer(stages, rows)
    p = pat.decide(rows, by_key)
    signal = p.signal
    if p.focus is not None and p.name is not PatternName.DRIFT:  # undetermined: where it starts
        in_layer = _in_layer(stages, p.focus.layer)
        first = (
            first_lossy(in_layer, block_only=True)[0]
            or first_lossy(in_layer)[0]
            or by_key.get(f"L{p.focus.layer:03d}.hidden_out")
        )
    else:  # drift or match: the first stage at diverge or worse, else outside the ok band
        first = next((e for e in stages if e.severity.at_least(Severity.DIVERGE)), None)
        first = first or next((e for e in stages if not e.ok), None)
        if p.name is PatternName.MATCH and first is None:
            first = break_in_exact_prefix(stages)
            signal = EXACT_PREFIX_SIGNAL if first is not None else None
    if signal is None and first is not None and first.beyond_noise:
        signal = BEYOND_NOISE_SIGNAL
    p = _not_drift_with(p, signal, first)
    sub, why_sub = first_lossy(_in_layer(stages, first.layer if first is not None else None))
    entered = _entered_between(stages, first.layer) if first is not None and first.layer is not None else None
    if entered is not None:  # the block's input already differs from what fed it: not the block's own
        first, sub = entered, entered
        why_sub = (
            "the block's input differs from the exactly equal output before it (error enters between them)"
        )
        signal = signal or EXACT_PREFIX_SIGNAL
    return CallAnalysis(rows, p, first, sub, why_sub, signal)


def _inside_an_exact_layer(stages: list[StageResult], rows: list[LayerRow]) -> None:
    """The exact prefix broken, above rounding, by a stage inside a layer whose own input is exact
    while no layer introduces error by the budget: that layer computes something of its own
    (a q projection scaled where a q norm after it cancels the scale: the block's output is
    bit-equal, q is not). The layer introduces error; its note names the stage."""
    if any(r.introduces for r in rows):
        return
    broken = break_in_exact_prefix(stages)
    if broken is None or broken.layer is None:
        return
    row = next((r for r in rows if r.layer == broken.layer), None)
    if row is None or not row.exact_in:
        return
    row.introduces = row.beyond_precision = True
    row.notes.append(
        f"{broken.key} differs after exactly equal stages (rel {broken.rel:.3g}) though the block's "
        "output does not: the layer computes something of its own"
    )


def _entered_between(stages: list[StageResult], layer: int) -> StageResult | None:
    """Layer `layer`'s `hidden_in` when it is not exactly equal, by more than rounding, while the
    stage that feeds it (the previous block's `hidden_out`, or `embed.out` before layer 0) is:
    something between them (an embedding norm, a scale) introduced the error."""
    by_key = {e.key: e for e in stages if (e.invocation or 0) == 0}
    hidden_in = by_key.get(f"L{layer:03d}.hidden_in")
    before = by_key.get(f"L{layer - 1:03d}.hidden_out") if layer > 0 else by_key.get("embed.out")
    if hidden_in is None or before is None or not budget.is_exact(before) or budget.is_exact(hidden_in):
        return None
    if not hidden_in.same_dtype or not V.above_rounding(
        hidden_in.rel, hidden_in.dtype_ref, hidden_in.dtype_target
    ):
        return None
    return None if budget.within_noise(hidden_in) else hidden_in


def _per_class(rows: list[LayerRow], p: pat.Pattern) -> list[ClassSummary]:
    """Per layer class: its layers, the first bad layer, the layers introducing error.

    `first_bad_layer` is the first layer of the class that the pattern blames when it localises
    the error (jump: the focus; layer_class: the introducing layers), so a class that merely
    carries inherited error has none; for drift and match it is the first layer whose block output
    is outside the ok band. `first_over_threshold` is always the latter."""
    out: dict[str, ClassSummary] = {}
    if p.name is PatternName.JUMP:
        blamed = {p.focus.layer}
    elif p.name is PatternName.LAYER_CLASS:
        blamed = set(p.introducing)
    else:
        blamed = None
    for r in rows:
        cls = r.layer_class or "?"
        c = out.setdefault(cls, ClassSummary(layer_class=cls))
        c.layers.append(r.layer)
        if r.introduces:
            c.introducing.append(r.layer)
        if r.added is not None:
            c.max_added = r.added if c.max_added is None else max(c.max_added, r.added)
        over = not V.is_ok(r.severity)
        if over and c.first_over_threshold is None:
            c.first_over_threshold = r.layer
        bad = over if blamed is None else r.layer in blamed
        if bad and c.first_bad_layer is None:
            c.first_bad_layer = r.layer
    return list(out.values())


def _by_call(stages: list[StageResult]) -> list[tuple[CallRef, list[StageResult]]]:
    """The stages of each paired call, in execution order; a call whose target ranks were each
    compared with a single-rank reference is analysed once per rank (shared stages in each).
    Calls are told apart by phase too: a trainer's rollout taps and its train-phase taps of one
    optimizer step share their counters but are two calls (docs/trainer-taps.md)."""
    groups: dict[tuple, tuple[CallRef, list[StageResult]]] = {}
    for e in stages:
        key = (tuple(sorted((str(k), str(v)) for k, v in e.step.items())), e.phase, e.call)
        tags = dict(e.step, phase=e.phase) if e.phase is not None else dict(e.step)
        groups.setdefault(key, (CallRef(e.call, tags), []))[1].append(e)
    out = []
    for ref, st in groups.values():
        ranks = sorted({e.rank for e in st if e.per_rank})
        if not ranks:
            out.append((ref, st))
            continue
        for rank in ranks:
            mine = [e for e in st if not e.per_rank or e.rank == rank]
            out.append((CallRef(ref.call, ref.step, rank), mine))
    return out


def _in_training_order(stages: list[StageResult], analyses: list, notes: list[str]) -> tuple | None:
    """The call holding the first divergence in training order (`training.locate`), its analysis
    naming that stage; None when every stage matches."""
    located = training.locate(stages)
    if located is None:
        return None
    notes.append(located.sentence())
    for ref, st, analysis in analyses:
        if any(e is located.stage for e in st):
            if located.stage.layer is None or analysis.first is None:
                analysis.first, analysis.sub, analysis.why_sub = located.stage, None, ""
            if located.exact_signal:
                analysis.signal = EXACT_PREFIX_SIGNAL
            elif located.stage.beyond_noise:
                analysis.signal = BEYOND_NOISE_SIGNAL
            return ref, st, analysis
    return None


def bisect(
    ref,
    target,
    *,
    layers=None,
    stages=(),
    step: dict | None = None,
    rank: int | None = None,
    thresholds=(),
    noise=None,
    fail_on: Severity | str = Severity.DIVERGE,
    layer_class: str | None = None,
    model_ref=None,
    model_target=None,
    allow_partial: bool = False,
    maps=(),
    alias_file: str | None = None,
    exclude=(),
    progress: ProgressHook | None = None,
    group=None,
) -> BisectResult:
    """Localise the first divergence of `target` from `ref` (paths or opened stores); `progress`
    follows the comparison underneath (`ffdebug.comparison.engine.compare`); `group`: the
    process group of a bisect across nodes (`ffdebug.across`; the analysis reads only the results).

    Raises InputIdsMismatch (exit 3) when the sides were fed different input ids, FFDebugError
    (exit 2) on unreadable input or a bad option.
    """
    from ffdebug.comparison.engine import compare
    from ffdebug.errors import FFDebugError

    if model_ref is not None and model_target is None:
        raise FFDebugError("--model-ref needs --model-target too (the block to re-run is the target's)")
    result = compare(
        ref,
        target,
        layers=layers,
        stages=tuple(stages),
        step=step,
        rank=rank,
        thresholds=tuple(thresholds),
        noise=noise,
        fail_on=fail_on,
        allow_partial=allow_partial,
        maps=maps,
        alias_file=alias_file,
        exclude=tuple(exclude),
        progress=progress,
        group=group,
    )
    notes = list(result.notes)
    _relabel(result.stages, layer_class)
    analyses, (chosen, st, analysis) = _choose_call(result, notes)
    attribution = None
    if model_target is not None:
        from ffdebug.bisection.attribution import attribute

        index = {id(e): i for i, e in enumerate(result.stages)}
        records = [result.records[index[id(e)]] for e in st]
        attribution = attribute(model_ref, model_target, records, st)
        analysis = _analyse_call(st, attribution)
    if len(analyses) > 1:
        on_rank = f" on target rank {chosen.rank}" if chosen.rank is not None else ""
        notes.append(
            f"{len(analyses)} paired calls; reporting call {chosen.call} {chosen.step or ''}{on_rank}".rstrip()
        )
    return _bisect_result(
        result, analyses, (chosen, st, analysis), attribution, notes, fail_on, allow_partial
    )


def _bisect_result(result, analyses, reported, attribution, notes, fail_on, allow_partial) -> BisectResult:
    """The BisectResult of the reported call `(call, its stages, its analysis)`."""
    chosen, st, analysis = reported
    judged = V.judge(worst_of(result.stages), analysis.signal)  # one grade: verdict and judgement
    p = _not_drift_with(analysis.pattern, analysis.signal, analysis.first, judged)
    return BisectResult(
        verdict=judged,
        judgement=judged,
        pattern=p.name,
        reason=p.reason,
        first_divergence=analysis.first,
        sub_stage=analysis.sub,
        sub_stage_why=analysis.why_sub,
        per_class=_per_class(analysis.rows, p),
        saturated_after=p.saturated_after,
        decided=p.decided,
        layers=analysis.rows,
        stages=st,
        ref_path=result.ref_path,
        target_path=result.target_path,
        call=chosen,
        calls=[CallSummary(ref, a.pattern.name, worst_of(s)) for ref, s, a in analyses],
        fail_on=V.parse_fail_on(fail_on),
        signal=analysis.signal,
        shards=result.shards,
        attribution=attribution,
        warmup_skipped=result.warmup_skipped,
        notes=notes,
        coverage=result.coverage,
        allow_partial=allow_partial,
        generation=result.generation,
        missing_inside=_missing_inside(result, analysis.first),
    )


def _missing_inside(result, first) -> list[str]:
    """Sub-stages of the first divergent layer the reference wrote and the target did not (a
    shared expert the port never runs): their keys without the layer prefix (`coverage`'s
    one-sided reference keys, form-excused kinds left out)."""
    if first is None or first.layer is None:
        return []
    prefix = f"L{first.layer:03d}."
    return [k[len(prefix) :] for k in result.coverage.keys_only_ref if k.startswith(prefix)]


def _before(generation, call: CallRef) -> bool:
    """`call` is the one just before the call where `generation` diverged (same step tags)."""
    step = {str(k): str(v) for k, v in generation.step.items()}
    return call.call == generation.call - 1 and {str(k): str(v) for k, v in call.step.items()} == step


def _choose_call(result, notes: list[str]):
    """One analysis per paired call, and the call reported: the first that is not a clean match
    (trainer stores: in training order, not call order; `notes` says why when that differs)."""
    from ffdebug.errors import FFDebugError

    analyses = [(key, st, _analyse_call(st, None)) for key, st in _by_call(result.stages)]
    if not analyses:
        raise FFDebugError(f"{result.ref_path} and {result.target_path}: no stage appears on both sides")
    chosen = next((a for a in analyses if not a[2].clean), analyses[0])
    if result.generation is not None:  # the call before the one whose ids differ is where to look
        chosen = next((a for a in analyses if _before(result.generation, a[0])), analyses[-1])
    if training.is_trainer_run(result.stages):
        in_order = _in_training_order(result.stages, analyses, notes)
        if in_order is None:
            _no_training_signal(result.stages, analyses, notes)
        chosen = in_order or chosen
    return analyses, chosen


def _no_training_signal(stages: list[StageResult], analyses: list, notes: list[str]) -> None:
    """Training order found no stage outside the ok band and no exact-prefix break above rounding.
    A call of a later optimizer step than the first stage whose bits part carries no exact-prefix
    signal of its own (its inputs, the weights, already differ by rounding since that step), so its
    signal is dropped and where the bits first part is noted; a call of that step keeps its own."""
    first = next((e for e in training.training_order(stages) if not e.exact), None)
    if first is None:
        return
    parted = training.step_of(first)
    dropped = False
    for _, st, analysis in analyses:
        if analysis.signal == EXACT_PREFIX_SIGNAL and st and min(training.step_of(e) for e in st) > parted:
            analysis.signal = None
            dropped = True
    if dropped:
        rel = f"rel {first.rel:.3g}, " if first.rel is not None else ""
        notes.append(
            "training order: no stage outside the ok band and no break of the exact prefix above "
            f"rounding; the bits first part at optimizer_step {first.step.get('optimizer_step')}, "
            f"{first.key} ({rel}within rounding); later steps inherit that difference"
        )


__all__ = ["BisectResult", "bisect"]
