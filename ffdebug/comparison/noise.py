"""A noise run (`--noise`): a second reference run with run-to-run noise only, whose error
against the reference sets each stage's scale (README "Comparing"): within noise back to ok,
beyond noise at least diverge, and the exact-prefix rule where the noise run is bit-identical."""

from __future__ import annotations

from ffdebug import verdict as V
from ffdebug.comparison.metrics import compare_tensors
from ffdebug.comparison.pairing import group_calls, pair_calls
from ffdebug.io.side import SideStore
from ffdebug.results import StageResult
from ffdebug.store.reader import open_side


def noise_index(noise, ref_groups, filters) -> dict:
    """(tags, call, stage) -> the noise run's rel against the reference for that stage (the caller
    passes the noise store renamed by the same `--map` / `--alias-file` as the target's)."""
    noise_store = noise if isinstance(noise, SideStore) else open_side(noise)
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


def apply_noise(e: StageResult, noise: tuple | None) -> None:
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


def exact_prefix_with_noise(stages: list[StageResult]) -> None:
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
