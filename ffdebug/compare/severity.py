"""Severity bands (DESIGN §4) and per-stage threshold overrides.

| severity | cos band     | rel band  |
| ok       | cos ≥ 0.9999 | rel ≤ 1%  |
| drift    | cos ≥ 0.99   | rel ≤ 10% |
| diverge  | cos ≥ 0.9    | rel ≤ 30% |
| bug      | cos > 0.5    | any       |
| scramble | cos ≤ 0.5    | any       |

The verdict of a stage is the worse of its cos band and its rel band: rel is the more sensitive
one, so a large-magnitude tensor with cos 0.9998 and rel 57% is a bug.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from ffdebug.errors import FFDebugError

SEVERITIES = ("ok", "drift", "diverge", "bug", "scramble")
RANK = {s: i for i, s in enumerate(SEVERITIES)}

COS_BANDS = ((0.9999, "ok"), (0.99, "drift"), (0.9, "diverge"))
REL_BANDS = ((0.01, "ok"), (0.10, "drift"), (0.30, "diverge"))


LOW_PRECISION = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")


def noise_factor(*dtypes: str | None) -> float:
    """k of the noise rule "within noise when error <= k x noise error" (DESIGN §4): 3 when any
    side involved runs in a low-precision dtype (bf16 / fp16 / fp8), else 2 (fp32 and wider)."""
    return 3.0 if any(d in LOW_PRECISION for d in dtypes) else 2.0


def worst(*severities: str) -> str:
    return max(severities, key=lambda s: RANK[s]) if severities else "ok"


def at_least(severity: str, threshold: str) -> bool:
    return RANK[severity] >= RANK[threshold]


def check_fail_on(value: str) -> str:
    if value not in SEVERITIES[1:]:
        raise FFDebugError(f"--fail-on {value!r} is invalid: use {', '.join(SEVERITIES[1:])}")
    return value


def cos_band(cos: float) -> str:
    for bound, name in COS_BANDS:
        if cos >= bound:
            return name
    return "bug" if cos > 0.5 else "scramble"


def rel_band(rel: float | None) -> str:
    if rel is None:
        return "bug"
    for bound, name in REL_BANDS:
        if rel <= bound:
            return name
    return "bug"


@dataclass(frozen=True)
class Threshold:
    """`GLOB:cos>=X,rel<=Y` — a stage matching GLOB is ok when it meets both bounds."""

    glob: str
    cos: float | None = None
    rel: float | None = None

    def matches(self, key: str) -> bool:
        return fnmatch.fnmatchcase(key, self.glob)


def parse_threshold(spec: str) -> Threshold:
    m = re.fullmatch(r"\s*([^:]+):(.+)", spec)
    if not m:
        raise FFDebugError(f"--threshold {spec!r} is invalid: use 'GLOB:cos>=0.999,rel<=0.02'")
    glob, body = m.group(1).strip(), m.group(2)
    cos = rel = None
    for part in body.split(","):
        pm = re.fullmatch(r"\s*(cos)\s*>=\s*([0-9.eE+-]+)\s*|\s*(rel)\s*<=\s*([0-9.eE+-]+)\s*", part)
        if not pm:
            raise FFDebugError(f"--threshold {spec!r}: cannot read {part.strip()!r}; use cos>=X or rel<=Y")
        try:
            if pm.group(1):
                cos = float(pm.group(2))
            else:
                rel = float(pm.group(4))
        except ValueError:
            raise FFDebugError(f"--threshold {spec!r}: {part.strip()!r} is not a number") from None
    if cos is not None and not -1.0 <= cos <= 1.0:
        raise FFDebugError(f"--threshold {spec!r}: cos bound {cos:g} is outside [-1, 1]")
    if rel is not None and not rel >= 0.0:
        raise FFDebugError(f"--threshold {spec!r}: rel bound {rel:g} must be >= 0 (0.05 is 5%)")
    return Threshold(glob=glob, cos=cos, rel=rel)


def classify(
    cos: float | None, rel: float | None, key: str = "", thresholds: tuple[Threshold, ...] = ()
) -> str:
    """Severity of one stage; the first matching threshold override redefines its ok band."""
    base = worst(cos_band(cos) if cos is not None else "ok", rel_band(rel))
    if cos is None and rel is None:
        base = "bug"
    for th in thresholds:
        if th.matches(key):
            passes = (th.cos is None or (cos is not None and cos >= th.cos)) and (
                th.rel is None or (rel is not None and rel <= th.rel)
            )
            return "ok" if passes else worst(base, "drift")
    return base
