"""Per-rank target tensors against a single reference tensor: partial sums and shards.

The most common false divergence of a tensor-parallel engine: it dumps a row-parallel output
*before* the all-reduce (each rank holds a partial sum), or a column-parallel output before the
all-gather (each rank holds a slice), while the reference dumps the full tensor. When the manifest
says so (`reduction="partial"`, `shard={dim, index, count}`) pairing folds the ranks before
comparing. When it does not, and rank 0 alone disagrees with the reference, `diagnose` tries each
reading — every rank alone, the sum over ranks, the concatenation along each dim — and says which
one matches.
"""

from __future__ import annotations

from ffdebug.compare.metrics import compare_tensors
from ffdebug.io.ranks import Concat, Replicated, Sum
from ffdebug.results import StageResult
from ffdebug.verdict import classify, is_ok


def candidates(parts: list) -> list[tuple[str, str, object]]:
    """(reading, how, tensor) for every way to fold per-rank tensors into one."""
    out: list[tuple[str, str, object]] = []
    n = len(parts)
    shapes = [tuple(p.shape) for p in parts]
    if Sum().fits(shapes):
        out.append((f"sum over {n} ranks (pre-all-reduce partial sums)", "sum", Sum().apply(parts)))
    for dim in range(parts[0].dim()):
        plan = Concat(dim)
        if plan.fits(shapes):
            out.append((f"concatenation of {n} shards along dim {dim}", plan.describe(), plan.apply(parts)))
    for r in range(n):
        out.append((f"rank {r} alone (replicated)", f"rank:{r}", Replicated(r).apply(parts)))
    return out


def diagnose(ref_tensor, parts: list) -> list[dict]:
    """Every reading of the per-rank tensors that has the reference's shape, best first."""
    rows = []
    for reading, how, t in candidates(parts):
        if tuple(t.shape) != tuple(ref_tensor.shape):
            continue
        m = compare_tensors(ref_tensor, t)
        severity = classify(m.cos, m.rel)
        rows.append({"reading": reading, "how": how, "cos": m.cos, "rel": m.rel, "severity": severity.value})
    rows.sort(key=lambda r: (r["rel"] is None, r["rel"] if r["rel"] is not None else 0.0))
    return rows


def explain_stage(entry: StageResult, ref_record, target_record) -> dict | None:
    """For a multi-rank target stage: the reading that matches, declared or found here."""
    declared = entry.unsharded_target
    parts = target_record.parts
    if len(parts) < 2:
        return None
    info = {
        "key": entry.key,
        "ranks": len(parts),
        "declared": None if declared is None or declared["how"] == "replicated" else declared["how"],
    }
    if info["declared"]:
        info.update(reading=target_record.fold.describe(), matches=entry.ok, cos=entry.cos, rel=entry.rel)
        return info
    if entry.ok:
        return None
    rows = diagnose(ref_record.load(), [p.load() for p in parts])
    best = next((r for r in rows if is_ok(r["severity"])), None)
    info.update(readings=rows, matches=best is not None)
    if best is not None:
        info.update(reading=best["how"], cos=best["cos"], rel=best["rel"], explained_by=best["reading"])
    return info
