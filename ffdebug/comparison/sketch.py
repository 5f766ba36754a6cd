"""Seeded bucket-hash sketches of a tensor, and rel / cos estimated from two of them
(README "Hunt: from symptom to root cause", `FFDEBUG_FWD_DUMP_MODE=sketch`).

A count sketch with B = 1,024 buckets: element i of the flattened tensor x goes to bucket h(i) with
sign s(i) = ±1 (h and s from a splitmix64 hash of i and the seed, the same on both sides):

    S(x)_b = Σ_{i : h(i) = b} s(i) · x_i

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

SKETCH_BUCKETS = 1024
CHUNK = 1 << 20  # elements hashed at a time

_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's constants (uint64, wrapping)
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def _hash(index, seed: int):
    """splitmix64(index + seed · γ) of uint64 indices, wrapping."""
    import numpy as np

    u = np.uint64
    z = index * u(_GAMMA) + u(seed * 0x632BE59BD9B4E019 & ((1 << 62) - 1))
    z = (z ^ (z >> u(30))) * u(_MUL1)
    z = (z ^ (z >> u(27))) * u(_MUL2)
    return z ^ (z >> u(31))


def sketch(tensor, seed: int = 0, buckets: int = SKETCH_BUCKETS):
    """S(x): the float64 sketch of `tensor` (any shape, flattened in row-major order)."""
    import numpy as np

    flat = as_array(tensor).reshape(-1)
    out = np.zeros(buckets, dtype=np.float64)
    with np.errstate(over="ignore"):  # the hash wraps by design
        for start in range(0, flat.shape[0], CHUNK):
            x = as_float64(flat[start : start + CHUNK])
            h = _hash(np.arange(start, start + x.shape[0], dtype=np.uint64), seed)
            bucket = (h & np.uint64(buckets - 1)).astype(np.intp)
            sign = 1.0 - 2.0 * ((h >> np.uint64(40)) & np.uint64(1)).astype(np.float64)
            out += np.bincount(bucket, weights=x * sign, minlength=buckets)
    return out


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
