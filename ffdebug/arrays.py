"""The analysis side's arrays: numpy, with `ml_dtypes` for bfloat16 and the float8 kinds.

Foundation layer: imports nothing from ffdebug and never imports torch. Readers hand the
comparison numpy arrays; a torch tensor given through the Python API (or read from a `.pt` file)
becomes one at the boundary with `as_array` — a view of the same memory where numpy has the dtype,
a view of its raw bits re-typed with `ml_dtypes` where it has not (bfloat16, float8). Dtype names
are those the store writes (torch's names without the `torch.` prefix), which are numpy's and
ml_dtypes' own names (`str(array.dtype)`).

Notation: "floating" means a real floating dtype, numpy's or ml_dtypes'; complex is apart.
"""

from __future__ import annotations

import functools

# ml_dtypes' names, which are also torch's: read through `ml_dtypes` (numpy has none of them)
_ML_FLOATS = (
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e8m0fnu",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
_NUMPY = (
    "float64",
    "float32",
    "float16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bool",
    "complex64",
    "complex128",
)
_INT_OF_WIDTH = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


@functools.cache
def dtype(name: str):
    """The numpy dtype of a store dtype name (`float32`, `bfloat16`, `torch.float8_e4m3fn`), or
    None for a name neither numpy nor ml_dtypes knows."""
    import numpy as np

    name = name.removeprefix("torch.")
    if name in _NUMPY:
        return np.dtype(name)
    if name in _ML_FLOATS:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return None


def dtype_name(dt) -> str:
    """The store's name of a numpy dtype (`float32`, `bfloat16`, `bool`)."""
    return str(dt)


def is_floating(dt) -> bool:
    """A real floating dtype (float64/32/16, bfloat16, float8 kinds)."""
    name = str(dt)
    return name in ("float64", "float32", "float16") or name in _ML_FLOATS


def is_complex(dt) -> bool:
    return str(dt) in ("complex64", "complex128")


def is_low_byte_float(dt) -> bool:
    """A one-byte float (float8 kinds): converted through a 256-entry table (`to_float64`).
    numpy has no one-byte float of its own, so a one-byte dtype that is no integer or bool is one
    of ml_dtypes' (told without `str(dtype)`, which costs ~10 µs: this runs once per chunk)."""
    return dt.itemsize == 1 and dt.kind not in "iub"


@functools.cache
def finfo(dt):
    """numpy's or ml_dtypes' `finfo` of a floating dtype."""
    import numpy as np

    if str(dt) in _ML_FLOATS:
        import ml_dtypes

        return ml_dtypes.finfo(dt)
    return np.finfo(dt)


def eps(dt) -> float:
    return float(finfo(dt).eps)


def int_view(dt):
    """The signed integer dtype of a dtype's width (raw-bit comparisons), or None."""
    import numpy as np

    name = _INT_OF_WIDTH.get(dt.itemsize)
    return np.dtype(name) if name else None


@functools.cache
def _byte_table(dt):
    """The float64 value of each of the 256 bit patterns of a one-byte float dtype."""
    import numpy as np

    return np.arange(256, dtype=np.uint8).view(dt).astype(np.float64)


def to_float64(src, out) -> None:
    """`out` (float64, same size, flat) <- `src` (flat, any real dtype), exactly: one-byte floats
    through a table of their 256 values (ml_dtypes' elementwise cast is about 10x slower); the
    others with numpy's cast."""
    import numpy as np

    if is_low_byte_float(src.dtype):
        np.take(_byte_table(src.dtype), src.view(np.uint8), out=out)
    else:
        np.copyto(out, src, casting="unsafe")


def as_float64(x):
    """A float64 copy of an array (any real dtype)."""
    import numpy as np

    out = np.empty(x.shape, dtype=np.float64)
    with np.errstate(invalid="ignore"):  # a signalling NaN stays a NaN, without a warning
        to_float64(x.reshape(-1), out.reshape(-1))
    return out


def is_torch(x) -> bool:
    """A torch tensor, told without importing torch (only a program that imported it has one)."""
    return type(x).__module__.split(".")[0] == "torch"


def as_array(x):
    """A numpy array of `x`: numpy arrays as they are; a torch tensor detached, on the CPU, as a
    view of its memory (bfloat16 / float8 re-typed with ml_dtypes through their raw bits); other
    array-likes through `numpy.asarray`."""
    import numpy as np

    if isinstance(x, np.ndarray):
        return x
    if is_torch(x):
        return _from_torch(x)
    return np.asarray(x)


def _from_torch(t):

    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    name = str(t.dtype).removeprefix("torch.")
    if t.is_complex() or name in _NUMPY:
        return t.resolve_conj().resolve_neg().numpy()
    target = dtype(name)
    if target is None:
        raise TypeError(f"a torch tensor of dtype {name} has no numpy counterpart")
    import torch

    ints = getattr(torch, _INT_OF_WIDTH[t.element_size()])
    return t.contiguous().view(ints).numpy().view(target).reshape(tuple(t.shape))


def equal(a, b) -> bool:
    """Same shape, dtype and bits — of the raw representation, so NaN equals a NaN of the same
    bits and -0.0 differs from 0.0 (like a memcmp)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    import numpy as np

    iv = int_view(a.dtype)
    if iv is None or a.dtype.kind == "c":
        return bool(np.array_equal(a, b))
    return bool(np.array_equal(np.ascontiguousarray(a).view(iv), np.ascontiguousarray(b).view(iv)))


def to_torch(a):
    """A torch tensor over the same memory as numpy array `a` (bfloat16 / float8 through their
    raw bits); a torch tensor as it is. For the paths where a torch object is the point (running
    a model on dumped inputs); imports torch."""
    import numpy as np
    import torch

    if is_torch(a):
        return a
    name = str(a.dtype)
    shape = a.shape  # ascontiguousarray makes a 0-d array 1-d: the shape is put back
    if name in _NUMPY:
        return torch.from_numpy(np.ascontiguousarray(a)).reshape(shape)
    ints = np.ascontiguousarray(a).view(_INT_OF_WIDTH[a.dtype.itemsize])
    return torch.from_numpy(ints).view(getattr(torch, name)).reshape(shape)


def round_to(a, dtype):
    """`a` rounded to floating `dtype` as torch's `.to(dtype)` rounds it: from float64 to a float
    narrower than float32 through float32 (two roundings, as torch's CPU and CUDA casts do),
    every other cast once (numpy's `astype` rounds float64 to float16 once, which differs from
    torch's on values halfway after the first rounding)."""
    import numpy as np

    dtype = np.dtype(dtype)
    if a.dtype == np.float64 and is_floating(dtype) and dtype.itemsize < 4:
        a = a.astype(np.float32)
    return a.astype(dtype)


def scalar(x):
    """A Python bool / int / float of a numpy scalar of any dtype (ml_dtypes' keep their own type
    under `.item()`)."""
    name = str(getattr(x, "dtype", ""))
    if name == "bool":
        return bool(x)
    if name.startswith(("int", "uint")):
        return int(x)
    if is_complex(getattr(x, "dtype", None)):
        return complex(x)
    return float(x)


def first_difference(r, t):
    """(position, ref value, target value) of the first element where two arrays of one shape
    differ, or None when every value is equal (NaN never equals)."""
    import numpy as np

    ne = r != t
    if not ne.any():
        return None
    pos = np.unravel_index(int(np.argmax(ne.reshape(-1))), r.shape) if r.ndim else ()
    pos = [int(p) for p in pos]
    return pos, scalar(r[tuple(pos)]), scalar(t[tuple(pos)])


def float32_of(x):
    """`x` itself when it is float32, else `as_float32(x)`: for readers that do not write."""
    return x if x.dtype.char == "f" else as_float32(x)


def as_float32(x):
    """A float32 copy of an array of any real dtype: exact for float16, bfloat16 and the float8
    kinds (every value of theirs is a float32), rounded to nearest for float64 (as torch's
    `.float()`). One-byte floats go through the table of their 256 values (`to_float64`'s)."""
    import numpy as np

    if is_low_byte_float(x.dtype):
        return np.take(_byte_table(x.dtype).astype(np.float32), x.view(np.uint8))
    return x.astype(np.float32)
