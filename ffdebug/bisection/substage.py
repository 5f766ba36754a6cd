"""Inside one layer: the first stage whose own step loses accuracy (dump-bisect phase 5).

The stages of the layer are taken in execution order (capture order). Each stage is measured
against its *input*: the `.in` dump of the same module when there is one (sub-stage dumps of the
extra classes named in the block-class list), else the nearest earlier stage of the same shape,
else the block's `hidden_in`. A step is lossy when

    cos(input) - cos(stage) > 0.001,  or
    rel(stage) - rel(input) > max(1%, 50% of rel(input)),  or
    the input is exactly equal (same dtype) and the stage is not, by more than rounding
    (`verdict.above_rounding`: 16 eps of the dtype): any such error appearing from an exact input
    is a signal, however small (unless a noise run says this stage is noisy); a difference of a
    few roundings is what another summation order gives.
"""

from __future__ import annotations

import re

from ffdebug import verdict as V
from ffdebug.bisection.budget import is_exact, within_noise
from ffdebug.models.blocks import is_block_stage
from ffdebug.results import StageResult

COS_STEP = 0.001
REL_STEP = 0.01
REL_STEP_SHARE = 0.5


def _input_of(i: int, entries: list[StageResult], hidden_in: StageResult | None) -> StageResult | None:
    e = entries[i]
    stage = e.stage
    m = re.match(r"^(.+)\.out(?:\.\w+)?$", stage)
    if m:
        head = m.group(1)
        for prev in entries[:i]:
            if prev.stage == f"{head}.in":
                return prev
    for prev in reversed(entries[:i]):
        if prev.ref.shape == e.ref.shape and not prev.stage.endswith(".in"):
            return prev
    return hidden_in


def lossy_step(e: StageResult, base: StageResult | None) -> tuple[bool, str]:
    """Whether `e` loses accuracy relative to its input `base`, and why."""
    cos, rel = e.cos, e.rel
    if e.finding == "shape_mismatch" or (cos is None and rel is None):
        return True, "shape mismatch or no numbers"
    b_cos = 1.0 if base is None or base.cos is None else base.cos
    b_rel = 0.0 if base is None or base.rel is None else base.rel
    if within_noise(e):
        return False, "within noise"
    if cos is not None and b_cos - cos > COS_STEP:
        return True, f"cos drops {b_cos - cos:.3g}"
    if rel is None:
        return True, "rel undefined (reference all zeros)"
    if rel - b_rel > max(REL_STEP, REL_STEP_SHARE * b_rel):
        return True, f"rel grows {b_rel * 100:.3g}% -> {rel * 100:.3g}%"
    exact_base = base is None or is_exact(base)
    if (
        exact_base
        and not is_exact(e)
        and e.same_dtype
        and V.above_rounding(e.rel, e.dtype_ref, e.dtype_target)
    ):
        return True, "first inexact stage after an exactly equal input (same dtype), above rounding"
    return False, ""


def first_lossy(entries: list[StageResult], block_only: bool = False) -> tuple[StageResult | None, str]:
    """First stage of one layer (execution order) whose own step loses accuracy."""
    hidden_in = next((e for e in entries if e.stage == "hidden_in"), None)
    pool = [e for e in entries if e.stage != "hidden_in"]
    if block_only:
        pool = [e for e in pool if is_block_stage(e.stage)]
    for i, e in enumerate(pool):
        ok, why = lossy_step(e, _input_of(i, pool, hidden_in))
        if ok:
            return e, why
    return None, ""


def input_and_readers(entries: list[StageResult], key: str) -> tuple[StageResult | None, list[StageResult]]:
    """What the step of stage `key` (one layer, execution order) is measured against by the rule
    of `first_lossy`, and the later stages of the layer measured against it: the evidence around
    a named sub-stage (`ffdebug hunt`'s round 2)."""
    hidden_in = next((e for e in entries if e.stage == "hidden_in"), None)
    pool = [e for e in entries if e.stage != "hidden_in"]
    at = next((i for i, e in enumerate(pool) if e.key == key), None)
    if at is None:
        return None, []
    readers = [e for j, e in enumerate(pool) if j > at and _input_of(j, pool, hidden_in) is pool[at]]
    return _input_of(at, pool, hidden_in), readers


def largest_step(entries: list[StageResult]) -> tuple[StageResult | None, float | None]:
    """The stage of one layer (execution order) whose own step adds the most error, and that
    error: rel(stage) - rel(its input) - `INHERIT_SHARE` x rel(its input) (the input as
    `first_lossy` takes it). A bug inside a sub-stage whose effect on the block's output is small
    (q scaled: the attention output barely moves) still shows here."""
    from ffdebug.bisection.budget import INHERIT_SHARE

    hidden_in = next((e for e in entries if e.stage == "hidden_in"), None)
    pool = [e for e in entries if e.stage != "hidden_in"]
    best, worst_step = None, None
    for i, e in enumerate(pool):
        if e.rel is None or e.near_zero or e.range_limited or V.machine_eps(e.dtype_ref) is None:
            continue  # an integer stage's rel (of indices) is no error of a computation
        base = _input_of(i, pool, hidden_in)
        b_rel = base.rel if base is not None and base.rel is not None else 0.0
        step = e.rel - (1.0 + INHERIT_SHARE) * b_rel
        if worst_step is None or step > worst_step:
            best, worst_step = e, step
    return best, worst_step


def largest_scale_step(entries: list[StageResult]) -> tuple[StageResult | None, float | None]:
    """The stage of one layer (execution order) whose own step adds the largest *scale* of the
    signal, and that scale: |alpha(stage) - alpha(its input)|, alpha = <t - r, r> / |r|^2
    (`verdict.scale_error`), counted only where the stage's error is mostly that scale
    (`verdict.coherence` >= `COHERENT`). Rounding adds no scale; q scaled by 1.1 adds 0.1 at q."""
    hidden_in = next((e for e in entries if e.stage == "hidden_in"), None)
    pool = [e for e in entries if e.stage != "hidden_in"]
    best, largest = None, None
    for i, e in enumerate(pool):
        coh = V.coherence(e.cos, e.norm_ratio, e.rel)
        if coh is None or abs(coh) < V.COHERENT or e.near_zero or e.range_limited:
            continue
        base = _input_of(i, pool, hidden_in)
        b_alpha = V.scale_error(base.cos, base.norm_ratio) if base is not None else None
        step = abs(V.scale_error(e.cos, e.norm_ratio) - (b_alpha or 0.0))
        if largest is None or step > largest:
            best, largest = e, step
    return best, largest
