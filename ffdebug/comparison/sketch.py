"""rel / cos of two tensors estimated from their seeded bucket-hash sketches
(docs/hunt.md "Hunt: from symptom to root cause", `FFDEBUG_FWD_DUMP_MODE=sketch`).

The sketch itself, S(x) with B = 1,024 buckets (element i of the flattened tensor x to bucket h(i)
with sign s(i) = ±1, from a splitmix64 hash of i and the seed, the same on both sides), is
computed at capture time by `ffdebug/count_sketch.py`, below capture and comparison alike.

S is linear, so S(t) − S(r) = S(t − r), and E‖S(d)‖² = ‖d‖² (the cross terms have random signs).
With the exact norms ‖r‖, ‖t‖ from the records' statistics:

    rel ≈ ‖S(t) − S(r)‖ / ‖r‖
    cos = (‖r‖² + ‖t‖² − ‖t − r‖²) / (2 ‖r‖ ‖t‖)   with ‖t − r‖² ≈ ‖S(t) − S(r)‖²

The estimate of ‖d‖² has a relative spread of about √(2/B) ≈ 4.4 % for a difference spread over
many elements, so a 1 % error is told from a 50 % one, and a permutation (a rotary swap, a head
permutation) that keeps mean, std and norm moves the elements to other buckets and shows. A
difference confined to elements of one bucket that cancel is invisible: the sketch estimates, it
never proves two tensors equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ffdebug.arrays import as_array, as_float64


@dataclass(frozen=True)
class SketchEstimate:
    rel: float | None  # ‖t − r‖ / ‖r‖, estimated
    cos: float | None
    equal: bool  # the two sketches are bit-equal (suggests, never proves, equal tensors)


def estimate(ref_sketch, target_sketch, ref_norm: float, target_norm: float) -> SketchEstimate:
    """rel and cos of two tensors from their sketches and their exact L2 norms."""
    import numpy as np

    r, t = as_float64(as_array(ref_sketch)), as_float64(as_array(target_sketch))
    d = t - r
    d2 = float(np.dot(d, d))
    equal = bool(np.array_equal(r, t))
    if ref_norm == 0.0 and target_norm == 0.0:
        return SketchEstimate(rel=0.0, cos=1.0, equal=equal)
    rel = math.sqrt(d2) / ref_norm if ref_norm else None
    if ref_norm == 0.0 or target_norm == 0.0:
        return SketchEstimate(rel=rel, cos=0.0, equal=equal)
    cos = (ref_norm**2 + target_norm**2 - d2) / (2.0 * ref_norm * target_norm)
    return SketchEstimate(rel=rel, cos=max(-1.0, min(1.0, cos)), equal=equal)
