"""Every severity decision ffdebug makes, in one place (docs/comparing.md "Comparing", docs/architecture.md).

A stage's severity starts from the bands and is then adjusted by named rules, each applied by the
comparison in this order:

| rule              | function            | effect                                                      |
|-------------------|---------------------|-------------------------------------------------------------|
| bands             | `band`              | worse of the cos band and the rel band (table below)        |
| threshold         | `apply_threshold`   | a matching `--threshold GLOB:...` redefines the ok band     |
| element-wise      | `elementwise`       | elem >= 0.25: at least `diverge`; elem >= 1: `bug` (unless  |
|                   |                     | the matching threshold has elem / max_abs / atol terms);    |
|                   |                     | a low-precision side scales both by `elem_scale` (depth)    |
| zero side         | `zero_side`         | one side all zeros, the other not: `bug`                    |
| amplified         | `amplified_`        | a low-precision side meets another dtype, the stage inside  |
| precision         | `precision`         | the diverge band (rel <= 30%, cos > 0.9) and its error not  |
|                   |                     | a scale of the reference (cos(t - r, r) < 0.8): at most     |
|                   |                     | `drift` (elem and the diverge band cannot tell a bug there) |
| selection         | `selection`         | an integer stage inside a layer of a call whose             |
|                   |                     | low-precision side meets another dtype: at most `drift`     |
|                   |                     | (indices chosen from rounded scores: experts, top-k keys)   |
| range             | `below_range`       | a low-precision side meets another dtype where rms(ref) is  |
|                   |                     | below that dtype's smallest normal: at most `drift` (its    |
|                   |                     | values are subnormal or flushed to zero there: underflow)   |
| NaN / Inf         | `nonfinite`         | NaN or Inf at different positions: at least `bug`           |
| shape             | `shape_mismatch`    | shapes differ beyond size-1 dims: `bug` (never broadcast)   |
| statistics only   | `stats_only`        | compared on l2 / mean / std: the rel band (`bug` without)   |
| exact             | `exact`             | `--exact` and not bit-equal: at least `drift`               |
| noise             | `within_noise`      | error <= k x the noise run's: back to `ok` (below `bug`)    |
| beyond noise      | `noise_sensitive`   | error >= k x the noise run's (> 0): at least `diverge`      |
| exact prefix      | `exact_prefix_break`| noise run bit-identical: first inexact stage, `diverge`     |
|                   |                     | (the stage: `exact_prefix_end`, also bisect's signal), when |
|                   |                     | its error is above rounding (`above_rounding`: 16 ulps)     |
| judgement         | `judge`             | a bug signal (bisect) raises the verdict to `bug`; bisect's |
|                   |                     | `verdict` and `judgement` are that one grade                |

Bands (the worse of the two wins; rel is the more sensitive one, so a large-magnitude tensor with
cos 0.9998 and rel 57% is a bug):

| severity | cos band     | rel band  |
|----------|--------------|-----------|
| ok       | cos >= 0.9999| rel <= 1% |
| drift    | cos >= 0.99  | rel <= 10%|
| diverge  | cos >= 0.9   | rel <= 30%|
| bug      | cos > 0.5    | any       |
| scramble | cos <= 0.5   | any       |

Element-wise error (docs/comparing.md "Comparing"): elem = maxᵢ |tᵢ − rᵢ| / max(|rᵢ|, rms(r)), so one element
off by 50% is seen in a tensor whose norm hides it, while an element near zero is measured against
the tensor's scale, not its own (a near-zero sign flip is small).

Precision (calibrated on the zoo: docs/bisect.md, "Calibration"). Errors are measured in units of
the machine epsilon of a dtype (`MACHINE_EPS`, 2^-mantissa bits; an ulp of a value of magnitude 1):

| quantity                                   | precision alone (zoo, max)   | rule                        |
|--------------------------------------------|------------------------------|-----------------------------|
| first inexact stage after an exact prefix  | rel 0.91 eps (fp32, sdpa)    | a signal from 16 eps on     |
| elem of a low-precision side at depth d    | 5.8 eps x (d + 1)            | scaled from 16 eps x (d + 1)|
| error one block adds, low-precision side   | 1.1 eps of that dtype        | beyond precision from 4 eps |
| error one block adds, same dtype (fp32)    | 2.8 eps                      | beyond rounding from 16 eps |

`Severity` is a `str` Enum: its value is the JSON string, and it compares equal to it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from enum import Enum
from typing import Protocol, TypeVar

from ffdebug.errors import FFDebugError
from ffdebug.precision import (  # noqa: F401 - re-exported: verdict.X is where rules read them
    COHERENT,
    ELEM_ULPS,
    FP32_EPS,
    LOW_PRECISION,
    MACHINE_EPS,
    MIN_NORMAL,
    PRECISION_ULPS,
    ROUNDING_ULPS,
    above_rounding,
    call_dtypes,
    coarse_eps,
    coherence,
    machine_eps,
    mixed_low,
    precise_eps,
    scale_error,
)
from ffdebug.thresholds import Threshold, matching_threshold, parse_threshold  # noqa: F401


class Severity(str, Enum):
    """The five grades, mildest first; `rank` orders them."""

    OK = "ok"
    DRIFT = "drift"
    DIVERGE = "diverge"
    BUG = "bug"
    SCRAMBLE = "scramble"

    @property
    def rank(self) -> int:
        return _ORDER.index(self)

    def at_least(self, other: Severity | str) -> bool:
        """This grade is `other` or worse."""
        return self.rank >= Severity(other).rank

    def __str__(self) -> str:
        return self.value


_ORDER = tuple(Severity)
SEVERITIES = tuple(s.value for s in Severity)

COS_BANDS = ((0.9999, Severity.OK), (0.99, Severity.DRIFT), (0.9, Severity.DIVERGE))
REL_BANDS = ((0.01, Severity.OK), (0.10, Severity.DRIFT), (0.30, Severity.DIVERGE))


def amplified_precision(
    severity: Severity,
    cos: float | None,
    rel: float | None,
    norm_ratio: float | None,
    dtype_ref: str | None,
    dtype_target: str | None,
) -> str | None:
    """Amplified-precision rule's test: a low-precision side against another dtype, a stage above
    drift whose tensor stays inside the diverge band (rel <= 30%, cos > 0.9) and whose error is
    not a scale of the reference (coherence < `COHERENT`). Rounding a bf16 side is amplified by
    what the model does with it: near-tied router scores send a token to another expert, sharp
    attention turns a rounding of q or k into another weighting of the values, a sum that cancels
    loses its digits, and single elements end up off by their own size (the zoo, docs/bisect.md
    "Calibration": up to rel 25% and elem 2.9 in bf16 with nothing wrong). Such an error cannot be
    told from a bug's against a reference in another dtype: returns the note saying so (the
    stage is then at most drift), or None when the rule does not apply."""
    if not severity.at_least(Severity.DIVERGE) or severity.at_least(Severity.SCRAMBLE):
        return None
    low = [d for d in (dtype_ref, dtype_target) if (d or "").removeprefix("torch.") in LOW_PRECISION]
    if not low or dtype_ref == dtype_target or rel is None or rel > REL_BANDS[2][0]:
        return None
    if cos is None or cos <= COS_BANDS[2][0]:
        return None
    coh = coherence(cos, norm_ratio, rel)
    if coh is not None and abs(coh) >= COHERENT:
        return None
    return (
        f"within amplified precision: rel {rel:.3g}, and the error is not a scale of the signal "
        f"(cos(t - r, r) {coh if coh is not None else float('nan'):+.2f}); against a reference in another "
        f"dtype a {low[0].removeprefix('torch.')} side cannot be judged finer: dump the reference in "
        f"{low[0].removeprefix('torch.')} too, or give a noise run"
    )


def elem_scale(depth: int | None, *dtypes: str | None) -> float:
    """How much the element-wise rule's bounds widen for a stage `depth` blocks deep (0: the
    embedding; a stage after the last block: the block count + 1) when a side runs in a
    low-precision dtype: to `ELEM_ULPS` x its epsilon x (depth + 1) when that exceeds 0.25. One
    rounding of a bf16 element is up to 0.4% of it, and the largest element's error over a tensor
    grows with every block (the zoo: up to 5.8 eps x (depth + 1)), so a bf16 stage six blocks deep
    has single elements 25% off with nothing wrong. 1 for fp32 and wider."""
    if not any(d in LOW_PRECISION for d in dtypes):
        return 1.0
    return max(1.0, ELEM_ULPS * coarse_eps(*dtypes) * ((depth or 0) + 1) / ELEM_DIVERGE)


def worst(*severities: Severity | str) -> Severity:
    """The worst of the grades given (`ok` for none)."""
    return max((Severity(s) for s in severities), key=lambda s: s.rank, default=Severity.OK)


def at_least(severity: Severity | str, threshold: Severity | str) -> bool:
    """`severity` is `threshold` or worse."""
    return Severity(severity).at_least(threshold)


def parse_fail_on(value: Severity | str) -> Severity:
    """A `--fail-on` value: any grade but `ok` (one-line error otherwise)."""
    try:
        sev = Severity(value)
    except ValueError:
        sev = None
    if sev is None or sev is Severity.OK:
        raise FFDebugError(f"--fail-on {value!r} is invalid: use {', '.join(SEVERITIES[1:])}")
    return sev


def cos_band(cos: float) -> Severity:
    """The cos band: >= 0.9999 ok, >= 0.99 drift, >= 0.9 diverge, > 0.5 bug, else scramble."""
    for bound, sev in COS_BANDS:
        if cos >= bound:
            return sev
    return Severity.BUG if cos > 0.5 else Severity.SCRAMBLE


def rel_band(rel: float | None) -> Severity:
    """The rel band: <= 1% ok, <= 10% drift, <= 30% diverge, else bug (undefined rel: bug)."""
    if rel is None:
        return Severity.BUG
    for bound, sev in REL_BANDS:
        if rel <= bound:
            return sev
    return Severity.BUG


def band(cos: float | None, rel: float | None) -> Severity:
    """The worse of the cos band and the rel band; no number at all is a bug."""
    if cos is None and rel is None:
        return Severity.BUG
    return worst(cos_band(cos) if cos is not None else Severity.OK, rel_band(rel))


ELEM_DIVERGE = 0.25  # one element off by a quarter of its magnitude (or of the tensor's rms)
ELEM_BUG = 1.0  # one element off by its whole magnitude: a sign flip, a dropped or doubled term


def elementwise(severity: Severity, elem: float | None, scale: float = 1.0) -> Severity:
    """Element-wise rule: elem >= 0.25 x scale makes the stage at least diverge, elem >= 1 x scale
    at least bug (elem = maxᵢ |tᵢ − rᵢ| / max(|rᵢ|, rms(r)); None, nothing to measure, leaves the
    grade; `scale`: `elem_scale` of the stage's depth and dtypes)."""
    if elem is None:
        return severity
    if elem >= ELEM_BUG * scale:
        return worst(severity, Severity.BUG)
    if elem >= ELEM_DIVERGE * scale:
        return worst(severity, Severity.DIVERGE)
    return severity


def apply_threshold(
    base: Severity,
    cos: float | None,
    rel: float | None,
    key: str,
    thresholds: tuple[Threshold, ...],
    elem: float | None = None,
    max_abs: float | None = None,
) -> Severity:
    """Threshold rule: the first override whose glob matches `key` redefines the ok band: meeting
    its bounds is ok, missing them is at least drift. No match leaves `base`."""
    th = matching_threshold(key, thresholds)
    if th is None:
        return base
    return Severity.OK if th.passes(cos, rel, elem, max_abs) else worst(base, Severity.DRIFT)


def classify(
    cos: float | None,
    rel: float | None,
    key: str = "",
    thresholds: tuple[Threshold, ...] = (),
    elem: float | None = None,
    max_abs: float | None = None,
    elem_bound_scale: float = 1.0,
) -> Severity:
    """Bands, then the threshold rule, then the element-wise rule (unless the matching threshold
    bounds elements itself with `elem`, `max_abs` or `atol`) with its bounds x `elem_bound_scale`
    (`elem_scale`)."""
    severity = apply_threshold(band(cos, rel), cos, rel, key, thresholds, elem, max_abs)
    th = matching_threshold(key, thresholds)
    if th is not None and th.element_terms:
        return severity
    return elementwise(severity, elem, elem_bound_scale)


def zero_side(severity: Severity, ref_norm: float, target_norm: float, numel: int) -> Severity:
    """Zero-side rule: one side all zeros and the other not has no direction to compare (cos is
    set to 0), so it is not a scramble but a computation missing (or spurious) on one side: bug."""
    if numel and (ref_norm == 0.0) != (target_norm == 0.0):
        return Severity.BUG
    return severity


def below_range(ref_rms: float, dtype_ref: str | None, dtype_target: str | None) -> str | None:
    """Range rule's test: when the two sides differ in dtype and one is low-precision, the
    reference's rms below that dtype's smallest normal means its values are subnormal there
    (fewer mantissa bits) or flushed to zero by the kernels: the low-precision side cannot hold
    them, whatever the code does. Returns the note saying so, or None."""
    names = [(d or "").removeprefix("torch.") for d in (dtype_ref, dtype_target)]
    if names[0] == names[1]:
        return None
    low = [(MIN_NORMAL[d], d) for d in names if d in MIN_NORMAL]
    if not low or not ref_rms < max(low)[0]:
        return None
    tiny, name = max(low)
    return (
        f"underflow: the reference's rms {ref_rms:.3g} is below {name}'s smallest normal ({tiny:.3g}); "
        f"{name} cannot hold these values (subnormal or flushed to zero), so the difference is range, "
        "not a bug"
    )


def selection(severity: Severity, layer: int | None, integer: bool, call: tuple | None) -> str | None:
    """Selection rule's test: an integer stage inside a layer (expert ids, the key indices a sparse
    attention's indexer picks) of a call whose low-precision side meets another dtype: indices
    chosen from rounded scores differ where scores nearly tie, and what they select is judged by
    the floating stages they feed (`comparison.routing`). Returns the note, or None."""
    if not integer or layer is None or call is None or not severity.at_least(Severity.DIVERGE):
        return None
    return (
        "indices chosen from scores a low-precision side rounded: where scores nearly tie they differ "
        "with nothing wrong; the floating stages they feed judge them"
    )


def range_limited(severity: Severity) -> Severity:
    """Range rule: a stage `below_range` is at most drift (precision is never a bug)."""
    return Severity.DRIFT if severity.at_least(Severity.DRIFT) else severity


def nonfinite(severity: Severity, nan_mismatch: int, inf_mismatch: int) -> Severity:
    """NaN / Inf rule: non-finite values at different positions on the two sides: at least bug."""
    return worst(severity, Severity.BUG) if nan_mismatch or inf_mismatch else severity


def singleton_unifiable(ref_shape, target_shape) -> bool:
    """Shape rule's exception: shapes that differ only by size-1 dims (`[1, 1, 4, 8]` vs `[4, 8]`)
    hold the same elements in the same order, so they are unified (reshaped, never broadcast)."""
    if ref_shape is None or target_shape is None:
        return False
    return [d for d in ref_shape if d != 1] == [d for d in target_shape if d != 1]


def features_regrouped(ref_shape, target_shape) -> bool:
    """Shape rule's second exception: the same batch and token dims (the first two, both sides at
    least 3-D) holding each token's features grouped otherwise (`[B, S, 128]` against
    `[B, S, 8, 16]`: a q split into heads on one side only) hold the same elements in the same
    order; they are unified too. Any other difference stays a mismatch."""
    if ref_shape is None or target_shape is None:
        return False
    r, t = list(ref_shape), list(target_shape)
    if min(len(r), len(t)) < 3 or r[:2] != t[:2] or r == t:
        return False
    return math.prod(r[2:]) == math.prod(t[2:])


def shape_mismatch() -> Severity:
    """Shape rule: tensors of different shapes, beyond size-1 dims, are a bug (never truncated or
    broadcast)."""
    return Severity.BUG


def dtype_kind_mismatch() -> Severity:
    """Dtype-kind rule: a complex tensor against a real one is a bug (never compared: there is no
    elementwise pairing of a complex value with a real one)."""
    return Severity.BUG


def stats_only(rel: float | None) -> Severity:
    """Statistics rule: stats-only records are graded by the rel band of their l2 / mean / std
    (no cos exists); no statistics to compare is a bug."""
    return rel_band(rel)


def exact(severity: Severity, bit_equal: float | None) -> tuple[Severity, str | None]:
    """Exact rule (`--exact`): a stage that is not bit-identical is at least drift; its class is
    `numerical` when the bands say ok (a rounding-size difference, whatever its cause) and `divergent`
    otherwise. Returns the new grade and the class (None when bit-identical)."""
    if (bit_equal or 0.0) >= 1.0:
        return severity, None
    invariance = "numerical" if severity is Severity.OK else "divergent"
    return worst(severity, Severity.DRIFT), invariance


def noise_factor(*dtypes: str | None) -> float:
    """k of the noise rule: 3 when any side involved runs in a low-precision dtype (bf16 / fp16 /
    fp8), else 2 (fp32 and wider)."""
    return 3.0 if any(d in LOW_PRECISION for d in dtypes) else 2.0


def within_noise(rel: float | None, noise_rel: float | None, k: float) -> bool:
    """Noise rule's test: the target's error is no more than k x the noise run's at that stage."""
    return noise_rel is not None and rel is not None and rel <= k * noise_rel


def noise(severity: Severity, rel: float | None, noise_rel: float | None, k: float) -> Severity:
    """Noise rule: a stage below bug whose error is within k x the noise run's is ok."""
    if severity is not Severity.OK and severity.rank < Severity.BUG.rank and within_noise(rel, noise_rel, k):
        return Severity.OK
    return severity


def beyond_noise(rel: float | None, noise_rel: float | None, k: float) -> bool:
    """Beyond-noise test: the error is at least k x the noise run's, which is itself above zero (a
    noise run bit-identical to the reference gives no scale: the exact-prefix rule decides there)."""
    return (
        noise_rel is not None and noise_rel > 0.0 and rel is not None and rel > 0.0 and rel >= k * noise_rel
    )


def noise_sensitive(severity: Severity, rel: float | None, noise_rel: float | None, k: float) -> Severity:
    """Beyond-noise rule (`--noise`): a stage whose error is at least k x the noise run's is a bug
    signal even inside the ok band, so it is at least diverge."""
    return worst(severity, Severity.DIVERGE) if beyond_noise(rel, noise_rel, k) else severity


def exact_prefix_break(severity: Severity) -> Severity:
    """Exact-prefix rule with a bit-identical noise run (`--noise`): the first stage that is not
    bit-equal after bit-equal stages in the same dtype, where the noise run equals the reference bit
    for bit, differs by its own computation: at least diverge."""
    return worst(severity, Severity.DIVERGE)


class _Paired(Protocol):
    """What the exact-prefix rule reads of a paired stage (`ffdebug.results.StageResult`)."""

    @property
    def exact(self) -> bool: ...
    @property
    def same_dtype(self) -> bool: ...
    @property
    def folded(self) -> bool: ...

    rel: float | None
    dtype_ref: str | None
    dtype_target: str | None


_S = TypeVar("_S", bound=_Paired)


def exact_prefix_end(stages: Iterable[_S]) -> _S | None:
    """Exact-prefix rule (docs/bisect.md "Bisecting"): the first stage, in the order given (execution order
    of one call, or training order), that is not exactly equal (bit-equal, same dtype, graded ok)
    while every earlier one is, when it can carry the rule's signal: the same dtype on both sides,
    an error measured, and bits ffdebug did not fold itself from per-rank pieces (folded bits are not
    the engine's). Nothing upstream differs, so its own computation does: a bug signal however small
    its error, once it is above rounding (`above_rounding`: a difference of a few roundings is what
    another summation order gives). None when every stage is exact or the first one that is not
    cannot carry the signal.
    Callers add their own context: bisect leaves out a stage within the noise run's error, compare
    raises a stage where a noise run is bit-identical to the reference (`exact_prefix_break`)."""
    for e in stages:
        if e.exact:
            continue
        carries = e.same_dtype and e.rel is not None and not e.folded
        return e if carries and above_rounding(e.rel, e.dtype_ref, e.dtype_target) else None
    return None


def judge(verdict: Severity, signal: str | None) -> Severity:
    """Judgement rule (bisect): a bug signal (error above rounding after an exact prefix, beyond
    the noise run, beyond the precision of a low-precision side, or found local by attribution)
    makes the grade at least bug, however small the error. Bisect reports that one grade as both
    `verdict` and `judgement`: there is one rule, so the two never disagree."""
    return worst(verdict, Severity.BUG) if signal else verdict


class PatternName(str, Enum):
    """The pattern of a divergence over the layers (bisect; `ffdebug.bisection.pattern`): `match`
    (no layer introduces error beyond noise), `drift` (every layer's added error is within the
    precision of the dtypes: accumulated rounding, never a bug), `layer_class` (the layers beyond
    precision are of one class), `jump` (one layer adds far more than the rest), `undetermined`
    (error beyond precision that the layer budget cannot pin on a layer or a class: the reason
    names the layer after which it could not judge and the run that decides). `drift` shares its
    word with the severity `drift`; they are different things."""

    MATCH = "match"
    LAYER_CLASS = "layer_class"
    JUMP = "jump"
    DRIFT = "drift"
    UNDETERMINED = "undetermined"

    def __str__(self) -> str:
        return self.value


def is_ok(severity: Severity | str) -> bool:
    """The grade is ok."""
    return Severity(severity) is Severity.OK
