"""The finding of one weight tensor pair (docs/weights-diff.md "Weights first", `finding`).

The rules are tried in this order; the first that holds names the pair:

| finding      | rule (first match wins)                                              | severity      |
|--------------|----------------------------------------------------------------------|---------------|
| `equal`      | same dtype, same bytes (or same values: −0.0, NaN payloads)          | ok            |
| `dtype_only` | dtypes differ; the finer side cast to the coarser dtype is bit-equal | ok            |
| `rounding`   | every element within one ulp of the coarser (stored) dtype           | ok; fp8: bands |
| `sign_flip`  | cos ≈ −1: the negated tensor                                         | bands         |
| `transposed` | a square tensor equal to the other side transposed                   | bands         |
| `scaled`     | cos ≈ 1 but the norms differ: a constant factor (`scale_factor`)     | bands         |
| `rounding`   | same dtype, within one ulp of bf16 / fp16 (a round trip through it)  | ≥ drift       |
| `mismatch`   | anything else; same dtype: the loader changed the values             | bands; same dtype: ≥ bug |

Before the rules: a complex tensor against a real one is `dtype_kind` (bug), never measured: there
is no elementwise pairing of a complex value with a real one (`compare_pair`).

"bands" = `classify(cos, rel)` of the comparison as loaded (docs/comparing.md "Comparing"), with --threshold
overrides; `sign_flip`, `transposed` and `scaled` are looked for only where the bands are not ok.
A tensor stored with its two dims swapped is compared after `.T` and is at least scramble
(`transposed` when the values then match). Same dtype on both sides and not dequantized: a
difference beyond one ulp is never `ok` (a few embedding rows left at their initialisation change
the norm of a large table by 0.1%).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

from ffdebug import verdict as V
from ffdebug.arrays import as_array, as_float32, is_complex, is_floating
from ffdebug.comparison.metrics import compare_tensors
from ffdebug.results import TensorDiff
from ffdebug.verdict import Severity
from ffdebug.weights import quant
from ffdebug.weights.numerics import abs_max, bytes_equal, coarsest_ulp, equal_after_cast, within_rounding

FINDINGS = (
    "equal",
    "rounding",
    "dtype_only",
    "transposed",
    "sign_flip",
    "scaled",
    "swapped",
    "permuted",
    "not_loaded",
    "mismatch",
    "dtype_kind",
)
LOADED = ("equal", "dtype_only", "rounding")


@dataclass(frozen=True)
class Pair:
    """What the rules read: the two tensors as loaded, their stored dtypes and the metrics."""

    ref: object
    tgt: object
    dtype_ref: str
    dtype_tgt: str
    dequantized: bool
    metrics: object  # compare.metrics.TensorMetrics
    bands: Severity  # classify(cos, rel) with the --threshold overrides
    eps: float | None  # the coarser dtype's unit roundoff (None: an exact dtype)

    @property
    def same_dtype(self) -> bool:
        return self.dtype_ref == self.dtype_tgt

    @property
    def both_float(self) -> bool:
        return is_floating(self.ref.dtype) and is_floating(self.tgt.dtype)

    @property
    def correlated_failure(self) -> bool:
        """The bands fail but there is a cos to explain: where sign / layout / scale are looked for."""
        return self.metrics.cos is not None and not V.is_ok(self.bands)

    @cached_property
    def ref_absmax(self) -> float:
        """max |ref|, measured once for the rounding tests of the reference (and of −ref)."""
        return abs_max(self.ref)

    @property
    def ref_bound(self) -> float | None:
        """An upper bound of max |ref| known without a pass: ‖ref‖₂ (widened by a relative 1e-9
        against its float64 rounding); None where non-finite values left positions out of it."""
        m = self.metrics
        if m.nan_mismatch or m.inf_mismatch or m.nan_both or not math.isfinite(m.ref_norm):
            return None
        return m.ref_norm * (1 + 1e-9)

    def absmax(self) -> float:
        """max |ref| (measured once, when a rounding test needs it)."""
        return self.ref_absmax

    @property
    def factor(self) -> float:
        """Least-squares factor c of t ≈ c·r."""
        m = self.metrics
        return m.cos * m.norm_ratio if m.norm_ratio else 0.0


@dataclass
class Found:
    """A rule's answer: the finding, its severity and what it adds to the entry."""

    finding: str
    severity: Severity
    after_transpose: dict | None = None
    scale_factor: float | None = None
    notes: list[str] = field(default_factory=list)


def _equal_values(p: Pair) -> Found | None:
    """Equal values, other bits: −0.0 vs 0.0, NaN payloads, or an integer / exact dtype change."""
    m = p.metrics
    if m.max_abs == 0.0 and not (m.nan_mismatch or m.inf_mismatch) and not p.dequantized:
        return Found("equal" if p.same_dtype else "dtype_only", Severity.OK)
    return None


def _cast_equal(p: Pair) -> Found | None:
    if p.same_dtype or p.dequantized or p.eps is None or not p.both_float:
        return None
    fine, coarse = (p.ref, p.tgt) if quant.ulp(p.dtype_ref) < quant.ulp(p.dtype_tgt) else (p.tgt, p.ref)
    return Found("dtype_only", Severity.OK) if equal_after_cast(fine, coarse) else None


def _rounding(p: Pair) -> Found | None:
    if p.eps is None or not within_rounding(p.ref, p.tgt, p.eps, p.absmax, p.ref_bound):
        return None
    fp8 = quant.is_fp8(p.dtype_ref) or quant.is_fp8(p.dtype_tgt)
    return Found("rounding", p.bands if fp8 else Severity.OK)


def _sign_flip(p: Pair) -> Found | None:
    """cos ≈ −1; with fp8 on one side "≈" means within its rounding."""
    import numpy as np

    if not p.correlated_failure:
        return None
    cos = p.metrics.cos
    if cos <= -0.9999 or (
        p.eps is not None
        and cos < -0.99
        and within_rounding(np.negative(p.ref), p.tgt, p.eps, p.absmax, p.ref_bound)
    ):
        return Found("sign_flip", p.bands)
    return None


def _square_transposed(p: Pair) -> Found | None:
    r = p.ref
    if not p.correlated_failure or r.ndim != 2 or r.shape[0] != r.shape[1] or r.shape[0] <= 1:
        return None
    mt = compare_tensors(p.ref, p.tgt.T)
    if not V.is_ok(V.classify(mt.cos, mt.rel)):
        return None
    return Found("transposed", p.bands, after_transpose={"cos": mt.cos, "rel": mt.rel, "max_abs": mt.max_abs})


def _scaled(p: Pair) -> Found | None:
    """t ≈ c·r with c ≠ 1; with fp8 on one side "≈" means within its rounding."""
    c, cos = p.factor, p.metrics.cos
    if not p.correlated_failure or c <= 0 or abs(c - 1) <= 1e-3:
        return None
    if cos >= 0.9999 or (
        p.eps is not None
        and cos > 0.99
        and within_rounding(_times(p.ref, c), p.tgt, p.eps, bound=_scaled_bound(p.ref_bound, c))
    ):
        return Found("scaled", p.bands, scale_factor=c)
    return None


def _scaled_bound(bound: float | None, c: float) -> float | None:
    """An upper bound of max |c·r| as `_times` rounds it in r's dtype (at most 2⁻³ relative more,
    float8 e5m2's unit roundoff)."""
    return None if bound is None else bound * abs(c) * 1.25


def _times(x, c: float):
    """`x · c` in x's dtype: float64 and float32 multiply by c rounded to their dtype; the
    narrower floats in float32, rounded back once (a low-precision tensor times a Python float)."""
    import numpy as np

    if str(x.dtype) in ("float64", "float32"):
        return x * x.dtype.type(c)
    return (as_float32(x) * np.float32(c)).astype(x.dtype)


def _same_dtype_change(p: Pair) -> Found | None:
    """A same-dtype pair that differs beyond one ulp. Values within one ulp of a coarser float
    went through it on the way (a bf16 round trip): `rounding`, at least drift. Anything else the
    loader changed, however small the error looks (a few rows left at their initialisation hide in
    a large tensor's norm): at least a bug."""
    if not p.same_dtype or p.dequantized or not is_floating(p.ref.dtype):
        return None
    for coarse in ("float16", "bfloat16"):
        eps = quant.ulp(coarse)
        if quant.ulp(p.dtype_ref) < eps and within_rounding(p.ref, p.tgt, eps, p.absmax, p.ref_bound):
            note = f"same dtype, but the target's values were rounded through {coarse}"
            return Found("rounding", V.worst(p.bands, Severity.DRIFT), notes=[note])
    note = "same dtype, values differ beyond rounding: the loader changed them"
    return Found("mismatch", V.worst(p.bands, Severity.BUG), notes=[note])


RULES: tuple[Callable[[Pair], Found | None], ...] = (
    _equal_values,
    _cast_equal,
    _rounding,
    _sign_flip,
    _square_transposed,
    _scaled,
    _same_dtype_change,
)


def find(p: Pair) -> Found:
    """The first rule that holds, else `mismatch` at the bands."""
    for rule in RULES:
        found = rule(p)
        if found is not None:
            return found
    return Found("mismatch", p.bands)


def compare_pair(
    name: str,
    ref,
    tgt,
    dtype_ref: str,
    dtype_tgt: str,
    thresholds: tuple = (),
    dequantized: bool = False,
) -> TensorDiff | None:
    """One entry of `tensors` (numpy arrays, or torch tensors viewed as them); None when the shapes
    differ and are not a transpose of each other."""
    ref, tgt = as_array(ref), as_array(tgt)
    if tuple(ref.shape) != tuple(tgt.shape):
        if ref.ndim == 2 and tgt.ndim == 2 and tuple(tgt.shape) == tuple(ref.shape)[::-1]:
            return _stored_transposed(name, ref, tgt, dtype_ref, dtype_tgt, thresholds, dequantized)
        return None
    entry = TensorDiff(
        name=name,
        shape_ref=list(ref.shape),
        shape_target=list(tgt.shape),
        dtype_ref=dtype_ref,
        dtype_target=dtype_tgt,
    )
    if is_complex(ref.dtype) != is_complex(tgt.dtype):
        entry.finding, entry.severity = "dtype_kind", Severity.BUG
        entry.notes = [
            f"dtype kinds differ: {dtype_ref} (ref) vs {dtype_tgt} (target), one complex and one real; "
            "not compared (store both as complex or both as real)"
        ]
        return entry
    if not dequantized and bytes_equal(ref, tgt):
        entry.byte_equal, entry.cos, entry.rel, entry.max_abs = True, 1.0, 0.0, 0.0
        return entry
    m = compare_tensors(ref, tgt)
    entry.measured = True
    entry.cos, entry.rel, entry.max_abs, entry.rel_diff = m.cos, m.rel, m.max_abs, m.rel_diff
    entry.norm_ratio, entry.max_abs_at, entry.bit_equal = m.norm_ratio, m.max_abs_at, m.bit_equal
    bands = V.classify(m.cos, m.rel, name, thresholds)
    found = find(
        Pair(ref, tgt, dtype_ref, dtype_tgt, dequantized, m, bands, coarsest_ulp(dtype_ref, dtype_tgt))
    )
    entry.finding, entry.severity = found.finding, found.severity
    entry.notes = list(m.notes) + found.notes
    if found.after_transpose is not None:
        entry.after_transpose = found.after_transpose
    if found.scale_factor is not None:
        entry.scale_factor = found.scale_factor
    return entry


def _stored_transposed(name, ref, tgt, dtype_ref, dtype_tgt, thresholds, dequantized) -> TensorDiff:
    """The two dims swapped: never left out, compared after .T (a transposed and scaled tensor is
    `scaled`), and at least scramble."""
    import numpy as np

    after = compare_pair(
        name, ref, np.ascontiguousarray(tgt.T), dtype_ref, dtype_tgt, thresholds, dequantized
    )
    after.shape_target = list(tgt.shape)
    after.after_transpose = {"cos": after.cos, "rel": after.rel, "max_abs": after.max_abs}
    if after.finding in LOADED:
        after.finding = "transposed"
        after.notes = ["stored transposed: the shapes are swapped and the values match after .T"]
    else:
        after.notes.insert(0, "stored transposed (the shapes are swapped); compared after .T")
    after.severity = V.worst(after.severity, Severity.SCRAMBLE)
    return after
