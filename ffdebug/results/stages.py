"""One paired stage (`StageResult`), a comparison (`CompareResult`) and the exit code every
covered verdict shares (`CoveredVerdict`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ffdebug import verdict as V
from ffdebug.coverage import Coverage
from ffdebug.verdict import Severity, worst


@dataclass(frozen=True)
class TensorMeta:
    """One side's tensor as the manifest describes it."""

    dtype: str | None
    shape: list[int] | None


METRIC_FIELDS = (
    "cos",
    "rel",
    "rel_diff",
    "max_abs",
    "max_abs_at",
    "elem",
    "mean_abs",
    "norm_ratio",
    "bit_equal",
)


@dataclass
class StageResult:
    """One paired stage of one call: identity, metrics and severity (with the reasons)."""

    key: str
    layer: int | None
    layer_class: str | None
    stage: str
    io: str | None
    call: int | None
    invocation: Any  # int, or "N#k" for the k-th repeat of a free tap in one call
    rank: int
    step: dict
    phase: str | None
    ref: TensorMeta
    target: TensorMeta
    cos: float | None = None
    rel: float | None = None
    rel_diff: float | None = None
    max_abs: float | None = None
    max_abs_at: list[int] | None = None
    elem: float | None = None  # maxᵢ |tᵢ − rᵢ| / max(|rᵢ|, rms(r))
    mean_abs: float | None = None
    norm_ratio: float | None = None
    bit_equal: float | None = None
    severity: Severity = Severity.OK
    notes: list[str] = field(default_factory=list)
    finding: str | None = None  # shape_mismatch | dtype_kind | shard_reading
    stats_only: bool = False
    nan_mismatch: int | None = None
    inf_mismatch: int | None = None
    invariance: str | None = None  # --exact: numerical | divergent
    logits: dict | None = None
    noise_given: bool = False  # a noise run was given (noise_rel is then reported, maybe null)
    noise_rel: float | None = None
    within_noise: bool | None = None
    near_zero: bool = False  # judged by the absolute tolerance of a declared scale (compare.near_zero)
    beyond_noise: bool | None = None  # --noise: error >= k x the noise run's (or an exact-prefix break)
    unified_shape: bool = False  # the shapes differed by size-1 dims only and were unified
    max_abs_where: dict | None = None  # max_abs_at named by the stage's axes (batch, token, head, channel)
    per_token_rel: list | None = None  # rel per token position (layer stages)
    token_runs: list | None = None  # exact / within / wrong runs per sequence (comparison/token_runs.py)
    token_runs_left_out: int | None = None  # runs past the cap
    per_head_rel: list | None = None  # rel per head ([batch, token, head, head_dim] attention stages)
    rise_from: int | None = None  # the token from which the error rises, when it does
    unsharded_ref: dict | None = None  # {"how", "ranks"}: ffdebug folded this side's ranks
    unsharded_target: dict | None = None
    severity_rank0: Severity | None = None  # before a shard reading explained the ranks
    per_rank: bool = False  # one of several target ranks, each compared with the reference
    call_dtypes: tuple | None = (
        None  # (ref, target): the call's dtypes, when a low-precision side meets another
    )
    range_limited: bool = False  # the reference's values are below a low-precision side's range (underflow)
    flipped_tokens: list[int] | None = None  # token rows left out: they took another expert (routing)
    seq: int | None = None  # the reference record's capture sequence number (training order; not in the JSON)

    @property
    def ok(self) -> bool:
        return self.severity is Severity.OK

    @property
    def dtype_ref(self) -> str | None:
        return self.ref.dtype

    @property
    def dtype_target(self) -> str | None:
        return self.target.dtype

    @property
    def judged_dtypes(self) -> tuple:
        """The dtypes the precision rules judge this stage by: its own, or, when its two sides share
        one dtype inside a call where a low-precision side meets another (the fp32 router of a bf16
        model against an fp32 one), the call's: what it is computed from was rounded there."""
        if self.call_dtypes is not None and not V.mixed_low(self.ref.dtype, self.target.dtype):
            return self.call_dtypes
        return (self.ref.dtype, self.target.dtype)

    @property
    def same_dtype(self) -> bool:
        return self.ref.dtype == self.target.dtype

    @property
    def exact(self) -> bool:
        """Bit-equal, of the same dtype on both sides, and graded ok."""
        return self.bit_equal == 1.0 and self.same_dtype and self.severity is Severity.OK

    @property
    def noise_measured(self) -> bool:
        """A noise run was given and its error at this stage measured (`noise_rel` set); a noise run
        without a comparable record here leaves the stage judged without it (a "noise not
        comparable" note says so)."""
        return self.noise_given and self.noise_rel is not None

    @property
    def folded(self) -> bool:
        """ffdebug assembled this stage from per-rank pieces (folded by compare, or explained by a
        shard reading in bisect): its bits are not the engine's."""
        return bool(self.unsharded_ref or self.unsharded_target or self.finding == "shard_reading")

    def summary(self, *names: str) -> dict:
        """A few fields, for `first_divergence` / `sub_stage` style JSON."""
        return {n: (self.severity.value if n == "severity" else getattr(self, n)) for n in names}

    def to_json(self) -> dict:
        out: dict = {
            "key": self.key,
            "layer": self.layer,
            "layer_class": self.layer_class,
            "stage": self.stage,
            "io": self.io,
            "call": self.call,
            "invocation": self.invocation,
            "rank": self.rank,
            "step": self.step,
            "phase": self.phase,
            "dtype_ref": self.ref.dtype,
            "dtype_target": self.target.dtype,
            "shape_ref": self.ref.shape,
            "shape_target": self.target.shape,
        }
        for name in METRIC_FIELDS:
            out[name] = getattr(self, name)
        out["severity"] = self.severity.value
        out["notes"] = list(self.notes)
        optional = {
            "finding": self.finding,
            "stats_only": self.stats_only or None,
            "nan_mismatch": self.nan_mismatch if self.nan_mismatch or self.inf_mismatch else None,
            "inf_mismatch": self.inf_mismatch if self.nan_mismatch or self.inf_mismatch else None,
            "invariance": self.invariance,
            "logits": self.logits,
            "unsharded_ref": self.unsharded_ref,
            "unsharded_target": self.unsharded_target,
            "within_noise": self.within_noise,
            "beyond_noise": self.beyond_noise,
            "unified_shape": self.unified_shape or None,
            "max_abs_where": self.max_abs_where,
            "per_token_rel": self.per_token_rel,
            "token_runs": self.token_runs,
            "token_runs_left_out": self.token_runs_left_out or None,
            "per_head_rel": self.per_head_rel,
            "rise_from": self.rise_from,
            "severity_rank0": self.severity_rank0.value if self.severity_rank0 else None,
            "flipped_tokens": self.flipped_tokens,
        }
        out.update({k: v for k, v in optional.items() if v is not None})
        if self.noise_given:
            out["noise_rel"] = self.noise_rel
        return out


class CoveredVerdict:
    """What compare, bisect and slot-invariance results share: `failed()` (defined by each), the
    coverage and the exit code. Truthy when the exit code is 0."""

    coverage: Coverage
    allow_partial: bool

    def failed(self) -> bool:
        raise NotImplementedError

    @property
    def complete(self) -> bool:
        return self.coverage.complete

    def exit_code(self) -> int:
        """1 failed (at or above fail-on); else 4 when something was left out (0 with
        `allow_partial`); else 0."""
        return exit_code(self.failed(), self.coverage, self.allow_partial)

    def __bool__(self) -> bool:
        return self.exit_code() == 0


@dataclass(frozen=True)
class CallRef:
    """A paired call: its index within the step tags, the tags, and the target rank when each
    target rank was compared with a single-rank reference on its own."""

    call: int | None
    step: dict
    rank: int | None = None

    def to_json(self) -> dict:
        out = {"call": self.call, "step": dict(self.step)}
        if self.rank is not None:
            out["rank"] = self.rank
        return out


@dataclass(frozen=True)
class GenerationDivergence:
    """Token ids equal at the first call of a generation and different at call `call`: a decode
    step chose another token. The calls before it are compared; the result fails."""

    call: int
    step: dict
    key: str  # the token-id stage that differs (embed.input_ids, embed.decoder_input_ids)
    position: list | None  # None when the shapes differ
    ref: int | float | None
    target: int | float | None

    def sentence(self) -> str:
        if self.position is None:
            return f"generation diverged at call {self.call} ({self.key}: the shapes differ)"
        return f"generation diverged at call {self.call} (position {self.position}: ref {self.ref} vs target {self.target})"

    def covers(self, group) -> bool:
        """A call group at or after this call, in the same step tags."""
        return (
            dict(group.tags) == {str(k): str(v) for k, v in self.step.items()}
            and (group.call or 0) >= self.call
        )

    def to_json(self) -> dict:
        return {
            "call": self.call,
            "step": dict(self.step),
            "key": self.key,
            "position": self.position,
            "ref": self.ref,
            "target": self.target,
        }


@dataclass
class CompareResult(CoveredVerdict):
    """Per-stage comparison of two sides. Truthy when no stage is at or above `fail_on`."""

    verdict: Severity
    stages: list[StageResult]
    ref_path: str
    target_path: str
    fail_on: Severity = Severity.DIVERGE
    only_ref: list[str] = field(default_factory=list)
    only_target: list[str] = field(default_factory=list)
    warmup_skipped: int = 0
    unpaired_ref: list[CallRef] = field(default_factory=list)
    unpaired_target: list[CallRef] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stats_only: bool = False
    records: list = field(default_factory=list, repr=False)  # (ref, target) Record per stage
    shards: list[dict] = field(default_factory=list)  # multi-rank readings (declared or inferred)
    coverage: Coverage = field(default_factory=Coverage)
    allow_partial: bool = False
    generation: GenerationDivergence | None = None  # token ids that differ after the first call

    @property
    def first_divergence(self) -> StageResult | None:
        return next((s for s in self.stages if not s.ok), None)

    @property
    def first_non_invariant(self) -> StageResult | None:
        """With `exact`: the first stage that is not bit-identical (its `invariance` class says
        `numerical` inside the ok band, `divergent` outside it)."""
        return next((s for s in self.stages if s.invariance), None)

    def first_at_or_above(self, severity: Severity | str) -> StageResult | None:
        return next((s for s in self.stages if s.severity.at_least(severity)), None)

    def failed(self, fail_on: Severity | str | None = None) -> bool:
        return fails(self.generation, self.first_at_or_above(fail_on or self.fail_on) is not None)

    def to_json(self) -> dict:
        out = self._to_json()
        if self.generation is not None:
            out["generation_diverged"] = self.generation.to_json()
        return out

    def _to_json(self) -> dict:
        first, first_ni = self.first_divergence, self.first_non_invariant
        return {
            "verdict": self.verdict.value,
            "stages": [s.to_json() for s in self.stages],
            "first_divergence": first.to_json() if first else None,
            "first_non_invariant": first_ni.to_json() if first_ni else None,
            "ref": self.ref_path,
            "target": self.target_path,
            "only_ref": self.only_ref,
            "only_target": self.only_target,
            "warmup_skipped": self.warmup_skipped,
            "unpaired_calls": {
                "ref": [c.to_json() for c in self.unpaired_ref],
                "target": [c.to_json() for c in self.unpaired_target],
            },
            "notes": self.notes,
            "stats_only": self.stats_only,
            "fail_on": self.fail_on.value,
            "passed": self.exit_code() == 0,
            "complete": self.complete,
            "coverage": self.coverage.to_json(),
            "allow_partial": self.allow_partial,
            "shards": self.shards,
        }


def fails(generation: GenerationDivergence | None, judged_failed: bool) -> bool:
    """The rule compare and bisect share: a generation that diverged after its first call fails the
    run whatever the calls before it show (their bands judge only those calls)."""
    return generation is not None or judged_failed


def exit_code(failed: bool, coverage: Coverage, allow_partial: bool) -> int:
    """The exit code of a verdict: 1 failed; 4 incomplete (0 with `allow_partial`); 0."""
    if failed:
        return 1
    if not coverage.complete and not allow_partial:
        return 4
    return 0


def worst_of(stages: list[StageResult]) -> Severity:
    """The worst severity among stages (`ok` for none)."""
    return worst(*(s.severity for s in stages))
