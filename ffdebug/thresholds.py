"""`--threshold GLOB:...` overrides: parsed, matched to stage keys (the threshold rule itself, which
turns them into a grade, is `ffdebug.verdict.apply_threshold`; `verdict` re-exports these names)."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from ffdebug.errors import FFDebugError


@dataclass(frozen=True)
class Threshold:
    """`GLOB:cos>=X,rel<=Y,elem<=E,max_abs<=M,atol=A`: a stage matching GLOB is ok when it meets
    every bound given, or when every element is within `atol` (max_abs <= A) whatever the others.
    An `elem`, `max_abs` or `atol` term replaces the default element-wise rule for the stage."""

    glob: str
    cos: float | None = None
    rel: float | None = None
    elem: float | None = None
    max_abs: float | None = None
    atol: float | None = None

    def matches(self, key: str) -> bool:
        return fnmatch.fnmatchcase(key, self.glob)

    @property
    def element_terms(self) -> bool:
        """The threshold bounds single elements itself (the element-wise rule steps aside)."""
        return self.elem is not None or self.max_abs is not None or self.atol is not None

    def passes(
        self, cos: float | None, rel: float | None, elem: float | None = None, max_abs: float | None = None
    ) -> bool:
        if self.atol is not None and max_abs is not None and max_abs <= self.atol:
            return True
        return (
            _at_least(cos, self.cos)
            and _at_most(rel, self.rel)
            and _at_most(elem, self.elem)
            and _at_most(max_abs, self.max_abs)
        )


def _at_least(value: float | None, bound: float | None) -> bool:
    return bound is None or (value is not None and value >= bound)


def _at_most(value: float | None, bound: float | None) -> bool:
    return bound is None or (value is not None and value <= bound)


_TERM = re.compile(
    r"\s*(cos)\s*>=\s*(\S+?)\s*|\s*(rel|elem|max_abs)\s*<=\s*(\S+?)\s*|\s*(atol)\s*=\s*(\S+?)\s*"
)
_TERMS = "cos>=X, rel<=Y, elem<=E, max_abs<=M or atol=A"


def parse_threshold(spec: str) -> Threshold:
    """`GLOB:cos>=0.999,rel<=0.02` (also `elem<=`, `max_abs<=`, `atol=`) into a Threshold
    (one-line error naming the bad part)."""
    m = re.fullmatch(r"\s*([^:]+):(.+)", spec)
    if not m:
        raise FFDebugError(f"--threshold {spec!r} is invalid: use 'GLOB:cos>=0.999,rel<=0.02'")
    glob, body = m.group(1).strip(), m.group(2)
    values: dict[str, float] = {}
    for part in body.split(","):
        pm = _TERM.fullmatch(part)
        if not pm:
            raise FFDebugError(f"--threshold {spec!r}: cannot read {part.strip()!r}; use {_TERMS}")
        name = pm.group(1) or pm.group(3) or pm.group(5)
        raw = pm.group(2) or pm.group(4) or pm.group(6)
        try:
            values[name] = float(raw)
        except ValueError:
            raise FFDebugError(f"--threshold {spec!r}: {part.strip()!r} is not a number") from None
    cos = values.get("cos")
    if cos is not None and not -1.0 <= cos <= 1.0:
        raise FFDebugError(f"--threshold {spec!r}: cos bound {cos:g} is outside [-1, 1]")
    if values.get("rel") is not None and not values["rel"] >= 0.0:
        raise FFDebugError(f"--threshold {spec!r}: rel bound {values['rel']:g} must be >= 0 (0.05 is 5%)")
    for name in ("elem", "max_abs", "atol"):
        if name in values and not values[name] >= 0.0:
            raise FFDebugError(f"--threshold {spec!r}: {name} bound {values[name]:g} must be >= 0")
    return Threshold(glob=glob, **values)


def matching_threshold(key: str, thresholds: tuple[Threshold, ...]) -> Threshold | None:
    """The first override whose glob matches `key` (first match wins)."""
    return next((th for th in thresholds if th.matches(key)), None)
