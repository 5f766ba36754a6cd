"""What rounding in a dtype can do, in numbers, as dumps spell dtypes (no torch needed): machine
epsilons, the smallest normals, the ulp allowances the verdict rules use (calibrated on the zoo,
docs/bisect.md "Calibration"), and the part of an error that is a scale of the signal.

`ffdebug.verdict` re-exports every name here; its rules turn these numbers into grades.
"""

from __future__ import annotations

LOW_PRECISION = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


# Machine epsilon (2^-mantissa bits) by dtype name, as dumps spell dtypes (no torch needed).
MACHINE_EPS = {
    "float64": 2.0**-52,
    "complex128": 2.0**-52,
    "float32": 2.0**-23,
    "complex64": 2.0**-23,
    "bfloat16": 2.0**-7,
    "float16": 2.0**-10,
    "float8_e4m3fn": 2.0**-3,
    "float8_e4m3fnuz": 2.0**-3,
    "float8_e5m2": 2.0**-2,
    "float8_e5m2fnuz": 2.0**-2,
}
FP32_EPS = MACHINE_EPS["float32"]

# The smallest normal number of the low-precision dtypes (below it a value keeps fewer mantissa
# bits, and CPU kernels flush it to zero).
MIN_NORMAL = {
    "bfloat16": 2.0**-126,
    "float16": 2.0**-14,
    "float8_e4m3fn": 2.0**-6,
    "float8_e4m3fnuz": 2.0**-7,
    "float8_e5m2": 2.0**-14,
    "float8_e5m2fnuz": 2.0**-15,
}

ROUNDING_ULPS = 16.0  # an error below this many eps of the stage's dtype can be one rounding
PRECISION_ULPS = 4.0  # one block of a low-precision side adds up to this many eps of its dtype
ELEM_ULPS = 16.0  # a low-precision side's elem grows by up to this many eps per block of depth


def mixed_low(dtype_ref: str | None, dtype_target: str | None) -> bool:
    """The two sides differ in dtype and one of them is low-precision (bf16 against fp32)."""
    a, b = ((d or "").removeprefix("torch.") for d in (dtype_ref, dtype_target))
    return a != b and (a in LOW_PRECISION or b in LOW_PRECISION)


def call_dtypes(pairs) -> tuple | None:
    """The dtypes of a call whose low-precision side meets another dtype: from the (ref, target)
    dtype pairs of its floating stages, the least precise on each side; None when no stage of the
    call pairs a low-precision dtype with another."""
    mixed = [(a, b) for a, b in pairs if mixed_low(a, b)]
    if not mixed:
        return None
    side = lambda ds: max(ds, key=lambda d: machine_eps(d) or 0.0)  # noqa: E731
    return side([a for a, _ in mixed]), side([b for _, b in mixed])


def machine_eps(dtype: str | None) -> float | None:
    """The machine epsilon of a floating dtype named as dumps name it (`torch.` prefix or not);
    None for others."""
    return MACHINE_EPS.get((dtype or "").removeprefix("torch."))


def precise_eps(*dtypes: str | None) -> float:
    """The epsilon of the most precise floating dtype given (fp32 when none is known)."""
    known = [e for e in map(machine_eps, dtypes) if e is not None]
    return min(known) if known else FP32_EPS


def coarse_eps(*dtypes: str | None) -> float:
    """The epsilon of the least precise floating dtype given (fp32 when none is known)."""
    known = [e for e in map(machine_eps, dtypes) if e is not None]
    return max(known) if known else FP32_EPS


def above_rounding(rel: float | None, *dtypes: str | None) -> bool:
    """The error is more than a few roundings: rel >= `ROUNDING_ULPS` x the epsilon of the most
    precise dtype given (fp32 and wider: long sums in another order stay within it; the zoo's
    eager against sdpa differs by at most 1.08 eps at the first inexact stage), or
    `PRECISION_ULPS` x it when that dtype is a low-precision one (its results are rounded once
    from a wider accumulator, so another order moves them by about one rounding). Below that, a
    difference after a bit-equal prefix is no evidence of a computation of its own."""
    if rel is None:
        return False
    eps = precise_eps(*dtypes)  # coarser than fp32's only when every known dtype is low-precision
    return rel >= (PRECISION_ULPS if eps > FP32_EPS else ROUNDING_ULPS) * eps


COHERENT = 0.8  # an error this aligned with the reference (cos(t - r, r)) is a scale of the signal


def scale_error(cos: float | None, norm_ratio: float | None) -> float | None:
    """The part of the error along the reference, as a share of it: <t - r, r> / |r|^2 =
    cos x |t|/|r| - 1 (q scaled by 1.1: +0.1; a head of four zeroed: -1/4). Rounding errors are
    zero-mean and uncorrelated with the values rounded, so precision alone leaves it near zero."""
    if cos is None or norm_ratio is None:
        return None
    return cos * norm_ratio - 1.0


def coherence(cos: float | None, norm_ratio: float | None, rel: float | None) -> float | None:
    """cos(t - r, r): how much of the error is a scale of the reference (1: all of it)."""
    alpha = scale_error(cos, norm_ratio)
    if alpha is None or not rel:
        return None
    return alpha / rel
