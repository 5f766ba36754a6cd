"""The zoo: every architecture the installed transformers and diffusers ship, and the sweep over it.

The lists are read from the libraries themselves, never written by hand, so a new release brings
its new architectures into the sweep (`families.py`):

- `causal_lm`: every `model_type` with a causal LM class (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`);
- `seq2seq_lm`: every encoder-decoder LM class (`MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES`);
- `image_classification`: every image classifier class (`MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES`);
- `diffusers`: every transformer and UNet denoiser diffusers exports (`diffusers_zoo.architectures`).

`sample` picks a seeded subset (what CI runs); `summarise` turns the per-model reports into the
rates docs/bisect.md records: architectures attempted, built, holding each case group, and per
mutation kind, overall and per family.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from ffdebug.selftest.cases import FAILS, HOLDS, ModelReport
from ffdebug.selftest.families import CAUSAL_LM, DIFFUSERS, FAMILIES, class_names, mapping_names


def architectures(family: str = CAUSAL_LM) -> list[str]:
    """The specs of one family's architectures, sorted: causal LMs by `model_type`, the other
    transformers families by model class name, diffusers by class name."""
    if family == CAUSAL_LM:
        return sorted(mapping_names(CAUSAL_LM))
    if family == DIFFUSERS:
        from ffdebug.selftest.diffusers_zoo import architectures as denoisers

        return denoisers()
    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: not one of {', '.join(FAMILIES)}")
    return class_names(family)


def sample(count: int, seed: int, family: str = CAUSAL_LM) -> list[str]:
    """`count` architectures of `family` drawn with `random.Random(seed)` (all when `count` covers
    them), sorted."""
    names = architectures(family)
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
    families: dict[str, dict[str, Rate]] = field(default_factory=dict)  # family -> group -> rate

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
            "families": {f: rates(groups) for f, groups in self.families.items()},
        }


def summarise(reports: list[ModelReport]) -> Summary:
    out = Summary(attempted=len(reports))
    for report in reports:
        if not report.built:
            out.not_built[report.spec] = report.error or "not built"
            continue
        out.built += 1
        family = out.families.setdefault(report.family or CAUSAL_LM, {})
        for case in report.cases:
            family.setdefault(case.group, Rate()).add(case.status)
            out.groups.setdefault(case.group, Rate()).add(case.status)
            out.cases.setdefault(case.name, Rate()).add(case.status)
            if case.status not in (HOLDS, FAILS):
                out.no_effect[case.name] += 1
    return out
