"""Near-zero reduced values: judged with an absolute tolerance derived from the size of their terms.

A value that is a sum (or mean) of terms that nearly cancel is rounding noise on both sides: the
GRPO loss of an on-policy step is mean(−Â·ρ) with ρ = 1 and group-normalised Â, about 1e-9 for terms
of size 1, and one side may be exactly 0.0. Its relative error is then meaningless, and the cos /
rel bands would grade two correct trainers `bug`. So a tap may declare `scale=S`, the absolute size
of what was summed, S = Σ|terms| (divided by what the sum was divided by), and the two values are
judged against the rounding such a reduction can make (docs/trainer-taps.md "Near-zero values"):

    |x_ref − x_target| ≤ atol = K · ε(dtype) · S,    K = 16

ε is the dtype's machine epsilon (float32: 1.19e-7); K covers the reduction of a few dozen terms and
the casts upstream (a float32 sum of n terms is within about n·ε·S of the exact sum). Within atol
the stage is ok, with a note saying so; outside, the bands grade it as usual. A value with no
declared scale is never judged this way.
"""

from __future__ import annotations

from ffdebug import verdict as V
from ffdebug.verdict import Severity

K = 16.0


def declared_scale(*records) -> float | None:
    """The largest `scale` the records declare (None when neither does)."""
    scales = [
        float(r.extra["scale"]) for r in records if isinstance((r.extra or {}).get("scale"), (int, float))
    ]
    return max(scales) if scales else None


def tolerance(dtype: str | None, scale: float) -> float:
    """atol = K · ε(dtype) · scale (module docstring)."""
    from ffdebug.arrays import dtype as np_dtype
    from ffdebug.arrays import eps, is_floating

    dt = np_dtype(dtype or "float32")
    return K * eps(dt if dt is not None and is_floating(dt) else np_dtype("float32")) * abs(scale)


def within(r, t, max_abs: float | None) -> bool:
    """The records declare a scale and differ by no more than its atol: judged near zero (the noise
    rules do not apply to such a pair: its relative error is meaningless, docs/trainer-taps.md)."""
    scale = declared_scale(r, t)
    return scale is not None and max_abs is not None and max_abs <= tolerance(r.dtype, scale)


def grade(severity: Severity, r, t, max_abs: float | None, notes: list[str]) -> Severity:
    """`severity`, or ok when both records declare a scale and differ by no more than its atol."""
    if V.is_ok(severity) or not within(r, t, max_abs):
        return severity
    scale = declared_scale(r, t)
    atol = tolerance(r.dtype, scale)
    notes.append(
        f"near zero: |difference| {max_abs:.3g} <= atol {atol:.3g} (16·eps·scale, scale {scale:.3g} "
        "declared by the tap)"
    )
    return Severity.OK
