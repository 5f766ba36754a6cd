"""Exactness tests of one weight tensor pair: same bytes, equal after a cast, within one ulp.

Every test reads its tensors in `CHUNK`-element pieces (`ffdebug._chunks`) or in one reduction
on the stored dtype (`abs_max`), so a pair of large tensors costs no more than the pair itself.
`within_rounding` takes max|r| from its caller when known: the findings measure it once per pair
for their up to three rounding tests (bench/README.md)."""

from __future__ import annotations

import math

from ffdebug._chunks import CHUNK, iter_chunks
from ffdebug.weights import quant


def _int_view(t):
    import torch

    size = t.element_size()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


def bytes_equal(a, b) -> bool:
    """Same dtype, same shape, same bytes (NaN payloads and −0.0 included)."""
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    if a.is_complex():
        a, b = torch.view_as_real(a).reshape(-1), torch.view_as_real(b).reshape(-1)
    return torch.equal(_int_view(a), _int_view(b))


def equal_after_cast(fine, coarse) -> bool:
    """`fine` cast to `coarse.dtype` is bit-equal to `coarse` (checked in chunks)."""
    f, c = fine.reshape(-1), coarse.reshape(-1)
    for i in range(0, f.numel(), CHUNK):
        fc = f[i : i + CHUNK].to(coarse.dtype)
        if not bytes_equal(fc, c[i : i + CHUNK]):
            return False
    return True


_MINMAX_DTYPES = ("float16", "bfloat16", "float32", "float64")  # `aminmax` is exact and supported


def abs_max(x) -> float:
    """max |x| over a float tensor (0.0 when empty; inf or NaN when it holds a non-finite value).
    One `aminmax` pass on the stored dtype (exact: no rounding in a min or a max) where torch has
    one, else float64 chunks."""
    import torch

    flat = x.reshape(-1)
    if flat.numel() == 0:
        return 0.0
    if str(flat.dtype).removeprefix("torch.") in _MINMAX_DTYPES:
        lo, hi = (float(v) for v in torch.aminmax(flat))
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return math.nan
        return max(-lo, hi)
    absmax = 0.0
    for c in iter_chunks(flat):
        m = float(c.abs().max())
        if not math.isfinite(m):
            return m
        absmax = max(absmax, m)
    return absmax


def within_rounding(ref, tgt, eps: float, absmax: float | None = None) -> bool:
    """Every |t − r| ≤ eps·|r| + eps·2⁻⁸·max|r| (one ulp, with a floor for tiny values).
    `absmax`: max|r| when the caller knows it (`abs_max`), else measured here."""
    import torch

    r, t = ref.reshape(-1), tgt.reshape(-1)
    if absmax is None:
        absmax = abs_max(r)
    if not math.isfinite(absmax):
        return False
    floor = eps * 2.0**-8 * absmax
    size = min(CHUNK, max(r.numel(), 1))
    rb = torch.empty(size, dtype=torch.float64)
    tb = torch.empty(size, dtype=torch.float64)
    for i in range(0, r.numel(), CHUNK):
        m = min(CHUNK, r.numel() - i)
        rc, tc = rb[:m], tb[:m]
        rc.copy_(r[i : i + m])
        tc.copy_(t[i : i + m])
        tc.sub_(rc).abs_()
        rc.abs_().mul_(eps).add_(floor)
        if not bool((tc <= rc).all()):
            return False
    return True


def coarsest_ulp(*dtypes: str) -> float | None:
    """The largest unit roundoff among `dtypes`; None when one of them has none (integers)."""
    eps = [quant.ulp(d) for d in dtypes]
    if any(e is None for e in eps):
        return None
    return max(eps)
