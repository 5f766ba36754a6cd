"""One paired stage's grade from its metrics: the verdict rules (`ffdebug.verdict`) in the order
docs/architecture.md lists them, with the notes each rule that changes the grade adds.

    bands -> threshold -> element-wise (scaled by depth for a low-precision side) -> amplified
    precision -> selection -> zero side -> near zero -> NaN / Inf -> range -> exact
"""

from __future__ import annotations

import math

from ffdebug import verdict as V
from ffdebug.comparison import near_zero
from ffdebug.comparison.metrics import TensorMetrics
from ffdebug.io.record import Record
from ffdebug.results import StageResult


def grade(
    e: StageResult,
    m: TensorMetrics,
    r: Record,
    t: Record,
    thresholds: tuple[V.Threshold, ...],
    exact: bool,
    depth: int | None,
    integer: bool,
) -> V.Severity:
    """The grade of stage `e` (records `r`, `t`, metrics `m`); sets `e`'s rule flags
    (`near_zero`, `range_limited`, `invariance`) and notes. `depth`: blocks at and before the
    stage (the element-wise rule of a low-precision side); `integer`: the tensors hold integers
    (the selection rule)."""
    if depth is None:
        depth = r.layer + 1 if r.layer is not None else 0
    scale = V.elem_scale(depth, *e.judged_dtypes)
    severity = V.classify(m.cos, m.rel, e.key, thresholds, m.elem, m.max_abs, scale)
    amplified = V.amplified_precision(severity, m.cos, m.rel, m.norm_ratio, *e.judged_dtypes)
    if amplified is not None and V.matching_threshold(e.key, thresholds) is None:
        severity = V.Severity.DRIFT
        e.notes.append(amplified)
    chosen = V.selection(severity, r.layer, integer, e.call_dtypes)
    if chosen is not None and not (m.nan_mismatch or m.inf_mismatch):
        severity = V.Severity.DRIFT
        e.notes.append(chosen)
    severity = V.zero_side(severity, m.ref_norm, m.target_norm, m.numel)
    if not (m.nan_mismatch or m.inf_mismatch):
        severity = near_zero.grade(severity, r, t, m.max_abs, e.notes)  # declared `scale`: absolute atol
        e.near_zero = near_zero.within(r, t, m.max_abs)
    severity = V.nonfinite(severity, m.nan_mismatch, m.inf_mismatch)
    underflow = V.below_range(m.ref_norm / math.sqrt(m.numel), r.dtype, t.dtype) if m.numel else None
    if underflow is not None and not (m.nan_mismatch or m.inf_mismatch):
        severity, e.range_limited = V.range_limited(severity), True
        e.notes.append(underflow)
    if exact:
        severity, e.invariance = V.exact(severity, m.bit_equal)
        if e.invariance:
            e.notes.append(f"not bit-equal (--exact): {e.invariance}")
    return severity
