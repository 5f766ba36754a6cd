"""fp8 dequantisation: `w = float32(fp8) * scale`, scale per tensor, per channel or per block, on
numpy arrays (the float8 kinds are `ml_dtypes`', `ffdebug.arrays`).

Scale conventions found in checkpoints (all multiply when dequantising):
- `X.weight_scale_inv` (DeepSeek-V3 style, one fp32 scale per 128×128 block);
- `X.weight_scale` (compressed-tensors / vLLM: a scalar, or one per output channel);
- e8m0 scales (MX formats): a `float8_e8m0fnu` or `uint8` tensor of biased exponents, scale =
  2^(x − 127) (x = 255 is NaN).

Block sizes are inferred per dim (`block_size`: a power of two when one fits), so padded last
blocks work.
`quantize_fp8` is the inverse (used to build fixtures and benchmarks).
"""

from __future__ import annotations

import math

from ffdebug.errors import FFDebugError

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
E8M0_DTYPES = ("float8_e8m0fnu", "uint8")

# Explicit mantissa bits: one ulp relative to the value is at most 2^-bits.
MANTISSA_BITS = {
    "float64": 52,
    "float32": 23,
    "float16": 10,
    "bfloat16": 7,
    "float8_e4m3fn": 3,
    "float8_e4m3fnuz": 3,
    "float8_e5m2": 2,
    "float8_e5m2fnuz": 2,
}


def is_fp8(dtype: str) -> bool:
    return dtype in FP8_DTYPES


def ulp(dtype: str) -> float | None:
    """Relative size of one ulp of a float dtype (None for integer / bool dtypes)."""
    bits = MANTISSA_BITS.get(dtype)
    return None if bits is None else 2.0**-bits


def scale_candidates(name: str) -> list[str]:
    """Names under which the scale of the fp8 tensor `name` may be stored, most likely first."""
    out = [name + "_scale_inv", name + "_scale", name + ".scale_inv", name + ".scale"]
    if "." in name:
        stem = name.rsplit(".", 1)[0]
        out += [stem + ".scale_inv", stem + ".scale", stem + ".weight_scale_inv", stem + ".weight_scale"]
    return list(dict.fromkeys(out))


def e8m0_to_float(exponents):
    """Biased e8m0 exponents (uint8 or float8_e8m0fnu) to float32 2^(x − 127), exactly (`ldexp`,
    2^-127 a float32 subnormal); 255 is NaN."""
    import numpy as np

    from ffdebug.arrays import as_array

    x = as_array(exponents).view(np.uint8)
    with np.errstate(over="ignore"):  # 255 (2^128) is NaN, set next
        out = np.ldexp(np.ones(x.shape, dtype=np.float32), x.astype(np.int32) - 127)
    out[x == 255] = np.nan
    return out


def scale_to_float(scale):
    """A scale tensor as float32: e8m0 exponents decoded, anything else cast."""
    from ffdebug.arrays import as_float32

    if str(scale.dtype) in E8M0_DTYPES:
        return e8m0_to_float(scale)
    return as_float32(scale)


def block_size(n: int, k: int) -> int | None:
    """Block size b with ceil(n / b) == k; a power of two when one fits (the last block may be
    padded: 24 columns in 2 blocks are blocks of 16, not 12), else ceil(n / k)."""
    if k <= 0 or k > n:
        return None
    lo = math.ceil(n / k)
    hi = (n - 1) // (k - 1) if k > 1 else n
    if hi < lo:
        return None
    p = 1 << (hi.bit_length() - 1)
    return p if p >= lo else lo


def expand_scale(scale, shape: tuple[int, ...], name: str = "tensor"):
    """Broadcast a float32 scale over `shape`: scalar, per leading channel, or per block (each
    block's scale repeated `block` times along its dim, the padded last block cut off)."""
    import numpy as np

    shape = tuple(shape)
    if scale.size == 1:
        return scale.reshape(())
    s = scale
    if s.ndim == 1 and len(shape) >= 1 and len(shape) != 1:
        if s.shape[0] == shape[0]:
            return s.reshape((shape[0],) + (1,) * (len(shape) - 1))
        raise FFDebugError(
            f"{name}: cannot apply a scale of shape {list(scale.shape)} to a tensor of shape {list(shape)}"
        )
    if s.ndim != len(shape):
        raise FFDebugError(
            f"{name}: scale has {s.ndim} dims but the tensor has {len(shape)} ({list(scale.shape)} vs "
            f"{list(shape)}); pass --dequant none to compare the raw fp8 values"
        )
    for d, (n, k) in enumerate(zip(shape, s.shape)):
        if k == n or k == 1:
            continue
        block = block_size(n, k)
        if block is None:
            raise FFDebugError(
                f"{name}: scale shape {list(scale.shape)} does not tile tensor shape {list(shape)} along dim {d}"
            )
        s = np.repeat(s, block, axis=d)[(slice(None),) * d + (slice(0, n),)]
    return s


def dequantize(weight, scale, name: str = "tensor"):
    """fp8 `weight` (any float8 dtype) times its scale, as float32 (one float32 product per
    element, as stored scales are applied)."""
    from ffdebug.arrays import as_array, as_float32

    w = as_float32(as_array(weight))
    if scale is None:
        return w
    w *= expand_scale(scale_to_float(as_array(scale)), tuple(w.shape), name)
    return w


def quantize_fp8(weight, dtype: str = "float8_e4m3fn", block: tuple[int, ...] | None = None, e8m0=False):
    """Quantise to fp8 with a per-tensor (block None) or per-block absmax scale.

    Returns (fp8 array, scale) of the kind `weight` is (torch tensors for a torch tensor, for
    fixtures saved with torch; else numpy arrays): the scale is float32, or float8_e8m0fnu powers
    of two when `e8m0` (rounded up so no value overflows). `dequantize(q, scale)` approximates
    `weight`.
    """
    import numpy as np

    from ffdebug.arrays import as_array, as_float32, finfo, is_torch, round_to, to_torch
    from ffdebug.arrays import dtype as np_dtype

    target = np_dtype(dtype)
    fmax = np.float32(finfo(target).max)
    w = as_float32(as_array(weight))
    if block is None:
        amax = np.abs(w).max().reshape(1)
        grid = (1,)
    else:
        if len(block) != w.ndim:
            raise ValueError(f"block {block} needs one size per dim of {list(w.shape)}")
        grid = tuple(math.ceil(n / b) for n, b in zip(w.shape, block))
        padded = np.zeros(tuple(g * b for g, b in zip(grid, block)), dtype=np.float32)
        padded[tuple(slice(0, n) for n in w.shape)] = np.abs(w)
        view_shape = []
        for g, b in zip(grid, block):
            view_shape += [g, b]
        amax = padded.reshape(view_shape).max(axis=tuple(range(1, 2 * w.ndim, 2)))
    scale = np.maximum(amax / fmax, np.finfo(np.float32).tiny).astype(np.float32)
    if e8m0:
        exp = np.clip(np.ceil(np.log2(scale)), -127, 127)
        stored = (exp + 127).astype(np.uint8).view(np_dtype("float8_e8m0fnu"))
        scale_f = e8m0_to_float(stored)
    else:
        stored = scale_f = scale.reshape(grid) if block is not None else scale.reshape(())
    q = np.clip(
        w / expand_scale(scale_f.reshape(grid) if block is not None else scale_f, tuple(w.shape)), -fmax, fmax
    )
    out = (round_to(q, target), stored.reshape(grid) if block is not None else stored.reshape(()))
    return tuple(to_torch(np.ascontiguousarray(a)) for a in out) if is_torch(weight) else out
