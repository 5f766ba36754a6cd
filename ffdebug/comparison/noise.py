"""A noise run (`--noise`): a second reference run with run-to-run noise only, whose error
against the reference sets each stage's scale (docs/comparing.md "Comparing"): within noise back to ok,
beyond noise at least diverge, and the exact-prefix rule where the noise run is bit-identical.
A stage the noise run cannot be compared at is judged without it and says so ("noise not
comparable")."""

from __future__ import annotations

from dataclasses import dataclass

from ffdebug import verdict as V
from ffdebug.comparison.metrics import compare_tensors
from ffdebug.comparison.pairing import group_calls, pair_calls
from ffdebug.io.side import SideStore
from ffdebug.results import StageResult
from ffdebug.store.reader import open_side

NOT_COMPARABLE = "noise not comparable"


@dataclass(frozen=True)
class NoiseAt:
    """The noise run at one stage: its rel against the reference and its dtype, or why it has none."""

    rel: float | None
    dtype: str | None
    why_not: str | None = None  # set when rel is None


def noise_index(noise, ref_groups, filters) -> dict[tuple, NoiseAt]:
    """(tags, call, stage) -> the noise run at that stage (the caller passes the noise store renamed
    by the same `--map` / `--alias-file` as the target's). A stage missing from the index is one the
    noise run has no record of."""
    noise_store = noise if isinstance(noise, SideStore) else open_side(noise)
    pairing = pair_calls(ref_groups, group_calls(noise_store, filters))
    index = {}
    for rg, ng in pairing.pairs:
        for sk in rg.order:
            n = ng.records.get(sk)
            if n is None:
                continue
            r = rg.records[sk]
            if not (r.has_payload and n.has_payload):
                side = "the noise run's" if r.has_payload else "the reference's"
                index[(rg.tags, rg.call, sk)] = NoiseAt(None, n.dtype, f"{side} record has no tensor payload")
                continue
            m = compare_tensors(r.load(), n.load())
            why = None if m.rel is not None else "no error could be measured against the reference"
            index[(rg.tags, rg.call, sk)] = NoiseAt(m.rel, n.dtype, why)
    return index


def apply_noise(e: StageResult, noise: NoiseAt | None) -> None:
    """Record the noise run's error at this stage and apply the verdict's noise rules: within
    noise back to ok, beyond noise at least diverge. Where the noise run is not comparable the
    stage keeps its grade without it and a note says why."""
    e.noise_given = True
    if noise is None:
        noise = NoiseAt(None, None, "the noise run has no record of this stage")
    e.noise_rel = noise.rel
    if noise.rel is None:
        e.notes.append(f"{NOT_COMPARABLE}: {noise.why_not}; judged without the noise run")
        return
    if e.rel is None or e.near_zero:  # near zero: judged by its atol alone
        return
    k = V.noise_factor(e.dtype_ref, e.dtype_target or noise.dtype, noise.dtype)
    if V.beyond_noise(e.rel, noise.rel, k):
        e.beyond_noise, e.within_noise = True, False
        e.severity = V.noise_sensitive(e.severity, e.rel, noise.rel, k)
        e.notes.append(
            f"beyond noise: rel {e.rel:.3g} is {e.rel / noise.rel:.3g} x the noise run's {noise.rel:.3g}"
        )
        return
    if e.ok:
        return
    graded = V.noise(e.severity, e.rel, noise.rel, k)
    e.within_noise = graded is not e.severity
    if e.within_noise:
        e.notes.append(f"within noise: rel {e.rel:.3g} <= {k:g} x noise rel {noise.rel:.3g}")
        e.severity = graded


EXACT_NOISE_NOTE = (
    "the noise run equals the reference bit for bit up to here, so the exact-prefix rule applies: the "
    "first stage that is not bit-equal after exactly equal stages differs by its own computation"
)


def exact_prefix_with_noise(stages: list[StageResult]) -> None:
    """Per call and rank, in execution order: where the noise run is bit-identical to the
    reference (noise rel 0) the noise rule has no scale, so the exact-prefix rule decides
    (`verdict.exact_prefix_end`): that call's first stage that is not exactly equal is raised."""
    calls: dict[tuple, list[StageResult]] = {}
    for e in stages:
        if e.key != "embed.input_ids":
            step = tuple(sorted((str(k), str(v)) for k, v in e.step.items()))
            calls.setdefault((step, e.call, e.rank), []).append(e)
    for in_call in calls.values():
        e = V.exact_prefix_end(in_call)
        if e is not None and e.noise_rel == 0.0 and not e.near_zero and e.rel > 0.0:
            e.beyond_noise = True
            e.severity = V.exact_prefix_break(e.severity)
            e.notes.append(EXACT_NOISE_NOTE)
