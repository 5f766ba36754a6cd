"""The zoo: every causal LM architecture the installed transformers ships, and the sweep over it.

The list is read from transformers itself (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`: every `model_type`
with a causal LM class), never written by hand, so a new transformers release brings its new
architectures into the sweep. `sample` picks a seeded subset (what CI runs); `summarise` turns the
per-model reports into the rates docs/bisect.md records: architectures attempted, built, holding
each case group, and per mutation kind.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from ffdebug.selftest.cases import FAILS, HOLDS, ModelReport


def architectures() -> list[str]:
    """Every `model_type` transformers maps to a causal LM class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sample(count: int, seed: int) -> list[str]:
    """`count` architectures drawn with `random.Random(seed)` (all when `count` covers them), sorted."""
    names = architectures()
    if count >= len(names):
        return names
    return sorted(random.Random(seed).sample(names, count))


@dataclass
class Rate:
    """Cases that hold over cases that count (`no effect` and `skipped` do not count)."""

    holds: int = 0
    counted: int = 0

    def add(self, status: str) -> None:
        if status in (HOLDS, FAILS):
            self.counted += 1
            self.holds += status == HOLDS

    def __str__(self) -> str:
        return f"{self.holds}/{self.counted}" + (
            f" ({100 * self.holds / self.counted:.0f}%)" if self.counted else ""
        )


@dataclass
class Summary:
    """The sweep's rates."""

    attempted: int = 0
    built: int = 0
    not_built: dict[str, str] = field(default_factory=dict)
    groups: dict[str, Rate] = field(default_factory=dict)
    cases: dict[str, Rate] = field(default_factory=dict)
    no_effect: Counter = field(default_factory=Counter)

    def to_json(self) -> dict:
        def rates(d: dict[str, Rate]) -> dict:
            return {k: {"holds": v.holds, "counted": v.counted} for k, v in d.items()}

        return {
            "attempted": self.attempted,
            "built": self.built,
            "not_built": self.not_built,
            "groups": rates(self.groups),
            "cases": rates(self.cases),
            "no_effect": dict(self.no_effect),
        }


def summarise(reports: list[ModelReport]) -> Summary:
    out = Summary(attempted=len(reports))
    for report in reports:
        if not report.built:
            out.not_built[report.spec] = report.error or "not built"
            continue
        out.built += 1
        for case in report.cases:
            out.groups.setdefault(case.group, Rate()).add(case.status)
            out.cases.setdefault(case.name, Rate()).add(case.status)
            if case.status not in (HOLDS, FAILS):
                out.no_effect[case.name] += 1
    return out
