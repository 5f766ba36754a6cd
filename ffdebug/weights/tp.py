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

from ffdebug.weights.sources import Entry


@dataclass
class Logical:
    """One tensor of one side as compared: a name (reference namespace) and how to build it."""

    name: str
    source_name: str  # as stored on its side
    entries: list[Entry]  # by rank
    shape: tuple[int, ...]
    dtype: str  # stored dtype
    plan: str = "single"  # single | replicated | concat | unmerged
    dim: int | None = None
    layer: int | None = None
    note: str | None = None
    scale: Logical | None = None  # fp8 scale companion, when dequantised
    replica_mismatch: list[int] = field(default_factory=list)  # ranks differing from rank 0
    build: object = None  # override: a callable returning the tensor (fused views)
    stacked_from: str | None = None  # source name of the stacked tensor this expert's part is cut from

    @property
    def stored_name(self) -> str:
        """The name of the tensor as stored on its side (the whole stacked tensor for a part)."""
        return self.stacked_from or self.source_name

    @property
    def ranks(self) -> list[int]:
        return [e.rank for e in self.entries]


def plan_merge(pieces: list[Entry], other_shape: tuple[int, ...] | None, tp_merge) -> tuple:
    """(plan, dim, merged shape, note) for the pieces of one name."""
    shapes = [tuple(e.shape) for e in pieces]
    if len(pieces) == 1:
        return "single", None, shapes[0], None
    first = shapes[0]
    metas = [e.shard for e in pieces]
    if all(isinstance(m, dict) and m.get("dim") is not None for m in metas):
        d = int(metas[0]["dim"])
        return _concat(shapes, d, "manifest shard metadata")
    same = all(s == first for s in shapes)
    if same and (other_shape is None or tuple(other_shape) == first):
        return "replicated", None, first, None
    if isinstance(tp_merge, int):
        return _concat(shapes, tp_merge, f"--tp-merge {tp_merge}")
    if other_shape is not None:
        other_shape = tuple(other_shape)
        for d in range(len(first)):
            if len(other_shape) != len(first):
                break
            if sum(s[d] for s in shapes) != other_shape[d]:
                continue
            if all(s[:d] + s[d + 1 :] == other_shape[:d] + other_shape[d + 1 :] for s in shapes):
                return "concat", d, other_shape, None
    per_rank = ", ".join(str(list(s)) for s in shapes)
    want = f" into {list(other_shape)}" if other_shape is not None else ""
    return (
        "unmerged",
        None,
        first,
        f"per-rank shapes {per_rank} do not merge{want}; pass --tp-merge DIM",
    )


def _concat(shapes, d: int, why: str) -> tuple:
    nd = len(shapes[0])
    if not -nd <= d < nd:
        return "unmerged", None, shapes[0], f"{why}: dim {d} is out of range for shape {list(shapes[0])}"
    d = d % nd
    rest = {s[:d] + s[d + 1 :] for s in shapes}
    if len(rest) != 1:
        return "unmerged", None, shapes[0], f"{why}: pieces {[list(s) for s in shapes]} differ off dim {d}"
    merged = list(shapes[0])
    merged[d] = sum(s[d] for s in shapes)
    return "concat", d, tuple(merged), None


def order_pieces(pieces: list[Entry]) -> list[Entry]:
    """Pieces in concatenation order: manifest shard index when present, else rank."""

    def key(e: Entry):
        m = e.shard if isinstance(e.shard, dict) else {}
        return (m.get("index", e.rank) if m else e.rank, e.rank)

    return sorted(pieces, key=key)


def load_logical(t: Logical, dequant_piece=None):
    """Materialise a logical tensor: pieces loaded (and dequantised) one rank at a time, merged."""
    import torch

    if t.build is not None:
        return t.build()
    scale_by_rank = {}
    if t.scale is not None:
        scale_by_rank = {e.rank: e for e in t.scale.entries}

    def piece(e: Entry):
        x = e.load()
        if dequant_piece is not None and t.scale is not None:
            s = scale_by_rank.get(e.rank) or t.scale.entries[0]
            x = dequant_piece(x, s.load(), t.name)
        return x

    if t.plan in ("single", "unmerged"):
        return piece(t.entries[0])
    if t.plan == "replicated":
        base = piece(t.entries[0])
        t.replica_mismatch = []
        for e in t.entries[1:]:
            other = piece(e)
            if other.dtype != base.dtype or not torch.equal(_bytes(other), _bytes(base)):
                t.replica_mismatch.append(e.rank)
            del other
        return base
    return torch.cat([piece(e) for e in order_pieces(t.entries)], dim=t.dim)


def _bytes(x):
    import torch

    x = x.contiguous().reshape(-1)
    return x.view(torch.uint8) if x.dtype != torch.bool else x
