"""weights-diff: one tensor pair (`TensorDiff`) and the whole diff (`WeightsDiffResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ffdebug.verdict import Severity


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
    finding: str = "equal"  # weights/findings.py FINDINGS: equal | rounding | dtype_only | ... | dtype_kind
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
