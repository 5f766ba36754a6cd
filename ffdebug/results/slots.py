"""Slot invariance: every slot of a batched run against slot 0 (`InvarianceResult`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ffdebug.coverage import Coverage
from ffdebug.results.stages import CoveredVerdict
from ffdebug.verdict import Severity, worst

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
