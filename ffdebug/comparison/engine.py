"""`compare(ref, target)`: pair two sides, gate on input ids, compute metrics, grade severities."""

from __future__ import annotations

import dataclasses

from ffdebug import verdict as V
from ffdebug.across.run import Across
from ffdebug.arrays import is_complex, is_floating
from ffdebug.capture.stage_map import StageMap
from ffdebug.comparison import contained, grading, logits, parallel, routing, underflow
from ffdebug.comparison.align import ROUTED_KEY, TokenLayout, align, layouts, routed_rows
from ffdebug.comparison.estimates import sketch_compare, sketch_of, stats_compare
from ffdebug.comparison.forked import ForkPool, fork_usable, record_refs, resolve_refs
from ffdebug.comparison.inputs_gate import check_trainer_inputs
from ffdebug.comparison.metrics import compare_tensors
from ffdebug.comparison.noise import apply_noise, exact_prefix_with_noise, noise_index
from ffdebug.comparison.notes import (
    UnitsRun,
    check_layer_selected,
    excluded_sentences,
    nothing_paired,
    result_notes,
)
from ffdebug.comparison.pairing import (
    Filters,
    StageUnit,
    check_input_ids,
    group_calls,
    pair_calls,
    pair_stages,
)
from ffdebug.comparison.shards import best_fold
from ffdebug.coverage import CoverageInput, assess, filter_sentences
from ffdebug.errors import FFDebugError
from ffdebug.io.ranks import fold
from ffdebug.io.record import Record
from ffdebug.io.side import SideStore
from ffdebug.logs import get_logger
from ffdebug.progress_hook import ProgressHook
from ffdebug.results import CallRef, CompareResult, StageResult, TensorMeta, worst_of
from ffdebug.store.reader import open_side
from ffdebug.verdict import Severity, Threshold

_log = get_logger("comparison")  # -v: what was paired (docs/cli.md "CLI conventions")

READ_AHEAD_BYTES = 256 << 20  # payload bytes read ahead and in use at once (peak RSS: bench/README.md)


def _as_store(x) -> SideStore:
    return x if isinstance(x, SideStore) else open_side(x)


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
        seq=r.seq,
    )


def compare_records(
    r: Record,
    t: Record,
    thresholds: tuple[Threshold, ...] = (),
    exact: bool = False,
    masks: tuple[TokenLayout, TokenLayout] = (TokenLayout(), TokenLayout()),
    load=Record.load,
    depth: int | None = None,
    call_dtypes: tuple | None = None,
) -> StageResult:
    """Compare one pair of records into a StageResult, graded by the verdict rules. `masks` are the
    two sides' token layouts: a packed side meets a padded one through them (`align`). `load(record)`
    reads a tensor (the compare loop passes its read-ahead, `ffdebug.io.prefetch`). `depth`: blocks
    at and before the stage (`CallGroup.depths`), for the element-wise rule of a low-precision side;
    `call_dtypes`: the call's (`verdict.call_dtypes`), which the precision rules judge a stage by
    when its own two sides share a dtype (`StageResult.judged_dtypes`)."""
    key = r.key
    e = stage_result(key, r, t)
    e.call_dtypes = call_dtypes
    aligned = None
    routed = (r.extra or {}).get(ROUTED_KEY), (t.extra or {}).get(ROUTED_KEY)
    if all(isinstance(x, list) for x in routed) and r.has_payload and t.has_payload:
        aligned = routed_rows(load(r), load(t), routed, masks)
    if aligned is None and list(r.shape or []) != list(t.shape or []) and any(masks):
        if r.has_payload and t.has_payload:
            aligned = align(load(r), load(t), *masks)
    if list(r.shape or []) != list(t.shape or []) and aligned is None:
        size_one = V.singleton_unifiable(r.shape, t.shape)
        regrouped = not size_one and V.features_regrouped(r.shape, t.shape)
        if not (size_one or regrouped):
            e.severity = V.shape_mismatch()
            e.finding = "shape_mismatch"
            e.notes.append(f"shape mismatch: ref {e.ref.shape} vs target {e.target.shape}")
            return e
        e.unified_shape = True
        how = "group each token's features otherwise" if regrouped else "differ by size-1 dims only"
        e.notes.append(
            f"shapes {how} (ref {e.ref.shape} vs target {e.target.shape}): compared on the reference's shape"
        )
    if sketch_of(r) is not None or sketch_of(t) is not None:
        if sketch_of(r) is not None and sketch_of(t) is not None:
            sketch_compare(r, t, e, thresholds, exact)
        else:  # a sketch meets a full tensor or statistics: the statistics alone decide nothing more
            stats_compare(r, t, e)
        return e
    if not (r.has_payload and t.has_payload):
        stats_compare(r, t, e)
        return e
    rt, tt = (load(r), load(t)) if aligned is None else aligned[:2]
    if aligned is not None:
        e.notes.append(aligned[2])
    if is_complex(rt.dtype) != is_complex(
        tt.dtype
    ):  # no elementwise pairing of a complex value with a real one
        e.severity, e.finding = V.dtype_kind_mismatch(), "dtype_kind"
        e.notes.append(f"dtype kinds differ: ref {e.ref.dtype} vs target {e.target.dtype} (complex vs real)")
        return e
    if e.unified_shape:
        tt = tt.reshape(rt.shape)
    m = compare_tensors(rt, tt)
    e.cos, e.rel, e.rel_diff, e.max_abs = m.cos, m.rel, m.rel_diff, m.max_abs
    e.max_abs_at, e.mean_abs, e.norm_ratio, e.bit_equal = m.max_abs_at, m.mean_abs, m.norm_ratio, m.bit_equal
    e.elem = m.elem
    e.notes.extend(m.notes)
    if m.nan_mismatch or m.inf_mismatch:
        e.nan_mismatch, e.inf_mismatch = m.nan_mismatch, m.inf_mismatch
    integer = not (is_floating(rt.dtype) or is_complex(rt.dtype))
    e.severity = grading.grade(e, m, r, t, thresholds, exact, depth, integer)
    if key.endswith("logits") and is_floating(rt.dtype) and rt.ndim >= 1:
        e.logits = logits.logits_metrics(rt, tt)
    if (m.bit_equal or 0.0) < 1.0 and is_floating(rt.dtype):
        coords = aligned[3] if aligned is not None and len(aligned) > 3 else None
        from ffdebug.comparison.where import locate

        locate(e, rt, tt, coords)
    return e


def _aliases(units) -> dict:
    """(target key, invocation) -> the reference keys it paired as, for pairs not made by key; a
    fused record's columns (`leftovers._fused_parts`) count under their whole record's key."""
    from ffdebug.comparison.leftovers import whole_of

    out: dict = {}
    for u in units:
        if u.note:
            whole = whole_of(u.target)
            out.setdefault((whole.key, whole.invocation), []).append(u.ref.key)
    return out


def _log_pairing(ref_store, tgt_store, pairing, units, noise_store) -> None:
    """-v: the two stores, their record counts and what was paired."""
    _log.debug(
        "compare: %s (%d records) against %s (%d records): %d calls paired, %d warm-ups set aside, "
        "%d stage units%s",
        ref_store.path,
        len(ref_store.records),
        tgt_store.path,
        len(tgt_store.records),
        len(pairing.pairs),
        len(pairing.warmup_skipped),
        len(units),
        f", noise run {noise_store.path}" if noise_store is not None else "",
    )


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
    progress: ProgressHook | None = None,
    group=None,
) -> CompareResult:
    """Compare two sides (paths or SideStores).

    Raises InputIdsMismatch (exit 3) when the sides were fed different input ids, FFDebugError
    (exit 2) on unreadable input. The result's coverage says what was left out (exit 4 unless
    `allow_partial`); `exclude` globs leave stages out, and the coverage lists them as selected out.
    `workers`: threads comparing whole tensors in parallel (None: one per free core,
    `ffdebug.comparison.parallel`); bit-identical at any count. `progress` hears each stage unit.
    `group`: the process group of a compare across nodes (`ffdebug.across`): one result everywhere.
    """
    from ffdebug._env import parse_layers

    fail_on = V.parse_fail_on(fail_on)
    stage_map = StageMap.of(list(maps or ()), alias_file)
    ref, target, across = Across.wrap(group, ref, target, noise)  # None without a group
    ref_store, tgt_store = _renamed(_as_store(ref), stage_map), _renamed(_as_store(target), stage_map)
    if isinstance(layers, str):
        layers = parse_layers(layers)
    thresholds = tuple(t if isinstance(t, Threshold) else V.parse_threshold(t) for t in thresholds)
    exclude = tuple(exclude)
    filters = Filters(layers=layers, stages=tuple(stages), step=dict(step or {}), rank=rank, exclude=exclude)
    ref_filters = _ref_filters(filters, ref_store)
    ref_groups, pairing, generation = _pair_calls(ref_store, tgt_store, filters, ref_filters)
    noise_store = _renamed(_as_store(noise), stage_map) if noise is not None else None
    noise_idx = noise_index(noise_store, ref_groups, ref_filters) if noise_store is not None else None
    stage_pairings = [pair_stages(rg, tg) for rg, tg in pairing.pairs]
    units = [u for sp in stage_pairings for u in sp.units]
    _log_pairing(ref_store, tgt_store, pairing, units, noise_store)
    run = _run_units(units, pairing, thresholds, exact, workers, noise_idx, progress, across)
    if not any(e.key != "embed.input_ids" for e in run.stages):
        raise FFDebugError(nothing_paired(ref_store, tgt_store, pairing, filters))
    if layers is not None and not any(e.layer is not None for e in run.stages):
        check_layer_selected(layers, ref_store)
    only_ref = [r for sp in stage_pairings for r in sp.only_ref]
    only_target = [r for sp in stage_pairings for r in sp.only_target]
    selection = filter_sentences(layers, stages, step, rank) + excluded_sentences(exclude)
    coverage = _coverage(
        ref_store, tgt_store, pairing, run, (only_ref, only_target), units, selection, filters
    )
    stages_out = run.stages
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
        notes=result_notes(pairing, run, stage_map, generation),
        stats_only=any(e.stats_only for e in stages_out)
        and all(e.stats_only for e in stages_out if e.key != "embed.input_ids"),
        records=run.records,
        shards=run.readings,
        coverage=coverage,
        allow_partial=allow_partial,
        generation=generation,
    )


def _ref_filters(filters: Filters, ref_store: SideStore) -> Filters:
    """The reference's filters: `--rank N` against a single-rank reference compares that rank with
    the reference's one."""
    if filters.rank not in (None, 0) and {r.rank for r in ref_store.records} <= {0}:
        return dataclasses.replace(filters, rank=None)
    return filters


def _coverage(ref_store, tgt_store, pairing, run: UnitsRun, only: tuple, units, selection, filters: Filters):
    """What was and was not compared (`ffdebug.coverage`): `only` = the records of one side alone,
    `selection` = the sentences of the filters that left stages out on purpose."""
    return assess(
        ref_store,
        tgt_store,
        CoverageInput(
            pairs=pairing.pairs,
            results=run.stages,
            only_ref=only[0],
            only_target=only[1],
            unpaired_ref=pairing.unpaired_ref,
            unpaired_target=pairing.unpaired_target,
            compared_ranks={r for u in units for r in u.target_ranks},
            filters=selection,
            stage_filter=bool(filters.stages or filters.exclude),
            rank_filter=filters.rank,
            aliases=_aliases(units),
        ),
    )


def _pair_calls(ref_store: SideStore, tgt_store: SideStore, filters: Filters, ref_filters: Filters):
    """The reference's call groups, the call pairing, and the generation divergence (if any): the
    input-id gates run here, and the calls from a diverged generation on are left unpaired."""
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
    return ref_groups, pairing, generation


def _run_units(
    units: list[StageUnit], pairing, thresholds, exact: bool, workers, noise_idx, progress=None, across=None
) -> UnitsRun:
    """Every unit compared (in unit order), graded against the noise run when there is one;
    `across`: a compare across nodes (`ffdebug.across.run.Across`)."""
    run = UnitsRun()
    masks = {id(rg): layouts(rg, tg) for rg, tg in pairing.pairs}
    pairs: dict[int, list] = {}
    for u in units:
        pairs.setdefault(id(u.group), []).append((u.ref.dtype, u.target.dtype))
    precision = {g: V.call_dtypes(p) for g, p in pairs.items()}
    if across is None:
        done = _map_units(units, thresholds, exact, workers, masks, progress, precision)
    else:  # this process's units, routing explained over them; every unit's results come back
        done = across.map(
            units,
            lambda own: _map_units(
                [units[i] for i in own], thresholds, exact, workers, masks, progress, precision
            ),
            lambda stages, records: routing.explain(stages, records, thresholds, Record.load),
        )
    for unit, (results, records, reading) in zip(units, done):
        for e in results:
            if noise_idx is not None:
                apply_noise(e, noise_idx.get((unit.group.tags, unit.group.call, unit.sk)))
        run.stages.extend(results)
        run.records.extend(records)
        if reading is not None:
            run.readings.append(reading)
    if across is None:  # across nodes: explained by each process over its own units (map_units)
        routing.explain(run.stages, run.records, thresholds, Record.load)
    underflow.explain(run.stages)
    contained.explain(run.stages)
    if noise_idx is not None:
        exact_prefix_with_noise(run.stages)
    return run


def _compare_unit(
    unit: StageUnit,
    thresholds,
    exact: bool,
    load=Record.load,
    masks=(TokenLayout(), TokenLayout()),
    call_dtypes: tuple | None = None,
) -> tuple[list[StageResult], list[tuple], dict | None]:
    """The stage results of one unit, their record pairs, and the shard reading (multi-rank)."""
    r = unit.ref
    depth = unit.group.depths.get(unit.sk)
    if not unit.replicas:
        e = compare_records(
            r, unit.target, thresholds, exact, masks=masks, load=load, depth=depth, call_dtypes=call_dtypes
        )
        if unit.note:
            e.notes.append(unit.note)
        e.unsharded_ref, e.unsharded_target = _unsharded(r), _unsharded(unit.target)
        reading = None
        if e.unsharded_target is not None and e.unsharded_target["how"] != "replicated":
            how = e.unsharded_target["how"]
            reading = {"key": e.key, "ranks": e.unsharded_target["ranks"], "declared": how, "reading": how}
            reading.update(matches=e.ok, cos=e.cos, rel=e.rel)
        return [e], [(r, unit.target)], reading
    per_rank = []
    for part in unit.replicas:
        e = compare_records(
            r, part, thresholds, exact, masks=masks, load=load, depth=depth, call_dtypes=call_dtypes
        )
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
    e = compare_records(r, folded, thresholds, exact, masks=masks, depth=depth, call_dtypes=call_dtypes)
    e.finding = "shard_reading"
    e.unsharded_target = {"how": best.how, "ranks": len(unit.replicas), "inferred": True}
    e.notes.append(f"target ranks match as the {best.reading}; declare it in the dump")
    reading.update(reading=best.how, cos=e.cos, rel=e.rel, explained_by=best.reading)
    return [e], [(r, folded)], reading


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


def _map_units(*args, **kwargs) -> list[tuple]:
    """`_map_units_on` with BLAS held at one thread (`ffdebug._chunks.one_blas_thread`): each
    unit's sums run on their worker alone; forked workers inherit the setting."""
    from ffdebug._chunks import one_blas_thread

    with one_blas_thread():
        return _map_units_on(*args, **kwargs)


def _map_units_on(
    units: list[StageUnit],
    thresholds,
    exact: bool,
    workers: int | None,
    masks: dict | None = None,
    progress: ProgressHook | None = None,
    precision: dict | None = None,
) -> list[tuple]:
    """`_compare_unit` over every unit, results in unit order.

    Payloads are read ahead on one thread (`ffdebug.io.prefetch`, at most `READ_AHEAD_BYTES` held)
    while units are compared; with `workers` > 1, whole units go to worker threads (the chunk
    loop releases the GIL inside each kernel). One tensor's reduction never leaves its worker and
    runs on one BLAS thread, so every value is bit-identical at any worker count."""
    from ffdebug.io.prefetch import ReadAhead, record_bytes

    jobs = [u.payload_records() for u in units]
    sizes = [sum(record_bytes(r) for r in job) for job in jobs]
    n = workers if workers is not None else parallel.worker_count(sizes, READ_AHEAD_BYTES)

    def unit_mask(i: int) -> tuple[TokenLayout, TokenLayout]:
        return (masks or {}).get(id(units[i].group), (TokenLayout(), TokenLayout()))

    def unit_dtypes(i: int) -> tuple | None:
        return (precision or {}).get(id(units[i].group))

    if n > 1 and len(units) > 1 and fork_usable():  # before progress starts its thread
        return _map_units_forked(
            units, thresholds, exact, (unit_mask, unit_dtypes), min(n, len(units)), sizes, progress
        )
    if progress is not None:
        progress.begin(len(units), sum(sizes))
    with ReadAhead(jobs, READ_AHEAD_BYTES) as ahead:

        def one(i: int) -> tuple:
            try:
                return _compare_unit(units[i], thresholds, exact, ahead.take(i), unit_mask(i), unit_dtypes(i))
            finally:
                ahead.release(i)
                if progress is not None:
                    progress.advance(sizes[i])

        return parallel.map_ordered(one, len(units), n)


def _map_units_forked(units, thresholds, exact, per_unit, n: int, sizes, progress) -> list[tuple]:
    """`_map_units` on `n` forked worker processes (`ffdebug.comparison.forked`): each child reads
    its units' payloads itself and sends back their results; the record pairs come back as
    references to the unit's own records (only a record folded from ranks travels whole)."""
    unit_mask, unit_dtypes = per_unit

    def one(i: int) -> tuple:
        results, records, reading = _compare_unit(
            units[i], thresholds, exact, Record.load, unit_mask(i), unit_dtypes(i)
        )
        return results, record_refs(units[i].own_records(), records), reading

    def what(i: int) -> str:
        return f"stage {units[i].ref.key!r} (rank {units[i].ref.rank or 0})"

    with ForkPool(one, n, what) as pool:
        if progress is not None:
            progress.begin(len(units), sum(sizes))
        done = pool.map(
            len(units), (lambda i: progress.advance(sizes[i])) if progress is not None else (lambda i: None)
        )
    return [
        (results, resolve_refs(u.own_records(), refs), reading)
        for u, (results, refs, reading) in zip(units, done)
    ]
