"""Rank plans: how the per-rank parts of one tensor fold into the full tensor.

One module for compare (folding a multi-rank side onto a single-rank one), bisect (trying every
reading of undeclared shards) and weights-diff (merging tensor-parallel checkpoint shards).

- `Concat(dim)`: shards concatenated along `dim`, in part order (tensor parallel).
- `ConcatZigzag(dim, cp)`: context parallel with load balancing: the sequence dim is cut into
  `2*cp` chunks and rank r holds chunks r and 2cp-1-r, in that order (as SGLang and Megatron
  context parallel do).
- `Sum()`: partial sums before an all-reduce, accumulated in float64.
- `Replicated(rank)`: every rank holds the full tensor; `rank` stands for all.
- `Staged(steps)`: several folds in turn, each `(plan, groups)` folding groups of the current
  pieces into the next ones (SGLang `dims` sharded over more than one axis, `ffdebug.io.dims`).
- `ExpertGather(dim, experts)`: expert parallel: rank r holds the experts `experts[r]` (global
  ids, in its local order) stacked along `dim`; the fold orders all experts by global id.
  Without `experts`, ranks hold contiguous blocks in rank order.

`Plan.describe()` is the JSON string (`"sum"`, `"cat:DIM"`, `"replicated"`, …); `shape(shapes)`
is the folded shape, raising `PlanMismatch` when the parts cannot fold this way; `apply(parts)`
the folded tensor. `fold(parts, plan)` is a `Record` whose source is the plan over its parts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ffdebug.errors import FFDebugError
from ffdebug.io.record import Record

Shape = tuple[int, ...]


class PlanMismatch(ValueError):
    """The parts' shapes do not fold under this plan (the message says why)."""


class Plan:
    label = ""

    def describe(self) -> str:
        raise NotImplementedError

    def shape(self, shapes: Sequence[Shape]) -> Shape:
        raise NotImplementedError

    def apply(self, parts: Sequence):
        raise NotImplementedError

    def fits(self, shapes: Sequence[Shape]) -> bool:
        try:
            self.shape(shapes)
        except PlanMismatch:
            return False
        return True


def _norm_dim(dim: int, shape: Shape) -> int:
    nd = len(shape)
    if not -nd <= dim < nd:
        raise PlanMismatch(f"dim {dim} is out of range for shape {list(shape)}")
    return dim % nd


def _same_off(dim: int, shapes: Sequence[Shape]) -> int:
    d = _norm_dim(dim, shapes[0])
    if any(len(s) != len(shapes[0]) for s in shapes) or len({s[:d] + s[d + 1 :] for s in shapes}) != 1:
        raise PlanMismatch(f"pieces {[list(s) for s in shapes]} differ off dim {d}")
    return d


def _same(shapes: Sequence[Shape]) -> Shape:
    if len(set(map(tuple, shapes))) != 1:
        raise PlanMismatch(f"pieces {[list(s) for s in shapes]} differ in shape")
    return tuple(shapes[0])


@dataclass(frozen=True)
class Concat(Plan):
    dim: int
    label = "concat"

    def describe(self) -> str:
        return f"cat:{self.dim}"

    def shape(self, shapes):
        d = _same_off(self.dim, shapes)
        out = list(shapes[0])
        out[d] = sum(s[d] for s in shapes)
        return tuple(out)

    def apply(self, parts):
        import numpy as np

        return np.concatenate(list(parts), axis=self.dim)


@dataclass(frozen=True)
class ConcatZigzag(Plan):
    dim: int
    cp: int
    label = "zigzag"

    def describe(self) -> str:
        return f"zigzag:{self.dim}:{self.cp}"

    def shape(self, shapes):
        if len(shapes) != self.cp:
            raise PlanMismatch(f"{len(shapes)} parts for a context-parallel size of {self.cp}")
        d = _same_off(self.dim, shapes)
        if len({s[d] for s in shapes}) != 1 or shapes[0][d] % 2:
            raise PlanMismatch(f"zigzag parts need one even size along dim {d}, got {[s[d] for s in shapes]}")
        out = list(shapes[0])
        out[d] = sum(s[d] for s in shapes)
        return tuple(out)

    def apply(self, parts):
        import numpy as np

        self.shape([tuple(p.shape) for p in parts])
        chunks: list = [None] * (2 * self.cp)
        for r, p in enumerate(parts):
            first, second = np.split(p, 2, axis=self.dim)
            chunks[r], chunks[2 * self.cp - 1 - r] = first, second
        return np.concatenate(chunks, axis=self.dim)


@dataclass(frozen=True)
class Sum(Plan):
    label = "sum"

    def describe(self) -> str:
        return "sum"

    def shape(self, shapes):
        return _same(shapes)

    def apply(self, parts):
        from ffdebug.arrays import as_float64

        acc = as_float64(parts[0])
        for p in parts[1:]:
            acc += as_float64(p)
        return acc


@dataclass(frozen=True)
class Replicated(Plan):
    rank: int = 0
    label = "replicated"

    def describe(self) -> str:
        return "replicated"

    def shape(self, shapes):
        return tuple(shapes[self.rank])

    def apply(self, parts):
        return parts[self.rank]


@dataclass(frozen=True)
class ExpertGather(Plan):
    dim: int = 0
    experts: tuple[tuple[int, ...], ...] | None = None  # global expert ids per rank
    label = "experts"

    def describe(self) -> str:
        return f"experts:{self.dim}"

    def _ids(self, shapes) -> list[int]:
        d = _same_off(self.dim, shapes)
        if self.experts is None:
            return list(range(sum(s[d] for s in shapes)))
        if len(self.experts) != len(shapes):
            raise PlanMismatch(f"expert placement names {len(self.experts)} ranks, got {len(shapes)} parts")
        for r, (ids, s) in enumerate(zip(self.experts, shapes)):
            if len(ids) != s[d]:
                raise PlanMismatch(f"rank {r} holds {s[d]} experts along dim {d}, the placement {len(ids)}")
        ids = [i for rank_ids in self.experts for i in rank_ids]
        if sorted(ids) != list(range(len(ids))):
            raise PlanMismatch(
                f"expert placement {list(self.experts)} is not a permutation of 0..{len(ids) - 1}"
            )
        return ids

    def shape(self, shapes):
        d = _same_off(self.dim, shapes)
        out = list(shapes[0])
        out[d] = len(self._ids(shapes))
        return tuple(out)

    def apply(self, parts):
        import numpy as np

        ids = self._ids([tuple(p.shape) for p in parts])
        stacked = np.concatenate(list(parts), axis=self.dim)
        order = np.argsort(np.array(ids), kind="stable")
        return np.take(stacked, order, axis=self.dim)


@dataclass(frozen=True)
class Staged(Plan):
    steps: tuple[tuple[Plan, tuple[tuple[int, ...], ...]], ...]
    label = "staged"

    def describe(self) -> str:
        return "+".join(plan.describe() for plan, _ in self.steps)

    def _run(self, items: list, one):
        for plan, groups in self.steps:
            items = [one(plan, [items[i] for i in group]) for group in groups]
        if len(items) != 1:
            raise PlanMismatch(f"{len(items)} pieces left after {self.describe()}")
        return items[0]

    def shape(self, shapes):
        return self._run([tuple(s) for s in shapes], lambda plan, group: tuple(plan.shape(group)))

    def apply(self, parts):
        return self._run(list(parts), lambda plan, group: plan.apply(group))


def replica_mismatch(parts: Sequence) -> list[int]:
    """Indices of the parts whose bytes (or dtype) differ from part 0's."""
    import numpy as np

    def raw(x):
        return np.ascontiguousarray(x).reshape(-1).view(np.uint8)

    base = parts[0]
    return [
        i
        for i, p in enumerate(parts[1:], start=1)
        if p.dtype != base.dtype or p.shape != base.shape or not np.array_equal(raw(p), raw(base))
    ]


# ------------------------------------------------------------------------------------------------
# folded records


@dataclass(frozen=True)
class Folded:
    """A record source: `plan` applied to the parts' tensors, loaded one part after another."""

    plan: Plan
    parts: tuple[Record, ...]

    @property
    def origin(self) -> str:
        return self.parts[0].origin

    def load(self):
        return self.plan.apply([p.load() for p in self.parts])

    def verify(self) -> None:
        for p in self.parts:
            p.verify()


def manifest_plan(parts: Sequence[Record]) -> tuple[Plan, list[Record]]:
    """The plan the manifest declares for one stage's per-rank records, and the parts in fold
    order: summed when any says `reduction="partial"`, concatenated along `shard.dim` in shard
    index order when it gives a `shard` of more than one piece, else replicated (rank 0 stands)."""
    parts = sorted(parts, key=lambda r: r.rank)
    if any(p.reduction == "partial" for p in parts):
        return Sum(), parts
    shard = parts[0].shard
    if shard is not None and shard.count > 1:
        return Concat(shard.dim), sorted(parts, key=lambda r: r.shard.index if r.shard else 0)
    return Replicated(), parts


def fold(parts: Sequence[Record], plan: Plan) -> Record:
    """One record standing for `parts` folded by `plan` (rank 0 of a world of one)."""
    parts = tuple(parts)
    first = parts[0]
    shape = first.shape
    if first.shape and isinstance(plan, (Concat, ConcatZigzag, ExpertGather, Staged)):
        try:
            shape = plan.shape([p.shape for p in parts])
        except PlanMismatch as err:
            raise FFDebugError(
                f"{first.key}: the rank records do not fold as {plan.describe()} ({err}); "
                "check the shard tags of the dump"
            ) from None
    return dataclasses.replace(first, rank=0, world_size=1, shape=shape, source=Folded(plan, parts))
