"""Naming a weight difference in the port's terms, after its finding: a block content matching
found elsewhere in its composite (`swapped`, `permuted`), a tensor whose rows are the other side's
reordered (`permuted`, `weights.rows`), a tensor equal to the port's own
initialisation (`not_loaded`, with --init), or an uncorrelated tensor (a note)."""

from __future__ import annotations

from ffdebug import verdict as V
from ffdebug.arrays import round_to
from ffdebug.results import TensorDiff
from ffdebug.verdict import Severity
from ffdebug.weights.findings import LOADED
from ffdebug.weights.loading import TensorLoader
from ffdebug.weights.numerics import bytes_equal
from ffdebug.weights.sources import WeightSource
from ffdebug.weights.tp import Logical

UNCORRELATED = 0.05  # |cos| below this: no relation between the two tensors
_LOADER_CHANGED = "same dtype, values differ"  # the findings' note this explanation replaces


class InitTensors:
    """The port's initial values (`--init`): one tensor per stored name, read when asked for."""

    def __init__(self, src: WeightSource | None) -> None:
        self.by_name = {e.key: e for e in src.entries} if src is not None else {}

    def of(self, lg: Logical):
        """The initial value of `lg` (its block, for a content-matched composite), else None."""
        rec = self.by_name.get(lg.stacked_from or lg.source_name)
        if rec is None:
            return None
        x = rec.load()
        if lg.segment is not None:
            from ffdebug.weights.content import cut

            if x.ndim != len(lg.relation.shape):
                return None
            x = cut(x, lg.segment)
        return x


def _misplaced(entry: TensorDiff, r: Logical, t: Logical, loader: TensorLoader) -> bool:
    """The block the other side holds is where content matching found it, not where compared."""
    for lg, other, other_side in ((r, t, "target"), (t, r, "ref")):
        if lg.found is None:
            continue
        seg, build = lg.found
        from ffdebug.comparison.metrics import compare_tensors

        m = compare_tensors(loader.load(other, other_side), build())
        if not V.is_ok(V.classify(m.cos, m.rel)):
            continue
        entry.notes = [n for n in entry.notes if not n.startswith(_LOADER_CHANGED)]
        entry.finding = "permuted" if lg.relation.kind == "stacked" else "swapped"
        entry.severity = V.worst(entry.severity, Severity.SCRAMBLE)
        entry.layout = {
            "tensor": lg.stacked_from,
            "compared_at": lg.segment.where(),
            "found_at": seg.where(),
            "cos": m.cos,
            "rel": m.rel,
        }
        entry.notes.append(
            f"{entry.name} is stored at {lg.stacked_from}{seg.where()}, where the port's other "
            f"tensors of this kind hold it at {lg.segment.where()}"
        )
        return True
    return False


def _rows_reordered(entry: TensorDiff, r: Logical, t: Logical, loader: TensorLoader) -> bool:
    """The target holds every reference row, each once, in another order (a per-head block swap,
    a rotary re-ordering written by a converter): `permuted`, with where the rows went."""
    from ffdebug.weights.rows import describe, permutation, rotary_note

    if entry.cos is not None and entry.rel is not None and V.is_ok(V.classify(entry.cos, entry.rel)):
        return False  # its rows already fit in order: no reordering to find (no row fingerprints)
    rows = permutation(loader.load(r, "ref"), loader.load(t, "target"))
    if rows is None:
        return False
    entry.notes = [n for n in entry.notes if not n.startswith(_LOADER_CHANGED)]
    entry.finding = "permuted"
    entry.severity = V.worst(entry.severity, Severity.SCRAMBLE)
    rotary = rotary_note(rows)
    entry.layout = {"tensor": t.source_name, "rows": describe(rows)}
    if rotary:
        entry.layout["rotary"] = rotary
    entry.notes.append(
        f"{t.source_name} holds every row of the reference, reordered: reference rows 0, 1, … are "
        f"its rows {describe(rows)}" + (f" ({rotary})" if rotary else "")
    )
    return True


def _never_loaded(entry: TensorDiff, lg: Logical, side: str, loader: TensorLoader, init: InitTensors) -> bool:
    x0 = init.of(lg)
    if x0 is None:
        return False
    x = loader.load(lg, side)
    if tuple(x0.shape) != tuple(x.shape) or not bytes_equal(round_to(x0, x.dtype), x):
        return False
    entry.notes = [n for n in entry.notes if not n.startswith(_LOADER_CHANGED)]
    entry.finding = "not_loaded"
    entry.severity = V.worst(entry.severity, Severity.BUG)
    entry.notes.append(f"{lg.source_name} equals the port's own initialisation (--init): never loaded")
    return True


def explain(
    entry: TensorDiff, r: Logical, t: Logical, loader: TensorLoader, init: InitTensors, init_side: str
) -> None:
    """Name `entry`'s difference in the port's terms (in place); a loaded tensor keeps its finding."""
    if r.source_name != entry.name or t.source_name != entry.name:
        entry.origin = {"ref": r.source_name, "target": t.source_name}
    if entry.finding in LOADED or _misplaced(entry, r, t, loader):
        return
    if _never_loaded(entry, r if init_side == "ref" else t, init_side, loader, init):
        return
    if entry.finding == "mismatch" and _rows_reordered(entry, r, t, loader):
        return
    if entry.finding == "mismatch" and entry.cos is not None and abs(entry.cos) < UNCORRELATED:
        entry.notes.append(
            f"uncorrelated with the other side (cos {entry.cos:.3f}): never loaded, or loaded from "
            "another tensor; --init ENTRY (the port built without loading) tells which"
        )
