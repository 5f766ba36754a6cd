"""Exactness tests of one weight tensor pair: same bytes, equal after a cast, within one ulp.

numpy arrays (`ffdebug.arrays`; a torch tensor is viewed as one by `as_array`). Every test reads
its arrays in pieces (`CHUNK` elements, `ffdebug._chunks`; `BYTES_CHUNK` for the raw-bit tests),
so a pair of large tensors costs no more than the pair itself. `within_rounding` takes max|r|
from its caller when known: the findings measure it once per pair for their up to three rounding
tests (bench/README.md)."""

from __future__ import annotations

import math

from ffdebug._chunks import CHUNK, iter_chunks
from ffdebug.arrays import as_array, int_view, round_to
from ffdebug.weights import quant

BYTES_CHUNK = 1 << 20  # elements compared at a time by the raw-bit tests (a bool row of 1 MiB)
HEAD = 1 << 12  # elements the rounding tests try first (a chunk is read whole before it can fail)


def _bits(x):
    """A flat signed-integer view of the raw bits of `x` (complex: of its real and imaginary
    parts), so that equality is a memcmp: NaN payloads and −0.0 count."""
    import numpy as np

    flat = np.ascontiguousarray(x).reshape(-1)
    if flat.dtype.kind == "c":
        flat = flat.view(flat.real.dtype)
    return flat.view(int_view(flat.dtype))


def bytes_equal(a, b) -> bool:
    """Same dtype, same shape, same bytes (NaN payloads and −0.0 included)."""
    import numpy as np

    a, b = as_array(a), as_array(b)
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    ab, bb = _bits(a), _bits(b)
    return all(
        np.array_equal(ab[i : i + BYTES_CHUNK], bb[i : i + BYTES_CHUNK])
        for i in range(0, ab.size, BYTES_CHUNK)
    )


def equal_after_cast(fine, coarse) -> bool:
    """`fine` cast to `coarse.dtype` (round to nearest even) is bit-equal to `coarse` (in chunks)."""
    f, c = as_array(fine).reshape(-1), as_array(coarse).reshape(-1)
    for i in range(0, f.size, CHUNK):
        if not bytes_equal(round_to(f[i : i + CHUNK], c.dtype), c[i : i + CHUNK]):
            return False
    return True


_MINMAX_DTYPES = ("float16", "float32", "float64")  # numpy's own min / max, on the stored dtype


def abs_max(x) -> float:
    """max |x| over a float array (0.0 when empty; inf or NaN when it holds a non-finite value).
    One min and one max pass on the stored dtype (exact: no rounding in a min or a max) for
    numpy's floats, else float64 chunks (bfloat16, float8: exact in float64)."""
    import numpy as np

    flat = as_array(x).reshape(-1)
    if flat.size == 0:
        return 0.0
    if str(flat.dtype) in _MINMAX_DTYPES:
        lo, hi = float(np.min(flat)), float(np.max(flat))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return math.nan
        return max(-lo, hi)
    absmax = 0.0
    for c in iter_chunks(flat):
        m = float(np.abs(c).max())
        if not math.isfinite(m):
            return m
        absmax = max(absmax, m)
    return absmax


def within_rounding(ref, tgt, eps: float, absmax=None, bound: float | None = None) -> bool:
    """Every |t − r| ≤ eps·|r| + eps·2⁻⁸·max|r| (one ulp, with a floor for tiny values), in
    float64 (exact for the difference of two float32 or narrower values; the bound rounds once
    per operation). `absmax`: max|r|, or a function that measures it, when the caller knows it
    (`abs_max`), else measured here; `bound`: an upper bound of max|r| the caller has for free
    (‖r‖₂): a pair whose first `HEAD` elements fail even with the floor it gives fails without
    max|r| being measured (where they pass, the whole test runs as without it)."""
    r, t = as_array(ref).reshape(-1), as_array(tgt).reshape(-1)
    if bound is not None and math.isfinite(bound):
        if not _within(r[:HEAD], t[:HEAD], eps, eps * 2.0**-8 * bound):
            return False
    if callable(absmax):
        absmax = absmax()
    elif absmax is None:
        absmax = abs_max(r)
    if not math.isfinite(absmax):
        return False
    floor = eps * 2.0**-8 * absmax
    # the head first: a pair off by more than rounding usually shows it in its first elements
    return _within(r[:HEAD], t[:HEAD], eps, floor) and _within(r[HEAD:], t[HEAD:], eps, floor)


def _within(r, t, eps: float, floor: float) -> bool:
    """Every |t − r| ≤ eps·|r| + floor, chunk by chunk (float64 copies), stopping at the first
    chunk that fails."""
    import numpy as np

    rt = iter(iter_chunks(t))
    with np.errstate(invalid="ignore", over="ignore"):
        for rc in iter_chunks(r):
            tc = next(rt)
            np.subtract(tc, rc, out=tc)
            np.abs(tc, out=tc)
            np.abs(rc, out=rc)
            np.multiply(rc, eps, out=rc)
            np.add(rc, floor, out=rc)
            if not bool((tc <= rc).all()):
                return False
    return True


def coarsest_ulp(*dtypes: str) -> float | None:
    """The largest unit roundoff among `dtypes`; None when one of them has none (integers)."""
    eps = [quant.ulp(d) for d in dtypes]
    if any(e is None for e in eps):
        return None
    return max(eps)
