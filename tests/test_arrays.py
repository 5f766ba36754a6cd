"""The analysis side's arrays (`ffdebug/arrays.py`, `ffdebug/_chunks.py`): the torch boundary keeps
every bit, float64 conversion is exact for every dtype a dump holds, and BLAS runs on one thread
inside the chunk loops and goes back to its setting after."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest
import torch

from ffdebug._chunks import one_blas_thread
from ffdebug.arrays import (
    as_array,
    as_float64,
    dtype,
    equal,
    first_difference,
    is_floating,
    round_to,
    scalar,
    to_torch,
)

ONE_BYTE = ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "float8_e4m3fnuz", "float8_e5m2fnuz")


@pytest.mark.parametrize(
    "name", ["bfloat16", "float16", "float32", "float64", *ONE_BYTE[:2], "int64", "bool"]
)
def test_a_torch_tensor_and_back_keep_every_bit(name):
    t = torch.randn(4, 6, dtype=torch.float32).mul(3)
    t = t.to(getattr(torch, name)) if name != "bool" else t > 0
    a = as_array(t)
    assert str(a.dtype) == name and a.shape == (4, 6)
    back = to_torch(a)
    assert back.dtype == t.dtype and torch.equal(back.view(torch.uint8), t.contiguous().view(torch.uint8))
    assert to_torch(t) is t  # a tensor passes as it is


@pytest.mark.parametrize("name", ONE_BYTE)
def test_every_one_byte_float_converts_to_its_exact_value(name):
    """The table conversion of `as_float64` against ml_dtypes' own cast, all 256 bit patterns."""
    bits = np.arange(256, dtype=np.uint8)
    x = bits.view(dtype(name))
    got, want = as_float64(x), x.astype(np.float64)
    assert np.array_equal(got, want, equal_nan=True)
    assert not is_floating(np.dtype(np.int8)) and is_floating(x.dtype)


def test_bfloat16_and_float16_convert_exactly():
    for name in ("bfloat16", "float16"):
        bits = np.arange(1 << 16, dtype=np.uint16).view(dtype(name))
        with np.errstate(invalid="ignore"):  # signalling NaNs among the patterns
            want = bits.astype(np.float32).astype(np.float64)
        assert np.array_equal(as_float64(bits), want, equal_nan=True)


def test_dtype_names_are_the_stores():
    assert dtype("torch.bfloat16") == np.dtype(ml_dtypes.bfloat16) and dtype("float32") == np.float32
    assert dtype("float4_e2m1fn") is None and dtype("quint8") is None


def test_raw_equality_and_the_first_difference():
    a = np.array([0.0, 1.0, np.nan], dtype=np.float32)
    assert equal(a, a.copy()) and not equal(a, np.array([-0.0, 1.0, np.nan], dtype=np.float32))
    assert first_difference(np.array([[1, 2], [3, 4]]), np.array([[1, 2], [3, 5]])) == ([1, 1], 4, 5)
    assert first_difference(a[:2], a[:2].copy()) is None
    half = np.array([1.5], dtype=ml_dtypes.bfloat16)
    assert type(scalar(half[0])) is float and scalar(np.int64(3)) == 3


def _blas_threads() -> int:
    from threadpoolctl import threadpool_info

    return max(i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas")


def test_blas_runs_on_one_thread_inside_the_chunk_loops_and_is_restored():
    from threadpoolctl import threadpool_limits

    with threadpool_limits(2, user_api="blas"):
        assert _blas_threads() == 2
        seen = []
        with one_blas_thread():
            seen.append(_blas_threads())
            with one_blas_thread():  # nested: a lock and a counter
                seen.append(_blas_threads())
            seen.append(_blas_threads())
            other = threading.Thread(target=lambda: one_blas_thread().__enter__() or None)
            other.start()
            other.join()  # a thread that entered and never left keeps it at one
        assert seen == [1, 1, 1] and _blas_threads() == 1
        from ffdebug import _chunks

        _chunks.one_blas_thread().__exit__(None, None, None)  # the other thread's exit
        assert _blas_threads() == 2


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16", "float8_e4m3fn", "int64", "bool"])
def test_a_zero_dim_array_stays_zero_dim_on_the_torch_side(name):
    a = np.array(1, dtype=dtype(name)).reshape(())
    t = to_torch(a)
    assert t.shape == () and t.dtype == getattr(torch, name)
    assert to_torch(a[()].reshape(())).shape == ()


@pytest.mark.parametrize("name", ["float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_float64_rounds_to_a_narrow_float_as_torch_casts_it(name):
    # just off the midpoints of the narrow grid, within float32's half ulp: float32 rounds them
    # onto the midpoint, so torch's two roundings tie to even where one rounding would not
    low = getattr(torch, name)
    ints = torch.int16 if low.itemsize == 2 else torch.uint8
    g = np.random.default_rng(0)
    a = torch.tensor(np.abs(g.standard_normal(4096)), dtype=torch.float64).to(low)
    b = (a.view(ints) + 1).view(low)  # the next narrow float up
    ok = torch.isfinite(b.double())
    mid = (a.double()[ok] + b.double()[ok]) / 2
    x = (mid * (1 + torch.tensor(g.integers(-3, 4, mid.numel()), dtype=torch.float64) * 2.0**-40)).numpy()
    got, want = to_torch(round_to(x, dtype(name))), torch.from_numpy(x).to(low)
    assert torch.equal(got.view(ints), want.view(ints))
    once = x.astype(dtype(name)).view(np.int16 if low.itemsize == 2 else np.uint8)
    if name == "float16":  # numpy's own float16 rounds float64 once (ml_dtypes' go through float32)
        assert (once != got.view(ints).numpy()).any()  # the case this test is about occurs
