"""Tensor-parallel shards: merge per-rank pieces into the full tensor, check replicated tensors.

For a name held by several ranks of one side, the merge plan is decided from shapes alone:
- the dump manifest's `shard={dim, index, count}` when every piece carries it;
- `--tp-merge DIM`: concatenate along DIM (unless every piece already has the full shape);
- `--tp-merge auto` (default): every piece has the other side's full shape → replicated (checked
  byte-equal across ranks when loaded); else the one dim along which the pieces sum to the full
  shape while every other dim matches → concatenated along it.
When both sides are per-rank with the same world size, rank r is compared with rank r instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ffdebug.io.ranks import Concat, Plan, PlanMismatch, Replicated, replica_mismatch
from ffdebug.io.record import Record


@dataclass
class Logical:
    """One tensor of one side as compared: a name (reference namespace) and how to build it."""

    name: str
    source_name: str  # as stored on its side
    entries: list[Record]  # by rank
    shape: tuple[int, ...]
    dtype: str  # stored dtype
    fold: Plan | None = None  # how the ranks' pieces merge (None: one piece, or unmerged)
    layer: int | None = None
    note: str | None = None
    scale: Logical | None = None  # fp8 scale companion, when dequantised
    replica_mismatch: list[int] = field(default_factory=list)  # ranks differing from rank 0
    build: object = None  # override: a callable returning the tensor (fused views)
    stacked_from: str | None = None  # source name of the stacked tensor this expert's part is cut from
    segment: object = None  # content matching: the `content.Segment` of `stacked_from` compared
    found: object = None  # content matching: where the content really is, when elsewhere
    relation: object = None  # content matching: the `content.Relation` this tensor belongs to

    @property
    def plan(self) -> str:
        """single | replicated | concat | unmerged (the JSON label)."""
        if self.fold is not None:
            return self.fold.label
        return "single" if len(self.entries) <= 1 else "unmerged"

    @property
    def dim(self) -> int | None:
        return self.fold.dim if isinstance(self.fold, Concat) else None

    @property
    def stored_name(self) -> str:
        """The name of the tensor as stored on its side (the whole stacked tensor for a part)."""
        return self.stacked_from or self.source_name

    @property
    def ranks(self) -> list[int]:
        return [e.rank for e in self.entries]


def plan_merge(pieces: list[Record], other_shape: tuple[int, ...] | None, tp_merge) -> tuple:
    """(plan or None, merged shape, note) for the pieces of one name (None: single or unmerged)."""
    shapes = [tuple(e.shape) for e in pieces]
    if len(pieces) == 1:
        return None, shapes[0], None
    first = shapes[0]
    if all(e.shard is not None for e in pieces):
        return _concat(shapes, pieces[0].shard.dim, "manifest shard metadata")
    same = all(s == first for s in shapes)
    if same and (other_shape is None or tuple(other_shape) == first):
        return Replicated(), first, None
    if isinstance(tp_merge, int):
        return _concat(shapes, tp_merge, f"--tp-merge {tp_merge}")
    if other_shape is not None:
        other_shape = tuple(other_shape)
        for d in range(len(first)):
            if len(other_shape) != len(first):
                break
            plan = Concat(d)
            if plan.fits(shapes) and plan.shape(shapes) == other_shape:
                return plan, other_shape, None
    per_rank = ", ".join(str(list(s)) for s in shapes)
    want = f" into {list(other_shape)}" if other_shape is not None else ""
    return None, first, f"per-rank shapes {per_rank} do not merge{want}; pass --tp-merge DIM"


def _concat(shapes, d: int, why: str) -> tuple:
    try:
        nd = len(shapes[0])
        plan = Concat(d % nd if -nd <= d < nd else d)
        return plan, plan.shape(shapes), None
    except PlanMismatch as err:
        return None, shapes[0], f"{why}: {err}"


def order_pieces(pieces: list[Record]) -> list[Record]:
    """Pieces in concatenation order: manifest shard index when present, else rank."""
    return sorted(pieces, key=lambda e: (e.shard.index if e.shard else e.rank, e.rank))


def load_logical(t: Logical, dequant_piece=None):
    """Materialise a logical tensor: pieces loaded (and dequantised) one rank at a time, merged."""
    if t.build is not None:
        return t.build()
    scale_by_rank = {}
    if t.scale is not None:
        scale_by_rank = {e.rank: e for e in t.scale.entries}

    def piece(e: Record):
        x = e.load()
        if dequant_piece is not None and t.scale is not None:
            s = scale_by_rank.get(e.rank) or t.scale.entries[0]
            x = dequant_piece(x, s.load(), t.name)
        return x

    if t.fold is None:
        return piece(t.entries[0])
    if isinstance(t.fold, Replicated):
        base = piece(t.entries[0])
        t.replica_mismatch = []
        for e in t.entries[1:]:  # one other rank in memory at a time
            other = piece(e)
            if replica_mismatch([base, other]):
                t.replica_mismatch.append(e.rank)
            del other
        return base
    return t.fold.apply([piece(e) for e in order_pieces(t.entries)])
