"""`compare(ref, target)`: pair two sides, gate on input ids, compute metrics, grade severities."""

from __future__ import annotations

import dataclasses
import math

from ffdebug import verdict as V
from ffdebug.capture.stage_map import StageMap
from ffdebug.compare import near_zero, parallel
from ffdebug.compare.align import TokenLayout, align, layouts
from ffdebug.compare.inputs_gate import check_trainer_inputs
from ffdebug.compare.metrics import compare_tensors, logits_metrics
from ffdebug.compare.pairing import Filters, StageUnit, check_input_ids, group_calls, pair_calls, pair_stages
from ffdebug.compare.shards import best_fold
from ffdebug.coverage import CoverageInput, assess, filter_sentences
from ffdebug.errors import FFDebugError
from ffdebug.io.ranks import fold
from ffdebug.io.record import Record
from ffdebug.io.side import SideStore
from ffdebug.results import CallRef, CompareResult, StageResult, TensorMeta, worst_of
from ffdebug.store.reader import open_side
from ffdebug.verdict import Severity, Threshold

READ_AHEAD_BYTES = 256 << 20  # payload bytes read ahead and in use at once (peak RSS: README "Benchmarks")


def _as_store(x) -> SideStore:
    return x if isinstance(x, SideStore) else open_side(x)


def _stats_compare(r: Record, t: Record, e: StageResult) -> None:
    """Compare two stats-only records: relative error of l2, mean and std (no cos available)."""
    rs, ts = r.stats or {}, t.stats or {}
    e.stats_only = True
    if not rs or not ts:
        e.notes.append("no statistics to compare")
        e.severity = V.stats_only(None)
        return
    l2r, l2t = rs.get("l2") or 0.0, ts.get("l2") or 0.0
    scale = max(l2r / math.sqrt(max(rs.get("numel") or 1, 1)), 1e-30)
    rel_l2 = abs(l2t - l2r) / l2r if l2r else (0.0 if l2t == 0 else None)
    rel_mean = abs((ts.get("mean") or 0) - (rs.get("mean") or 0)) / scale
    rel_std = abs((ts.get("std") or 0) - (rs.get("std") or 0)) / scale
    e.rel = None if rel_l2 is None else max(rel_l2, rel_mean, rel_std)
    e.norm_ratio = (l2t / l2r) if l2r else None
    e.notes.append("compared on statistics only (l2, mean, std): a rotation or permutation is invisible")
    e.severity = V.stats_only(e.rel)


def _sketch_of(rec: Record) -> dict | None:
    info = (rec.extra or {}).get("sketch")
    return info if isinstance(info, dict) and rec.has_payload else None


def _sketch_compare(r: Record, t: Record, e: StageResult, thresholds=(), exact: bool = False) -> None:
    """Compare two sketch-mode records: rel and cos estimated from their sketches and exact norms
    (`compare/sketch.py`). Sketches of different seeds or sizes cannot meet: a bug, said why."""
    from ffdebug.compare.sketch import estimate

    rs, ts = _sketch_of(r), _sketch_of(t)
    if rs != ts:
        e.notes.append(f"sketches differ in seed or size (ref {rs}, target {ts}): dump both with one seed")
        e.severity = V.stats_only(None)
        return
    l2r, l2t = (r.stats or {}).get("l2"), (t.stats or {}).get("l2")
    if l2r is None or l2t is None:
        e.notes.append("sketch without the tensor's norm: nothing to compare")
        e.severity = V.stats_only(None)
        return
    est = estimate(r.load(), t.load(), float(l2r), float(l2t))
    e.cos, e.rel = est.cos, est.rel
    e.norm_ratio = (l2t / l2r) if l2r else None
    e.notes.append(f"rel and cos estimated from a {rs.get('buckets')}-bucket sketch")
    severity = V.classify(est.cos, est.rel, e.key, thresholds)
    severity = V.zero_side(severity, float(l2r), float(l2t), int((r.stats or {}).get("numel") or 0))
    if exact:  # a sketch cannot show bit equality: at --exact it never passes as identical
        severity, e.invariance = V.exact(severity, 0.0)
        e.notes.append("a sketch cannot show bit equality (--exact): dump full tensors")
    e.severity = severity


def _meta(rec: Record) -> TensorMeta:
    shape = rec.shape
    return TensorMeta(dtype=rec.dtype, shape=list(shape) if shape is not None else None)


def stage_result(key: str, r: Record, t: Record) -> StageResult:
    """A StageResult for one record pair, before any metric."""
    in_layer = r.layer is not None and "." in key
    return StageResult(
        key=key,
        layer=r.layer,
        layer_class=r.layer_class or t.layer_class,
        stage=key.split(".", 1)[1] if in_layer else key,
        io=r.io,
        call=r.call,
        invocation=r.invocation or 0,
        rank=t.rank or 0,
        step=dict(r.step or {}),
        phase=r.phase,
        ref=_meta(r),
        target=_meta(t),
    )


RISE_HEADS = 10.0  # heads within this factor of the worst head are named as the wrong ones


def compare_records(
    r: Record,
    t: Record,
    thresholds: tuple[Threshold, ...] = (),
    exact: bool = False,
    masks: tuple[TokenLayout, TokenLayout] = (TokenLayout(), TokenLayout()),
    load=Record.load,
) -> StageResult:
    """Compare one pair of records into a StageResult, graded by the verdict rules. `masks` are the
    two sides' token layouts: a packed side meets a padded one through them (`align`). `load(record)`
    reads a tensor (the compare loop passes its read-ahead, `ffdebug.io.prefetch`)."""
    key = r.key
    e = stage_result(key, r, t)
    aligned = None
    if list(r.shape or []) != list(t.shape or []) and any(masks) and r.has_payload and t.has_payload:
        aligned = align(load(r), load(t), *masks)
    if list(r.shape or []) != list(t.shape or []) and aligned is None:
        if not V.singleton_unifiable(r.shape, t.shape):
            e.severity = V.shape_mismatch()
            e.finding = "shape_mismatch"
            e.notes.append(f"shape mismatch: ref {e.ref.shape} vs target {e.target.shape}")
            return e
        e.unified_shape = True
        e.notes.append(
            f"shapes differ by size-1 dims only (ref {e.ref.shape} vs target {e.target.shape}): "
            "compared on the reference's shape"
        )
    if _sketch_of(r) is not None or _sketch_of(t) is not None:
        if _sketch_of(r) is not None and _sketch_of(t) is not None:
            _sketch_compare(r, t, e, thresholds, exact)
        else:  # a sketch meets a full tensor or statistics: the statistics alone decide nothing more
            _stats_compare(r, t, e)
        return e
    if not (r.has_payload and t.has_payload):
        _stats_compare(r, t, e)
        return e
    rt, tt = (load(r), load(t)) if aligned is None else aligned[:2]
    if aligned is not None:
        e.notes.append(aligned[2])
    if e.unified_shape:
        tt = tt.reshape(rt.shape)
    m = compare_tensors(rt, tt)
    e.cos, e.rel, e.rel_diff, e.max_abs = m.cos, m.rel, m.rel_diff, m.max_abs
    e.max_abs_at, e.mean_abs, e.norm_ratio, e.bit_equal = m.max_abs_at, m.mean_abs, m.norm_ratio, m.bit_equal
    e.elem = m.elem
    e.notes.extend(m.notes)
    if m.nan_mismatch or m.inf_mismatch:
        e.nan_mismatch, e.inf_mismatch = m.nan_mismatch, m.inf_mismatch
    severity = V.classify(m.cos, m.rel, key, thresholds, m.elem, m.max_abs)
    severity = V.zero_side(severity, m.ref_norm, m.target_norm, m.numel)
    if not (m.nan_mismatch or m.inf_mismatch):
        severity = near_zero.grade(severity, r, t, m.max_abs, e.notes)  # declared `scale`: absolute atol
        e.near_zero = near_zero.within(r, t, m.max_abs)
    severity = V.nonfinite(severity, m.nan_mismatch, m.inf_mismatch)
    if exact:
        severity, e.invariance = V.exact(severity, m.bit_equal)
        if e.invariance:
            e.notes.append(f"not bit-equal (--exact): {e.invariance}")
    e.severity = severity
    if key.endswith("logits") and rt.is_floating_point() and rt.dim() >= 1:
        e.logits = logits_metrics(rt, tt)
    if (m.bit_equal or 0.0) < 1.0 and rt.is_floating_point():
        _locate(e, rt, tt)
    return e


def _locate(e: StageResult, rt, tt) -> None:
    """Where inside the tensor the error sits: per token / head, the named max-error coordinate."""
    from ffdebug.compare.where import breakdown, named

    w = breakdown(e.key, rt, tt)
    if w is None:
        return
    e.max_abs_where = named(w.axes, e.max_abs_at)
    e.per_token_rel, e.per_head_rel, e.rise_from = w.per_token_rel, w.per_head_rel, w.rise_from
    if w.rise_from is not None:
        e.notes.append(f"error rises from token {w.rise_from}")
    if w.per_head_rel:
        worst_rel = max((x for x in w.per_head_rel if x is not None), default=0.0)
        bad = [
            h
            for h, x in enumerate(w.per_head_rel)
            if x is None or (worst_rel > 0 and x >= worst_rel / RISE_HEADS)
        ]
        if worst_rel > 0 and len(bad) < len(w.per_head_rel):
            e.notes.append(f"error in head(s) {', '.join(map(str, bad))} (rel per head: see per_head_rel)")


def compare(
    ref,
    target,
    *,
    layers=None,
    stages: tuple[str, ...] | list[str] = (),
    step: dict | None = None,
    rank: int | None = None,
    thresholds: tuple[Threshold, ...] | list = (),
    noise=None,
    exact: bool = False,
    fail_on: Severity | str = Severity.DIVERGE,
    allow_partial: bool = False,
    maps=(),
    alias_file: str | None = None,
    workers: int | None = None,
    exclude: tuple[str, ...] | list[str] = (),
) -> CompareResult:
    """Compare two sides (paths or SideStores).

    Raises InputIdsMismatch (exit 3) when the sides were fed different input ids, FFDebugError
    (exit 2) on unreadable input. The result's coverage says what was left out (exit 4 unless
    `allow_partial`); `exclude` globs leave stages out, and the coverage lists them as selected out.
    `workers`: threads comparing whole tensors in parallel (None: one per free core,
    `ffdebug.compare.parallel`); the result is bit-identical at any count.
    """
    from ffdebug._env import parse_layers

    fail_on = V.parse_fail_on(fail_on)
    ref_store, tgt_store = _as_store(ref), _as_store(target)
    stage_map = StageMap.of(list(maps or ()), alias_file)
    ref_store, tgt_store = _renamed(ref_store, stage_map), _renamed(tgt_store, stage_map)
    if isinstance(layers, str):
        layers = parse_layers(layers)
    thresholds = tuple(t if isinstance(t, Threshold) else V.parse_threshold(t) for t in thresholds)
    exclude = tuple(exclude)
    filters = Filters(layers=layers, stages=tuple(stages), step=dict(step or {}), rank=rank, exclude=exclude)
    ref_filters = filters
    if rank is not None and {r.rank for r in ref_store.records} <= {0} and rank != 0:
        # --rank N against a single-rank reference: that rank against the reference's one
        ref_filters = dataclasses.replace(filters, rank=None)
    ref_groups = group_calls(ref_store, ref_filters)
    tgt_groups = group_calls(tgt_store, filters)
    if not ref_groups and not tgt_groups:
        raise FFDebugError(
            f"{ref_store.path} and {tgt_store.path}: no records left to compare; "
            "check --layers / --stages / --step / --rank, or that the dumps captured anything"
        )
    pairing = pair_calls(ref_groups, tgt_groups)
    generation = check_input_ids(pairing.pairs)
    check_trainer_inputs(pairing.pairs)  # trainer stores: same prompts / noise / order (inputs_gate)
    if generation is not None:  # compare the calls before the one where the generation diverged
        pairing.pairs = [p for p in pairing.pairs if not generation.covers(p[0])]

    noise_index = _noise_index(noise, ref_groups, ref_filters, stage_map) if noise is not None else None
    stage_pairings = [pair_stages(rg, tg) for rg, tg in pairing.pairs]
    units = [u for sp in stage_pairings for u in sp.units]
    stages_out: list[StageResult] = []
    pairs_out: list[tuple] = []
    readings: list[dict] = []
    masks = {id(rg): layouts(rg, tg) for rg, tg in pairing.pairs}
    for unit, (results, records, reading) in zip(units, _map_units(units, thresholds, exact, workers, masks)):
        for e in results:
            if noise_index is not None:
                _apply_noise(e, noise_index.get((unit.group.tags, unit.group.call, unit.sk)))
        stages_out.extend(results)
        pairs_out.extend(records)
        if reading is not None:
            readings.append(reading)
    if noise_index is not None:
        _exact_prefix_with_noise(stages_out)
    if not any(e.key != "embed.input_ids" for e in stages_out):
        raise FFDebugError(_nothing_paired(ref_store, tgt_store, pairing, filters))
    if layers is not None and not any(e.layer is not None for e in stages_out):
        _no_layer_selected(layers, ref_store)
    notes: list[str] = []
    if pairing.warmup_skipped:
        notes.append(f"{len(pairing.warmup_skipped)} warm-up call(s) on the target side were set aside")
    if pairing.warmup_skipped_ref:
        notes.append(
            f"{len(pairing.warmup_skipped_ref)} warm-up call(s) on the reference side were set aside"
        )
    if any(e.stats_only for e in stages_out):
        notes.append("some stages were dumped as statistics only and compared on their stats")
    if any(r["matches"] and not r["declared"] for r in readings):
        notes.append(
            "some target stages are per-rank pieces of the reference's tensor (see shards); tag them "
            "with reduction='partial' or shard={dim,index,count} so they are folded automatically"
        )
    notes.extend(_budget_notes(pairs_out))
    notes.extend(f"stage map rule {spec!r} renamed nothing on either side" for spec in stage_map.unused())
    if generation is not None:
        notes.append(f"{generation.sentence()}; calls from {generation.call} on were not compared")
    only_ref = [r for sp in stage_pairings for r in sp.only_ref]
    only_target = [r for sp in stage_pairings for r in sp.only_target]
    coverage = assess(
        ref_store,
        tgt_store,
        CoverageInput(
            pairs=pairing.pairs,
            results=stages_out,
            only_ref=only_ref,
            only_target=only_target,
            unpaired_ref=pairing.unpaired_ref,
            unpaired_target=pairing.unpaired_target,
            compared_ranks={r for u in units for r in u.target_ranks},
            filters=filter_sentences(layers, stages, step, rank) + excluded_sentences(exclude),
            stage_filter=bool(stages or exclude),
            rank_filter=rank,
        ),
    )
    return CompareResult(
        verdict=worst_of(stages_out),
        stages=stages_out,
        ref_path=ref_store.path,
        target_path=tgt_store.path,
        fail_on=fail_on,
        only_ref=sorted({r.key for r in only_ref}),
        only_target=sorted({r.key for r in only_target}),
        warmup_skipped=len(pairing.warmup_skipped),
        unpaired_ref=[CallRef(g.call, dict(g.tags)) for g in pairing.unpaired_ref],
        unpaired_target=[CallRef(g.call, dict(g.tags)) for g in pairing.unpaired_target],
        notes=notes,
        stats_only=any(e.stats_only for e in stages_out)
        and all(e.stats_only for e in stages_out if e.key != "embed.input_ids"),
        records=pairs_out,
        shards=readings,
        coverage=coverage,
        allow_partial=allow_partial,
        generation=generation,
    )


def _compare_unit(
    unit: StageUnit, thresholds, exact: bool, load=Record.load, masks=(TokenLayout(), TokenLayout())
) -> tuple[list[StageResult], list[tuple], dict | None]:
    """The stage results of one unit, their record pairs, and the shard reading (multi-rank)."""
    r = unit.ref
    if not unit.replicas:
        e = compare_records(r, unit.target, thresholds, exact, masks=masks, load=load)
        e.unsharded_ref, e.unsharded_target = _unsharded(r), _unsharded(unit.target)
        reading = None
        if e.unsharded_target is not None and e.unsharded_target["how"] != "replicated":
            how = e.unsharded_target["how"]
            reading = {"key": e.key, "ranks": e.unsharded_target["ranks"], "declared": how, "reading": how}
            reading.update(matches=e.ok, cos=e.cos, rel=e.rel)
        return [e], [(r, unit.target)], reading
    per_rank = []
    for part in unit.replicas:
        e = compare_records(r, part, thresholds, exact, masks=masks, load=load)
        e.rank, e.per_rank = part.rank, True
        per_rank.append(e)
    if all(e.ok for e in per_rank) or not (r.has_payload and all(p.has_payload for p in unit.replicas)):
        return per_rank, [(r, p) for p in unit.replicas], None
    best, rows = best_fold(load(r), [load(p) for p in unit.replicas])
    reading = {
        "key": r.key,
        "ranks": len(unit.replicas),
        "declared": None,
        "readings": [x.to_json() for x in rows],
    }
    reading["matches"] = best is not None
    if best is None:
        return per_rank, [(r, p) for p in unit.replicas], reading
    folded = fold(unit.replicas, best.plan)
    e = compare_records(r, folded, thresholds, exact, masks=masks)
    e.finding = "shard_reading"
    e.unsharded_target = {"how": best.how, "ranks": len(unit.replicas), "inferred": True}
    e.notes.append(f"target ranks match as the {best.reading}; declare it in the dump")
    reading.update(reading=best.how, cos=e.cos, rel=e.rel, explained_by=best.reading)
    return [e], [(r, folded)], reading


def excluded_sentences(exclude: tuple[str, ...]) -> list[str]:
    """`--exclude` as a selection sentence of the coverage (selected out, never silent)."""
    return [f"--exclude {' '.join(exclude)}"] if exclude else []


def _renamed(store: SideStore, stage_map: StageMap) -> SideStore:
    """`store` with its stage keys renamed by the stage map (`--map`, `--alias-file`)."""
    if not stage_map.rules:
        return store
    records = []
    for rec in store.records:
        key = stage_map.apply(rec.key)
        records.append(rec if key == rec.key else dataclasses.replace(rec, key=key))
    return dataclasses.replace(store, records=records)


def _unsharded(rec: Record) -> dict | None:
    """`{"how", "ranks"}` when ffdebug folded this record from per-rank pieces."""
    return {"how": rec.fold.describe(), "ranks": len(rec.parts)} if rec.fold is not None else None


def _nothing_paired(ref: SideStore, tgt: SideStore, pairing, filters: Filters) -> str:
    """The one-line error when no stage (besides input ids) is on both sides."""
    if filters.stages or filters.layers is not None:
        why = "no stage matches --stages / --layers on both sides"
    elif pairing.unpaired_ref or pairing.unpaired_target:
        tags = sorted({str(dict(g.tags)) for g in pairing.unpaired_ref})[:3]
        other = sorted({str(dict(g.tags)) for g in pairing.unpaired_target})[:3]
        why = f"the calls do not pair: reference step tags {', '.join(tags) or '-'} vs target {', '.join(other) or '-'}"
    else:
        why = "the two sides share no stage key"
    return (
        f"{ref.path} and {tgt.path}: nothing to compare ({why}); dump both sides with the same stages and "
        "ffdebug.step(...) tags, or loosen --stages / --layers / --step"
    )


def _no_layer_selected(layers, store: SideStore) -> None:
    """`--layers` that names none of the dumped layers is a usage error, not a pass."""
    dumped = sorted({r.layer for r in store.records if r.layer is not None})
    if dumped:
        raise FFDebugError(
            f"--layers {layers.spec!r} selects none of the dumped layers ({dumped[0]}-{dumped[-1]} in "
            f"{store.path}); pick layers in that range"
        )


def _budget_notes(pairs: list[tuple[Record, Record]]) -> list[str]:
    """Say which side's FFDEBUG_FWD_DUMP_MAX_BYTES budget turned stages into statistics-only ones."""
    notes = []
    for i, side in enumerate(("reference", "target")):
        n = sum(1 for pair in pairs if pair[i].over_budget)
        if n:
            notes.append(
                f"{n} stage(s) were over the {side}'s byte budget (FFDEBUG_FWD_DUMP_MAX_BYTES): "
                "only their statistics were written and compared"
            )
    return notes


def _map_units(
    units: list[StageUnit], thresholds, exact: bool, workers: int | None, masks: dict | None = None
) -> list[tuple]:
    """`_compare_unit` over every unit, results in unit order.

    Payloads are read ahead on one thread (`ffdebug.io.prefetch`, at most `READ_AHEAD_BYTES` held)
    while units are compared; with `workers` > 1, whole units go to worker threads (the chunk
    loop releases the GIL inside each kernel). One tensor's reduction never leaves its worker and
    runs on one intra-op thread, so every value is bit-identical at any worker count."""
    from ffdebug._chunks import single_thread
    from ffdebug.io.prefetch import ReadAhead

    jobs = [_payload_records(u) for u in units]
    n = workers if workers is not None else parallel.auto_workers(jobs, READ_AHEAD_BYTES)
    with ReadAhead(jobs, READ_AHEAD_BYTES) as ahead:

        def one(i: int) -> tuple:
            try:  # single_thread is per Python thread: each worker sets its own
                with single_thread():
                    mask = (masks or {}).get(id(units[i].group), (TokenLayout(), TokenLayout()))
                    return _compare_unit(units[i], thresholds, exact, ahead.take(i), mask)
            finally:
                ahead.release(i)

        return parallel.map_ordered(one, len(units), n)


def _payload_records(unit: StageUnit) -> list[Record]:
    """The records whose tensors comparing `unit` reads (none for a stats-only or shape-mismatched pair)."""
    r = unit.ref
    out = [r]
    for t in unit.replicas or (unit.target,):
        if list(r.shape or []) == list(t.shape or []) and r.has_payload and t.has_payload:
            out.append(t)
    return out if len(out) > 1 else []


def _noise_index(noise, ref_groups, filters, stage_map: StageMap) -> dict:
    """(tags, call, stage) -> the noise run's rel against the reference for that stage (the noise
    run's stages renamed by the same `--map` / `--alias-file` as the target's)."""
    noise_store = _renamed(_as_store(noise), stage_map)
    pairing = pair_calls(ref_groups, group_calls(noise_store, filters))
    index = {}
    for rg, ng in pairing.pairs:
        for sk in rg.order:
            n = ng.records.get(sk)
            if n is None:
                continue
            m = (
                compare_tensors(rg.records[sk].load(), n.load())
                if rg.records[sk].has_payload and n.has_payload
                else None
            )
            index[(rg.tags, rg.call, sk)] = (m.rel if m else None, n.dtype)
    return index


def _apply_noise(e: StageResult, noise: tuple | None) -> None:
    """Record the noise run's error at this stage and apply the verdict's noise rules: within
    noise back to ok, beyond noise at least diverge."""
    e.noise_given = True
    if noise is None:
        return
    noise_rel, noise_dtype = noise
    e.noise_rel = noise_rel
    if noise_rel is None or e.rel is None or e.near_zero:  # near zero: judged by its atol alone
        return
    k = V.noise_factor(e.dtype_ref, e.dtype_target or noise_dtype, noise_dtype)
    if V.beyond_noise(e.rel, noise_rel, k):
        e.beyond_noise, e.within_noise = True, False
        e.severity = V.noise_sensitive(e.severity, e.rel, noise_rel, k)
        e.notes.append(
            f"beyond noise: rel {e.rel:.3g} is {e.rel / noise_rel:.3g} x the noise run's {noise_rel:.3g}"
        )
        return
    if e.ok:
        return
    graded = V.noise(e.severity, e.rel, noise_rel, k)
    e.within_noise = graded is not e.severity
    if e.within_noise:
        e.notes.append(f"within noise: rel {e.rel:.3g} <= {k:g} x noise rel {noise_rel:.3g}")
        e.severity = graded


EXACT_NOISE_NOTE = (
    "the noise run equals the reference bit for bit up to here, so the exact-prefix rule applies: the "
    "first stage that is not bit-equal after exactly equal stages differs by its own computation"
)


def _exact_prefix_with_noise(stages: list[StageResult]) -> None:
    """Per call and rank, in execution order: where the noise run is bit-identical to the
    reference (noise rel 0) the noise rule has no scale, so the exact-prefix rule decides: the
    first stage that is not bit-equal after bit-equal stages of the same dtype is raised."""
    seen: set[tuple] = set()
    for e in stages:
        call = (tuple(sorted((str(k), str(v)) for k, v in e.step.items())), e.call, e.rank)
        if call in seen or e.key == "embed.input_ids":
            continue
        if e.exact:
            continue
        seen.add(call)
        if (
            e.noise_rel == 0.0
            and not e.near_zero
            and e.same_dtype
            and e.rel is not None
            and e.rel > 0.0
            and not e.folded
        ):
            e.beyond_noise = True
            e.severity = V.exact_prefix_break(e.severity)
            e.notes.append(EXACT_NOISE_NOTE)
