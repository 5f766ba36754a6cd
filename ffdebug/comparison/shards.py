"""Per-rank target tensors against a single reference tensor: partial sums and shards.

The most common false divergence of a tensor-parallel engine: it dumps a row-parallel output
*before* the all-reduce (each rank holds a partial sum), or a column-parallel output before the
all-gather (each rank holds a slice), while the reference dumps the full tensor. When the manifest
says so (`reduction="partial"`, `shard={dim, index, count}`) pairing folds the ranks before
comparing. When it does not, compare first takes the ranks as replicas (each compared with the
reference); when one disagrees, `diagnose` tries each reading — every rank alone, the sum over
ranks, the concatenation along each dim — and a fold that matches explains the ranks (compare and
bisect share this, so they agree).
"""

from __future__ import annotations

from dataclasses import dataclass

from ffdebug.comparison.metrics import compare_tensors
from ffdebug.io.ranks import Concat, Plan, Replicated, Sum
from ffdebug.verdict import Severity, classify


def candidates(parts: list) -> list[tuple[str, Plan, object]]:
    """(reading, plan, tensor) for every way to fold per-rank tensors into one."""
    out: list[tuple[str, Plan, object]] = []
    n = len(parts)
    shapes = [tuple(p.shape) for p in parts]
    if Sum().fits(shapes):
        out.append((f"sum over {n} ranks (pre-all-reduce partial sums)", Sum(), Sum().apply(parts)))
    for dim in range(parts[0].ndim):
        plan = Concat(dim)
        if plan.fits(shapes):
            out.append((f"concatenation of {n} shards along dim {dim}", plan, plan.apply(parts)))
    for r in range(n):
        out.append((f"rank {r} alone (replicated)", Replicated(r), Replicated(r).apply(parts)))
    return out


@dataclass(frozen=True)
class Reading:
    """One way of folding the target's per-rank tensors, measured against the reference."""

    reading: str
    plan: Plan
    cos: float | None
    rel: float | None
    severity: Severity

    @property
    def how(self) -> str:
        return self.plan.describe() if not isinstance(self.plan, Replicated) else f"rank:{self.plan.rank}"

    def to_json(self) -> dict:
        return {
            "reading": self.reading,
            "how": self.how,
            "cos": self.cos,
            "rel": self.rel,
            "severity": self.severity.value,
        }


def diagnose(ref_tensor, parts: list) -> list[Reading]:
    """Every reading of the per-rank tensors that has the reference's shape, best first."""
    rows = []
    for reading, plan, t in candidates(parts):
        if tuple(t.shape) != tuple(ref_tensor.shape):
            continue
        m = compare_tensors(ref_tensor, t)
        rows.append(Reading(reading, plan, m.cos, m.rel, classify(m.cos, m.rel)))
    rows.sort(key=lambda r: (r.rel is None, r.rel if r.rel is not None else 0.0))
    return rows


def best_fold(ref_tensor, parts: list) -> tuple[Reading | None, list[Reading]]:
    """The best reading that folds several ranks (sum or concatenation) and is ok, and all rows."""
    rows = diagnose(ref_tensor, parts)
    best = next((r for r in rows if r.severity is Severity.OK and not isinstance(r.plan, Replicated)), None)
    return best, rows
