"""The count sketch of a tensor, written at capture time in place of its payload
(`FFDEBUG_FWD_DUMP_MODE=sketch`) and compared by `comparison/sketch.py`'s estimates.

A count sketch with B = 1,024 buckets: element i of the flattened tensor x goes to bucket h(i) with
sign s(i) = ±1 (h and s from a splitmix64 hash of i and the seed, the same on both sides):

    S(x)_b = Σ_{i : h(i) = b} s(i) · x_i
"""

from __future__ import annotations

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
