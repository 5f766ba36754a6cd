"""Stages compared without both full tensors: statistics-only records (stats mode, over a byte
budget) and sketch-mode records (docs/dumping.md "Dump settings"), graded by the same verdict rules."""

from __future__ import annotations

import math

from ffdebug import verdict as V
from ffdebug.io.record import Record
from ffdebug.results import StageResult


def stats_compare(r: Record, t: Record, e: StageResult) -> None:
    """Compare two stats-only records: relative error of l2, mean and std (no cos available)."""
    rs, ts = r.stats or {}, t.stats or {}
    e.stats_only = True
    if not rs or not ts:
        e.notes.append("no statistics to compare")
        e.severity = V.stats_only(None)
        return
    l2r, l2t = rs.get("l2") or 0.0, ts.get("l2") or 0.0
    scale = max(l2r / math.sqrt(max(rs.get("numel") or 1, 1)), 1e-30)
    rel_l2 = abs(l2t - l2r) / l2r if l2r else (0.0 if l2t == 0 else None)
    rel_mean = abs((ts.get("mean") or 0) - (rs.get("mean") or 0)) / scale
    rel_std = abs((ts.get("std") or 0) - (rs.get("std") or 0)) / scale
    e.rel = None if rel_l2 is None else max(rel_l2, rel_mean, rel_std)
    e.norm_ratio = (l2t / l2r) if l2r else None
    e.notes.append("compared on statistics only (l2, mean, std): a rotation or permutation is invisible")
    e.severity = V.stats_only(e.rel)


def sketch_of(rec: Record) -> dict | None:
    info = (rec.extra or {}).get("sketch")
    return info if isinstance(info, dict) and rec.has_payload else None


def sketch_compare(r: Record, t: Record, e: StageResult, thresholds=(), exact: bool = False) -> None:
    """Compare two sketch-mode records: rel and cos estimated from their sketches and exact norms
    (`comparison/sketch.py`). Sketches of different seeds or sizes cannot meet: a bug, said why."""
    from ffdebug.comparison.sketch import estimate

    rs, ts = sketch_of(r), sketch_of(t)
    if rs != ts:
        e.notes.append(f"sketches differ in seed or size (ref {rs}, target {ts}): dump both with one seed")
        e.severity = V.stats_only(None)
        return
    l2r, l2t = (r.stats or {}).get("l2"), (t.stats or {}).get("l2")
    if l2r is None or l2t is None:
        e.notes.append("sketch without the tensor's norm: nothing to compare")
        e.severity = V.stats_only(None)
        return
    est = estimate(r.load(), t.load(), float(l2r), float(l2t))
    e.cos, e.rel = est.cos, est.rel
    e.norm_ratio = (l2t / l2r) if l2r else None
    e.notes.append(f"rel and cos estimated from a {rs.get('buckets')}-bucket sketch")
    severity = V.classify(est.cos, est.rel, e.key, thresholds)
    severity = V.zero_side(severity, float(l2r), float(l2t), int((r.stats or {}).get("numel") or 0))
    if exact:  # a sketch cannot show bit equality: at --exact it never passes as identical
        severity, e.invariance = V.exact(severity, 0.0)
        e.notes.append("a sketch cannot show bit equality (--exact): dump full tensors")
    e.severity = severity
