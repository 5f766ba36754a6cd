"""`compare(ref, target)`: pair two sides, gate on input ids, compute metrics, grade severities."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ffdebug.compare.metrics import compare_tensors, logits_metrics
from ffdebug.compare.pairing import Filters, align_ranks, check_input_ids, group_calls, pair_calls
from ffdebug.compare.severity import (
    RANK,
    Threshold,
    at_least,
    check_fail_on,
    classify,
    noise_factor,
    parse_threshold,
    rel_band,
    worst,
)
from ffdebug.errors import FFDebugError
from ffdebug.io.record import Record
from ffdebug.io.side import SideStore
from ffdebug.store.reader import open_side


@dataclass
class CompareResult:
    """Per-stage comparison of two sides. Truthy when no stage is at or above `fail_on`."""

    verdict: str
    stages: list[dict]
    ref_path: str
    target_path: str
    fail_on: str = "diverge"
    only_ref: list[str] = field(default_factory=list)
    only_target: list[str] = field(default_factory=list)
    warmup_skipped: int = 0
    unpaired_calls: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    stats_only: bool = False
    records: list = field(default_factory=list, repr=False)  # (ref, target) Record per stage entry

    @property
    def first_divergence(self) -> dict | None:
        return next((s for s in self.stages if s["severity"] != "ok"), None)

    @property
    def first_non_invariant(self) -> dict | None:
        """With `exact`: the first stage that is not bit-identical and its class
        (`numerical` inside the ok band, `divergent` outside it)."""
        return next((s for s in self.stages if s.get("invariance")), None)

    def first_at_or_above(self, severity: str) -> dict | None:
        return next((s for s in self.stages if at_least(s["severity"], severity)), None)

    def failed(self, fail_on: str | None = None) -> bool:
        return self.first_at_or_above(fail_on or self.fail_on) is not None

    def __bool__(self) -> bool:
        return not self.failed()

    def to_json(self) -> dict:
        return {
            "verdict": self.verdict,
            "stages": self.stages,
            "first_divergence": self.first_divergence,
            "first_non_invariant": self.first_non_invariant,
            "ref": self.ref_path,
            "target": self.target_path,
            "only_ref": self.only_ref,
            "only_target": self.only_target,
            "warmup_skipped": self.warmup_skipped,
            "unpaired_calls": self.unpaired_calls,
            "notes": self.notes,
            "stats_only": self.stats_only,
            "fail_on": self.fail_on,
            "passed": not self.failed(),
        }


def _as_store(x) -> SideStore:
    return x if isinstance(x, SideStore) else open_side(x)


def _stats_compare(r: Record, t: Record) -> dict:
    """Compare two stats-only records: relative error of l2, mean and std (no cos available)."""
    rs, ts = r.stats or {}, t.stats or {}
    if not rs or not ts:
        return {"cos": None, "rel": None, "notes": ["no statistics to compare"]}
    l2r, l2t = rs.get("l2") or 0.0, ts.get("l2") or 0.0
    scale = max(l2r / math.sqrt(max(rs.get("numel") or 1, 1)), 1e-30)
    rel_l2 = abs(l2t - l2r) / l2r if l2r else (0.0 if l2t == 0 else None)
    rel_mean = abs((ts.get("mean") or 0) - (rs.get("mean") or 0)) / scale
    rel_std = abs((ts.get("std") or 0) - (rs.get("std") or 0)) / scale
    rel = None if rel_l2 is None else max(rel_l2, rel_mean, rel_std)
    return {
        "cos": None,
        "rel": rel,
        "norm_ratio": (l2t / l2r) if l2r else None,
        "notes": ["compared on statistics only (l2, mean, std): a rotation or permutation is invisible"],
    }


def _stage_entry(key: str, r: Record, t: Record) -> dict:
    return {
        "key": key,
        "layer": r.layer,
        "layer_class": r.layer_class or t.layer_class,
        "stage": key.split(".", 1)[1] if r.layer is not None and "." in key else key,
        "io": r.io,
        "call": r.call,
        "invocation": r.invocation,
        "rank": r.rank,
        "step": r.step,
        "phase": r.phase,
        "dtype_ref": r.dtype,
        "dtype_target": t.dtype,
        "shape_ref": list(r.shape),
        "shape_target": list(t.shape),
        "cos": None,
        "rel": None,
        "rel_diff": None,
        "max_abs": None,
        "max_abs_at": None,
        "mean_abs": None,
        "norm_ratio": None,
        "bit_equal": None,
        "severity": "ok",
        "notes": [],
    }


def compare_records(
    r: Record, t: Record, thresholds: tuple[Threshold, ...] = (), exact: bool = False
) -> dict:
    """Compare one pair of records into a stage entry (severity included)."""
    key = r.key
    e = _stage_entry(key, r, t)
    if r.shape != t.shape:
        e["severity"] = "bug"
        e["finding"] = "shape_mismatch"
        e["notes"].append(f"shape mismatch: ref {list(r.shape)} vs target {list(t.shape)}")
        return e
    if not (r.has_payload and t.has_payload):
        sc = _stats_compare(r, t)
        e.update({k: v for k, v in sc.items() if k != "notes"})
        e["notes"].extend(sc["notes"])
        e["stats_only"] = True
        e["severity"] = rel_band(e["rel"]) if e["rel"] is not None else "bug"
        return e
    rt, tt = r.load(), t.load()
    m = compare_tensors(rt, tt)
    for k in ("cos", "rel", "rel_diff", "max_abs", "max_abs_at", "mean_abs", "norm_ratio", "bit_equal"):
        e[k] = getattr(m, k)
    e["notes"].extend(m.notes)
    if m.nan_mismatch or m.inf_mismatch:
        e["nan_mismatch"] = m.nan_mismatch
        e["inf_mismatch"] = m.inf_mismatch
    severity = classify(m.cos, m.rel, key, thresholds)
    if (m.ref_norm == 0.0) != (m.target_norm == 0.0) and m.numel:
        # one side all zeros: no direction to compare (cos is set to 0), so not a "scramble" —
        # a computation that is missing (or spurious) on one side: a bug
        severity = "bug"
    if m.nan_mismatch or m.inf_mismatch:
        severity = worst(severity, "bug")
    if exact and (m.bit_equal or 0.0) < 1.0:
        # run-to-run invariance: inside the ok band the runs differ only numerically
        # (nondeterministic kernels, reduction order); outside it they compute different things
        e["invariance"] = "numerical" if severity == "ok" else "divergent"
        severity = worst(severity, "drift")
        e["notes"].append(f"not bit-equal (--exact): {e['invariance']}")
    e["severity"] = severity
    if key.endswith("logits") and rt.is_floating_point() and rt.dim() >= 1:
        e["logits"] = logits_metrics(rt, tt)
    return e


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
    fail_on: str = "diverge",
) -> CompareResult:
    """Compare two sides (paths or SideStores).

    Raises InputIdsMismatch (exit 3) when the sides were fed different input ids, FFDebugError
    (exit 2) on unreadable input.
    """
    from ffdebug._env import parse_layers

    check_fail_on(fail_on)
    ref_store, tgt_store = _as_store(ref), _as_store(target)
    if isinstance(layers, str):
        layers = parse_layers(layers)
    thresholds = tuple(t if isinstance(t, Threshold) else parse_threshold(t) for t in thresholds)
    filters = Filters(layers=layers, stages=tuple(stages), step=dict(step or {}), rank=rank)
    ref_groups = group_calls(ref_store, filters)
    tgt_groups = group_calls(tgt_store, filters)
    if not ref_groups and not tgt_groups:
        raise FFDebugError(
            f"{ref_store.path} and {tgt_store.path}: no records left to compare; "
            "check --layers / --stages / --step / --rank, or that the dumps captured anything"
        )
    pairing = pair_calls(ref_groups, tgt_groups)
    check_input_ids(pairing.pairs)

    noise_index = _noise_index(noise, ref_groups, filters) if noise is not None else None

    stages_out: list[dict] = []
    pairs_out: list[tuple] = []
    only_ref: list[str] = []
    only_target: list[str] = []
    jobs: list[tuple] = []  # (ref group, record pair key, ref record, target record) in execution order
    for rg, tg in pairing.pairs:
        if rank is None:  # a multi-rank side against a single-rank one: fold its ranks per stage
            rg, tg = align_ranks(rg, tg), align_ranks(tg, rg)
        for sk in rg.order:
            r = rg.records[sk]
            t = tg.records.get(sk)
            if t is None:
                only_ref.append(r.key)
                continue
            jobs.append((rg, sk, r, t))
        only_target.extend(tg.records[sk].key for sk in tg.order if sk not in rg.records)
    for (rg, sk, r, t), e in zip(jobs, _map_records(jobs, thresholds, exact)):
        for side, rec in (("ref", r), ("target", t)):
            if rec.fold is not None:
                e[f"unsharded_{side}"] = {"how": rec.fold.describe(), "ranks": len(rec.parts)}
        if noise_index is not None:
            _apply_noise(e, noise_index.get((rg.tags, rg.call, sk)))
        stages_out.append(e)
        pairs_out.append((r, t))
    if not any(e["key"] != "embed.input_ids" for e in stages_out):
        raise FFDebugError(_nothing_paired(ref_store, tgt_store, pairing, filters))
    if layers is not None and not any(e["layer"] is not None for e in stages_out):
        _no_layer_selected(layers, ref_store)
    notes: list[str] = []
    if pairing.warmup_skipped:
        notes.append(f"{len(pairing.warmup_skipped)} warm-up call(s) on the target side were set aside")
    if any(e.get("stats_only") for e in stages_out):
        notes.append("some stages were dumped as statistics only and compared on their stats")
    notes.extend(_budget_notes(pairs_out))
    return CompareResult(
        verdict=worst(*(e["severity"] for e in stages_out)),
        stages=stages_out,
        ref_path=ref_store.path,
        target_path=tgt_store.path,
        fail_on=fail_on,
        only_ref=sorted(set(only_ref)),
        only_target=sorted(set(only_target)),
        warmup_skipped=len(pairing.warmup_skipped),
        unpaired_calls={
            "ref": [{"call": g.call, "step": dict(g.tags)} for g in pairing.unpaired_ref],
            "target": [{"call": g.call, "step": dict(g.tags)} for g in pairing.unpaired_target],
        },
        notes=notes,
        stats_only=any(e.get("stats_only") for e in stages_out)
        and all(e.get("stats_only") for e in stages_out if e["key"] != "embed.input_ids"),
        records=pairs_out,
    )


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


def _map_records(jobs: list[tuple], thresholds, exact: bool) -> list[dict]:
    """`compare_records` over every pair, in order, one pair loaded at a time (memory stays
    bounded by the largest pair). The chunk loop runs on one intra-op thread; a second Python
    worker thread was measured here and gained under 10% while doubling the peak memory."""
    from ffdebug._chunks import single_thread

    with single_thread():
        return [compare_records(r, t, thresholds, exact) for _, _, r, t in jobs]


def _noise_index(noise, ref_groups, filters) -> dict:
    """(tags, call, stage) -> the noise run's rel against the reference for that stage."""
    noise_store = _as_store(noise)
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


def _apply_noise(entry: dict, noise: tuple | None) -> None:
    if noise is None:
        entry["noise_rel"] = None
        return
    noise_rel, noise_dtype = noise
    entry["noise_rel"] = noise_rel
    if noise_rel is None or entry["rel"] is None or entry["severity"] == "ok":
        return
    dtype = entry.get("dtype_target") or noise_dtype
    k = noise_factor(entry.get("dtype_ref"), dtype, noise_dtype)
    if entry["rel"] <= k * noise_rel and RANK[entry["severity"]] < RANK["bug"]:
        entry["within_noise"] = True
        entry["notes"].append(f"within noise: rel {entry['rel']:.3g} <= {k:g} x noise rel {noise_rel:.3g}")
        entry["severity"] = "ok"
    else:
        entry["within_noise"] = False
