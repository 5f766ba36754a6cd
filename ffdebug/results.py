"""Typed results passed from the analysis (compare, bisect) to the reports (docs/architecture.md).

A `StageResult` is one paired stage: where it sits (key, layer, call, rank, step tags), what the two
tensors were (`TensorMeta`), the float64 metrics, the severity the verdict rules gave it
(`ffdebug.verdict`), and why. `CompareResult` and `BisectResult` are built from them; JSON exists
only at the boundary (`to_json`), with the keys the README documents. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ffdebug.coverage import Coverage
from ffdebug.verdict import PatternName, Severity, at_least, worst


@dataclass(frozen=True)
class TensorMeta:
    """One side's tensor as the manifest describes it."""

    dtype: str | None
    shape: list[int] | None


METRIC_FIELDS = ("cos", "rel", "rel_diff", "max_abs", "max_abs_at", "mean_abs", "norm_ratio", "bit_equal")


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
    mean_abs: float | None = None
    norm_ratio: float | None = None
    bit_equal: float | None = None
    severity: Severity = Severity.OK
    notes: list[str] = field(default_factory=list)
    finding: str | None = None  # shape_mismatch | shard_reading
    stats_only: bool = False
    nan_mismatch: int | None = None
    inf_mismatch: int | None = None
    invariance: str | None = None  # --exact: numerical | divergent
    logits: dict | None = None
    noise_given: bool = False  # a noise run was given (noise_rel is then reported, maybe null)
    noise_rel: float | None = None
    within_noise: bool | None = None
    unsharded_ref: dict | None = None  # {"how", "ranks"}: ffdebug folded this side's ranks
    unsharded_target: dict | None = None
    severity_rank0: Severity | None = None  # before a shard reading explained the ranks
    per_rank: bool = False  # one of several target ranks, each compared with the reference

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
    def same_dtype(self) -> bool:
        return self.ref.dtype == self.target.dtype

    @property
    def exact(self) -> bool:
        """Bit-equal, of the same dtype on both sides, and graded ok."""
        return self.bit_equal == 1.0 and self.same_dtype and self.severity is Severity.OK

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
            "severity_rank0": self.severity_rank0.value if self.severity_rank0 else None,
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
        return self.first_at_or_above(fail_on or self.fail_on) is not None

    def to_json(self) -> dict:
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


def exit_code(failed: bool, coverage: Coverage, allow_partial: bool) -> int:
    """The exit code of a verdict: 1 failed; 4 incomplete (0 with `allow_partial`); 0."""
    if failed:
        return 1
    if not coverage.complete and not allow_partial:
        return 4
    return 0


@dataclass
class LayerRow:
    """One layer's error budget (bisect): rel in / out of the block, the error it adds."""

    layer: int
    layer_class: str | None
    rel_in: float | None = None
    rel_out: float | None = None
    cos_in: float | None = None
    cos_out: float | None = None
    added: float | None = None
    severity: Severity = Severity.OK  # of hidden_out (bands, after noise)
    exact_in: bool = False  # hidden_in (or embed.out) dumped, bit-equal, same dtype on both sides
    exact_out: bool = False
    noise_added: float | None = None
    noise_rel_out: float | None = None
    local: str | None = None  # attribution verdict: "local" | "inherited" | None (not run)
    introduces: bool = False
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        out = asdict(self)
        out["severity"] = self.severity.value
        return out


@dataclass
class ClassSummary:
    """Per layer class: its layers, the first bad layer, the layers introducing error."""

    layer_class: str
    layers: list[int] = field(default_factory=list)
    first_bad_layer: int | None = None
    first_over_threshold: int | None = None
    introducing: list[int] = field(default_factory=list)
    max_added: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CallSummary:
    """One paired call's pattern and worst severity (bisect's `calls`)."""

    call: CallRef
    pattern: PatternName
    verdict: Severity

    def to_json(self) -> dict:
        return {**self.call.to_json(), "pattern": self.pattern.value, "verdict": self.verdict.value}


FIRST_DIVERGENCE_FIELDS = ("layer", "layer_class", "stage", "key", "severity", "cos", "rel")
SUB_STAGE_FIELDS = ("stage", "key", "severity", "cos", "rel")


@dataclass
class BisectResult(CoveredVerdict):
    """Where the target first parts from the reference. Truthy when the judgement is below
    `fail_on`. `verdict` is the worst band; `judgement` is the verdict raised to bug by a signal."""

    verdict: Severity
    judgement: Severity
    pattern: PatternName
    reason: str
    first_divergence: StageResult | None
    sub_stage: StageResult | None
    sub_stage_why: str
    per_class: list[ClassSummary]
    layers: list[LayerRow]
    stages: list[StageResult]
    ref_path: str
    target_path: str
    call: CallRef
    calls: list[CallSummary]
    fail_on: Severity = Severity.DIVERGE
    signal: str | None = None
    shards: list[dict] = field(default_factory=list)
    attribution: list[dict] | None = None
    warmup_skipped: int = 0
    notes: list[str] = field(default_factory=list)
    conclusion: str = ""  # the closing sentence, written by ffdebug.report.bisect_text.conclude
    coverage: Coverage = field(default_factory=Coverage)
    allow_partial: bool = False

    def failed(self, fail_on: Severity | str | None = None) -> bool:
        return at_least(self.judgement, fail_on or self.fail_on)

    def to_json(self) -> dict:
        sub = None
        if self.sub_stage is not None:
            sub = dict(self.sub_stage.summary(*SUB_STAGE_FIELDS), why=self.sub_stage_why)
        first = self.first_divergence.summary(*FIRST_DIVERGENCE_FIELDS) if self.first_divergence else None
        return {
            "verdict": self.verdict.value,
            "first_divergence": first,
            "pattern": self.pattern.value,
            "per_class": [c.to_json() for c in self.per_class],
            "sub_stage": sub,
            "reason": self.reason,
            "signal": self.signal,
            "judgement": self.judgement.value,
            "layers": [r.to_json() for r in self.layers],
            "call": self.call.to_json(),
            "calls": [c.to_json() for c in self.calls],
            "shards": self.shards,
            "attribution": self.attribution,
            "warmup_skipped": self.warmup_skipped,
            "stages": [s.to_json() for s in self.stages],
            "ref": self.ref_path,
            "target": self.target_path,
            "notes": self.notes,
            "fail_on": self.fail_on.value,
            "passed": self.exit_code() == 0,
            "complete": self.complete,
            "coverage": self.coverage.to_json(),
            "allow_partial": self.allow_partial,
            "conclusion": self.conclusion,
        }


def worst_of(stages: list[StageResult]) -> Severity:
    """The worst severity among stages (`ok` for none)."""
    return worst(*(s.severity for s in stages))


SLOT_MEANING = {
    "numerical": "not bit-identical but inside the ok band: batch-variant kernels, a kernel-stack "
    "property rather than a model bug",
    "slot_bug": "outside the ok band: slot-dependent logic (mask, positions, cache slot, a reduction "
    "over the batch)",
}


@dataclass(frozen=True)
class SlotCompare:
    """One slot of a batched stage against slot 0 (or slot 0 against a single-prompt run)."""

    slot: int
    against: str
    cos: float | None
    rel: float | None
    max_abs: float | None
    bit_equal: float | None
    severity: Severity

    @property
    def bit_identical(self) -> bool:
        return (self.bit_equal or 0.0) >= 1.0

    def to_json(self) -> dict:
        return {**asdict(self), "severity": self.severity.value}


@dataclass
class SlotStage:
    """One stage of a batched run, split into slots."""

    key: str
    layer: int | None
    layer_class: str | None
    slots: list[SlotCompare]
    single: SlotCompare | None = None

    @property
    def worst(self) -> SlotCompare:
        return max(self.slots, key=lambda c: (c.rel or 0.0, -(c.bit_equal or 0.0)))

    def comparisons(self) -> list[SlotCompare]:
        return self.slots + ([self.single] if self.single is not None else [])

    def to_json(self) -> dict:
        return {
            "key": self.key,
            "layer": self.layer,
            "layer_class": self.layer_class,
            "slots": [c.to_json() for c in self.slots],
            "single": self.single.to_json() if self.single else None,
            "worst": self.worst.to_json(),
        }


@dataclass(frozen=True)
class SlotFinding:
    """The first comparison that is not bit-identical (or not ok), located."""

    stage: SlotStage
    compare: SlotCompare
    classification: str | None = None  # numerical | slot_bug

    def to_json(self) -> dict:
        out = dict(self.compare.to_json(), key=self.stage.key, layer=self.stage.layer)
        if self.classification:
            out.update(classification=self.classification, meaning=SLOT_MEANING[self.classification])
        return out


@dataclass
class InvarianceResult(CoveredVerdict):
    """Every slot of a batched run against slot 0. Truthy when nothing is at or above `fail_on`
    (and, with `exact`, every stage is bit-identical)."""

    slots: int
    slot_dim: int
    stages: list[SlotStage]
    path: str
    single_path: str | None = None
    fail_on: Severity = Severity.DRIFT
    exact: bool = False
    notes: list[str] = field(default_factory=list)
    conclusion: str = ""
    coverage: Coverage = field(default_factory=Coverage)
    allow_partial: bool = False

    @property
    def verdict(self) -> Severity:
        return worst(*(c.severity for s in self.stages for c in [s.worst] + ([s.single] if s.single else [])))

    @property
    def first_non_invariant(self) -> SlotFinding | None:
        for s in self.stages:
            for c in s.comparisons():
                if not c.bit_identical:
                    cls = "numerical" if c.severity is Severity.OK else "slot_bug"
                    return SlotFinding(s, c, cls)
        return None

    @property
    def first_slot_bug(self) -> SlotFinding | None:
        for s in self.stages:
            for c in s.comparisons():
                if c.severity is not Severity.OK:
                    return SlotFinding(s, c)
        return None

    def failed(self) -> bool:
        if self.exact and self.first_non_invariant is not None:
            return True
        return self.verdict.at_least(self.fail_on)

    def to_json(self) -> dict:
        fni, fsb = self.first_non_invariant, self.first_slot_bug
        return {
            "verdict": self.verdict.value,
            "slots": self.slots,
            "slot_dim": self.slot_dim,
            "first_non_invariant": fni.to_json() if fni else None,
            "first_slot_bug": fsb.to_json() if fsb else None,
            "stages": [s.to_json() for s in self.stages],
            "path": self.path,
            "single": self.single_path,
            "notes": self.notes,
            "fail_on": self.fail_on.value,
            "passed": self.exit_code() == 0,
            "complete": self.complete,
            "coverage": {
                "paired": self.coverage.paired,
                "sides": {k: v.to_json() for k, v in self.coverage.sides.items()},
                "stats_only": self.coverage.stats_only,
                "selected_out": self.coverage.selected_out,
                "missing": self.coverage.missing,
            },
            "allow_partial": self.allow_partial,
            "conclusion": self.conclusion,
        }


@dataclass
class TensorDiff:
    """One weight tensor pair of weights-diff: finding, severity and numbers (`name` as on the
    reference side)."""

    name: str
    shape_ref: list[int]
    shape_target: list[int]
    dtype_ref: str
    dtype_target: str
    severity: Severity = Severity.OK
    finding: str = "equal"  # equal | rounding | dtype_only | transposed | sign_flip | scaled | mismatch
    byte_equal: bool = False
    cos: float | None = None
    rel: float | None = None
    max_abs: float | None = None
    rel_diff: float | None = None
    norm_ratio: float | None = None
    max_abs_at: list[int] | None = None
    bit_equal: float | None = None
    measured: bool = False  # metrics were computed (not byte-equal, not transposed-only)
    notes: list[str] = field(default_factory=list)
    after_transpose: dict | None = None
    scale_factor: float | None = None
    transformed: bool = False
    layer: int | None = None
    dequantized: bool = False
    tp: dict | None = None
    origin: dict | None = None  # {ref, target}: the stored names, where they differ from `name`
    layout: dict | None = None  # content matching: where a swapped / permuted block really is

    def to_json(self) -> dict:
        out: dict = {
            "name": self.name,
            "severity": self.severity.value,
            "finding": self.finding,
            "byte_equal": self.byte_equal,
            "cos": self.cos,
            "rel": self.rel,
            "max_abs": self.max_abs,
            "shape_ref": self.shape_ref,
            "shape_target": self.shape_target,
            "dtype_ref": self.dtype_ref,
            "dtype_target": self.dtype_target,
        }
        if self.measured:
            out.update(
                rel_diff=self.rel_diff,
                norm_ratio=self.norm_ratio,
                max_abs_at=self.max_abs_at,
                bit_equal=self.bit_equal,
            )
        optional = {
            "notes": list(self.notes) or None,
            "after_transpose": self.after_transpose,
            "scale_factor": self.scale_factor,
            "transformed": self.transformed or None,
            "layer": self.layer,
            "dequantized": self.dequantized or None,
            "tp": self.tp,
            "origin": self.origin,
            "layout": self.layout,
        }
        out.update({k: v for k, v in optional.items() if v is not None})
        return out


@dataclass
class WeightsDiffResult:
    """Truthy when the two sides match (no schema difference, nothing at or above `fail_on`)."""

    verdict: Severity
    only_ref: list[str]
    only_target: list[str]
    shape_mismatch: list[dict]
    dtype_mismatch: list[dict]
    renames: list[dict]
    tensors: list[TensorDiff]
    ref: dict = field(default_factory=dict)
    target: dict = field(default_factory=dict)
    fail_on: Severity = Severity.DIVERGE
    allow_dtype: bool = False
    schema_only: bool = False
    skipped: list[str] = field(default_factory=list)
    dequantized: list[dict] = field(default_factory=list)
    replica_mismatch: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    buffers_not_in_checkpoint: list[dict] = field(default_factory=list)
    restricted: list[dict] = field(default_factory=list)
    apply: str | None = None  # the options that apply the rename suggestions
    content: dict | None = None  # content matching's plan (`weights.content.ContentPlan.to_json`)
    warnings: list[str] = field(default_factory=list)  # name rules that matched nothing, …

    @property
    def schema_clean(self) -> bool:
        return not (
            self.only_ref
            or self.only_target
            or self.shape_mismatch
            or (self.dtype_mismatch and not self.allow_dtype)
        )

    def failed(self, fail_on: Severity | str | None = None) -> bool:
        threshold = fail_on or self.fail_on
        return (
            not self.schema_clean
            or bool(self.replica_mismatch)
            or any(t.severity.at_least(threshold) for t in self.tensors)
        )

    def __bool__(self) -> bool:
        return not self.failed()

    def problems(self) -> list[TensorDiff]:
        return [t for t in self.tensors if t.finding != "equal"]

    def to_json(self) -> dict:
        return {
            "verdict": self.verdict.value,
            "only_ref": self.only_ref,
            "only_target": self.only_target,
            "shape_mismatch": self.shape_mismatch,
            "dtype_mismatch": self.dtype_mismatch,
            "renames": self.renames,
            "tensors": [t.to_json() for t in self.tensors],
            "passed": not self.failed(),
            "schema_clean": self.schema_clean,
            "fail_on": self.fail_on.value,
            "allow_dtype": self.allow_dtype,
            "apply": self.apply,
            "ref": self.ref,
            "target": self.target,
            "skipped": self.skipped,
            "dequantized": self.dequantized,
            "replica_mismatch": self.replica_mismatch,
            "schema_only": self.schema_only,
            "notes": self.notes,
            "buffers_not_in_checkpoint": self.buffers_not_in_checkpoint,
            "restricted": self.restricted,
            "content": self.content,
            "warnings": self.warnings,
        }
