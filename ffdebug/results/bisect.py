"""What bisect found: the layer budget, per-class summaries, the calls, and `BisectResult`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ffdebug.coverage import Coverage
from ffdebug.results.stages import CallRef, CoveredVerdict, GenerationDivergence, StageResult, fails
from ffdebug.verdict import PatternName, Severity, at_least


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
    local: str | None = None  # attribution verdict: "local" | "inherited" | "clean" | None (not run)
    local_rel: float | None = None  # attribution: the block's own error, re-run on the reference's input
    judged: bool = True  # False: the budget could not judge the layer (after a decorrelation, a
    # routing flip or an underflow), and attribution did not run
    introduces: bool = False
    beyond_precision: bool = False  # adds more than the dtypes' precision allows one block
    precision_budget: float | None = None  # that allowance (rel), when the layer was judged
    max_step: float | None = None  # the most error one stage of the layer adds over its own input
    max_step_key: str | None = None  # that stage
    scale_step: float | None = None  # the largest scale of the signal one stage adds (coherent error)
    scale_step_key: str | None = None  # that stage
    scale_out: float | None = None  # the scale the block adds to its output (cos(t - r, r) high), else 0
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


class VerdictContradiction(RuntimeError):
    """A bisect result whose verdict, judgement, signal and pattern disagree: a defect of ffdebug."""


@dataclass
class BisectResult(CoveredVerdict):
    """Where the target first parts from the reference. Truthy when the judgement is below
    `fail_on`. `verdict` is the worst band raised to bug by a bug signal; `judgement` is the same
    grade (kept as its own key for readers of older results); `contradictions` is checked here."""

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
    saturated_after: int | None = None  # the layer where the target decorrelated; later ones not judged
    decided: bool = True  # False: the budget leaves one layer vs one class open (attribution decides)
    shards: list[dict] = field(default_factory=list)
    attribution: list[dict] | None = None
    warmup_skipped: int = 0
    notes: list[str] = field(default_factory=list)
    conclusion: str = ""  # the closing sentence, written by ffdebug.report.bisect_text.conclude
    coverage: Coverage = field(default_factory=Coverage)
    allow_partial: bool = False
    generation: GenerationDivergence | None = None  # token ids that differ after the first call
    missing_inside: list[str] = field(default_factory=list)  # first layer's stages the target never wrote

    def __post_init__(self) -> None:
        broken = self.contradictions()
        if broken:
            raise VerdictContradiction(f"{self.ref_path} vs {self.target_path}: " + "; ".join(broken))

    def contradictions(self) -> list[str]:
        """Where verdict, judgement, signal and pattern disagree (none, by construction; checked on
        every result: docs/bisect.md "Bisecting", one rule for verdict and judgement)."""
        out = []
        if self.verdict is not self.judgement:
            out.append(f"verdict {self.verdict.value} but judgement {self.judgement.value}")
        if self.signal and not self.judgement.at_least(Severity.BUG):
            out.append(f"a bug signal ({self.signal}) but judgement {self.judgement.value}")
        if self.pattern is PatternName.MATCH and any(r.introduces for r in self.layers):
            out.append("pattern match but a layer introduces error")
        if self.pattern is PatternName.DRIFT and (
            self.signal
            or any(r.beyond_precision for r in self.layers)
            or self.verdict.at_least(Severity.DIVERGE)
        ):
            out.append(
                "pattern drift (precision only) but a layer is beyond precision, a bug signal is set "
                f"or the verdict is {self.verdict.value}"
            )
        localised = (PatternName.JUMP, PatternName.LAYER_CLASS, PatternName.UNDETERMINED)
        if self.pattern in localised and not any(r.introduces for r in self.layers):
            out.append(f"pattern {self.pattern.value} but no layer introduces error")
        return out

    def attribution_decides(self) -> bool:
        """The error budget could not tell one layer from one class (`decided` False: layers it
        could not judge after a decorrelation or a routing flip, layers beyond precision that
        inherit error, `undetermined`) and attribution has not run: the run that decides is
        `bisect --model-ref ... --model-target ...` (docs/bisect.md "Bisecting")."""
        return self.attribution is None and not self.decided

    def failed(self, fail_on: Severity | str | None = None) -> bool:
        return fails(self.generation, at_least(self.judgement, fail_on or self.fail_on))

    def to_json(self) -> dict:
        out = self._to_json()
        if self.generation is not None:
            out["generation_diverged"] = self.generation.to_json()
        return out

    def _to_json(self) -> dict:
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
            "missing_inside": self.missing_inside,
            "reason": self.reason,
            "saturated_after": self.saturated_after,
            "decided": self.decided,
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
