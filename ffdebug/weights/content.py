"""Relate tensors by content when their names do not match (docs/weights-diff.md, "Content
matching").

Input: the tensors left unpaired by the name options on each side. Every one is sketched once,
one at a time (`weights.sketch`). Then:

1. **Blocks.** Each tensor's row / column sketch is searched for the sketches of the other side's
   tensors (same probe width; a row sketch found in a column sketch is a transposed copy). A
   tensor exactly tiled by others is *whole* (one tensor: equal or transposed), *fused* (several,
   along rows or columns) or *stacked* (3-D: each expert slot tiled). Constant tensors (zeros,
   ones) pair whole only, by value. Left-over pairs of one shape (or its transpose) with
   proportional sketches are *scaled* copies.
2. **Verification.** Every relation is checked on the tensors in full (the composite and one part
   in memory): each block within the ok band of the part.
3. **Rules.** Each relation, its names' numbers generalised (`blocks.#.attn.wqkv.weight` holds
   `model.layers.{0}.self_attn.q_proj.weight` + …, an expert part `experts.{slot}.…`), votes for
   its template's layout; the most common one is the port's convention. Blocks of identical
   content go to the name the convention predicts. A composite whose content differs from the
   convention is compared *at the convention* and keeps the layout found (`found`): a fused part
   swapped, an expert stack permuted.
4. **Left-overs.** A tensor no content matched, whose name the convention covers (an unloaded
   tensor), is paired by that rule (`how="name rule"`) so that its numbers are still compared.

This module holds the types and step 1; `weights.relate` runs the steps (`relate`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ffdebug.weights.sketch import COLS, ROWS, Sketch

_NUM = re.compile(r"^\d+$")
TOL = 2e-3  # sketch agreement, relative to the searched sketch's rms (bf16 rounding ≈ 4e-3 / √C)
SCALED_COS = 0.9999


@dataclass(frozen=True)
class Segment:
    """Where the part tensor `part` (other side) lies in a composite: expert `slot` (3-D) or the
    whole tensor (None), `size` rows (axis 0) or columns (axis 1) from `offset`, maybe transposed."""

    part: str
    slot: int | None
    axis: int
    offset: int
    size: int
    transposed: bool = False
    rows: tuple[int, ...] | None = None  # a gather: the composite's rows holding the part's, in order

    def where(self) -> str:
        if self.rows is not None:
            from ffdebug.weights.rows import describe

            return f"[rows {describe(list(self.rows))}]"
        idx = [] if self.slot is None else [str(self.slot)]
        span = f"{self.offset}:{self.offset + self.size}"
        idx += [span] if self.axis == ROWS else [":", span]
        return f"[{', '.join(idx)}]" + (".T" if self.transposed else "")


@dataclass
class Relation:
    """A tensor of `side` (the composite) and the other side's tensors it holds."""

    side: str  # "ref" | "target": the side holding the composite
    composite: str
    shape: tuple[int, ...]
    kind: str  # whole | fused | stacked | gathered
    segments: tuple[Segment, ...]  # the layout compared: the convention of the port's names
    found: tuple[Segment, ...] | None = None  # the layout the content has, where it differs
    how: str = "content"  # content | name rule
    scale: float | None = None
    ambiguous: bool = False  # blocks of identical content paired by name

    @property
    def parts(self) -> list[str]:
        return [s.part for s in self.segments]

    def to_json(self) -> dict:
        out = {
            "side": self.side,
            "tensor": self.composite,
            "kind": self.kind,
            "how": self.how,
            "parts": [{"name": s.part, "at": s.where()} for s in self.segments],
        }
        if self.found is not None:
            out["found"] = [{"name": s.part, "at": s.where()} for s in self.found]
        if self.scale is not None:
            out["scale"] = self.scale
        if self.ambiguous:
            out["ambiguous"] = True
        return out


@dataclass
class ContentPlan:
    relations: list[Relation]
    unmatched_ref: list[str]
    unmatched_target: list[str]
    rules: list[str]
    seconds: float
    notes: list[str] = field(default_factory=list)
    split_slots: dict[str, list[str]] = field(default_factory=dict)  # side -> 3-D tensors cut into `name[h]`

    def to_json(self) -> dict:
        return {
            "relations": [r.to_json() for r in self.relations],
            "unmatched_ref": self.unmatched_ref,
            "unmatched_target": self.unmatched_target,
            "rules": self.rules,
            "seconds": round(self.seconds, 3),
            "notes": self.notes,
        }


def cut(x, seg: Segment):
    """The block of composite array `x` that `seg` describes, in the part's layout (contiguous)."""
    import numpy as np

    y = x[seg.slot] if seg.slot is not None else x
    if seg.rows is not None:
        return y[list(seg.rows)]
    axis = seg.axis if y.ndim > 1 else 0
    y = y[(slice(None),) * axis + (slice(seg.offset, seg.offset + seg.size),)]
    return np.ascontiguousarray(y.T if seg.transposed else y)


def segments_hold(x, segments, load_part, scale: float | None = None) -> bool:
    """Every segment of composite tensor `x` within the ok band of its part (`load_part(name)`,
    one part in memory), after dividing by `scale` for a scaled copy."""
    from ffdebug import verdict as V
    from ffdebug.comparison.metrics import compare_tensors

    for seg in segments:
        y = cut(x, seg)
        p = load_part(seg.part)
        if tuple(y.shape) != tuple(p.shape):
            return False
        if scale is not None:
            from ffdebug.arrays import as_float64

            y = as_float64(y) / scale
        m = compare_tensors(p, y)
        if not V.is_ok(V.classify(m.cos, m.rel)):
            return False
    return True


def cut_shape(shape: tuple[int, ...], seg: Segment) -> tuple[int, ...]:
    s = list(shape[1:] if seg.slot is not None else shape)
    if seg.rows is not None:
        return (len(seg.rows), *s[1:])
    s[seg.axis if len(s) > 1 else 0] = seg.size
    return tuple(s[::-1] if seg.transposed else s)


# ------------------------------------------------------------------------------------------------
# names


def _numbers(name: str) -> tuple[str, tuple[int, ...]]:
    comps = name.split(".")
    return ".".join("#" if _NUM.match(c) else c for c in comps), tuple(int(c) for c in comps if _NUM.match(c))


def _relative(part: str, nums: tuple[int, ...], slot: int | None) -> tuple:
    """A part's name relative to its composite's numbers (`{0}`) and expert slot."""
    tpl, pnums = _numbers(part)
    mapping, j = [], 0
    for m in pnums:
        if j < len(nums) and m == nums[j]:
            mapping.append(("n", j))
            j += 1
        elif slot is not None and m == slot:
            mapping.append(("slot",))
        else:
            mapping.append(("lit", m))
    return tpl, tuple(mapping)


def _fill(rel: tuple, nums: tuple[int, ...], slot: int | None) -> str | None:
    tpl, mapping = rel
    vals = []
    for m in mapping:
        if m[0] == "n":
            if m[1] >= len(nums):
                return None
            vals.append(str(nums[m[1]]))
        elif m[0] == "slot":
            if slot is None:
                return None
            vals.append(str(slot))
        else:
            vals.append(str(m[1]))
    it = iter(vals)
    return ".".join(next(it) if c == "#" else c for c in tpl.split("."))


def _show(rel: tuple) -> str:
    tpl, mapping = rel
    it = iter(mapping)
    return ".".join(
        ("{slot}" if m[0] == "slot" else f"{{{m[1]}}}" if m[0] == "n" else str(m[1]))
        if c == "#" and (m := next(it))
        else c
        for c in tpl.split(".")
    )


# ------------------------------------------------------------------------------------------------
# 1. blocks


def _search(hay, needles: list[tuple[int, object]]) -> list[tuple[int, int, int]]:
    """(position, needle index, length) of each needle found in sketch line `hay`: every position
    whose value is within tol of a needle's first value (binary search in the sorted first
    values), then the whole needle compared there."""
    import numpy as np

    h = hay.values
    n = h.size
    tol = TOL * hay.rms + 1e-300
    if not needles or n == 0:
        return []
    firsts = np.array([float(v[0]) for _, v in needles], dtype=np.float64)
    order = np.argsort(firsts, kind="stable")
    sf = firsts[order]
    lo = np.searchsorted(sf, h - tol, side="left")
    hi = np.searchsorted(sf, h + tol, side="right")
    counts = hi - lo
    total = int(counts.sum())
    if total == 0:
        return []
    pos = np.repeat(np.arange(n), counts)  # one (position, candidate) pair per match of a first value
    starts = np.repeat(lo, counts)
    base = np.repeat(np.cumsum(counts) - counts, counts)
    k = order[starts + np.arange(total) - base]
    lengths = np.array([v.size for _, v in needles])[k]
    end = pos + lengths
    ok = (end <= n) & ((pos // hay.slot) == ((end - 1) // hay.slot))
    out = []
    for p, kk, ln in zip(pos[ok].tolist(), k[ok].tolist(), lengths[ok].tolist()):
        v = needles[kk][1]
        if np.allclose(h[p : p + ln], v, rtol=0.0, atol=tol):
            out.append((p, kk, ln))
    return out


def _tile(total: int, slot: int, hits: list[tuple[int, int, int]]) -> list[tuple[int, int, list[int]]] | None:
    """An exact cover of [0, total) by hits (no block crossing a slot), longest blocks first:
    [(position, length, needle indices of identical content)]."""
    at: dict[int, dict[int, list[int]]] = {}
    for p, k, ln in hits:
        at.setdefault(p, {}).setdefault(ln, []).append(k)
    dead: set[int] = set()

    def go(p: int) -> list | None:
        if p == total:
            return []
        if p in dead:
            return None
        for ln in sorted(at.get(p, {}), reverse=True):
            if p // slot != (p + ln - 1) // slot:
                continue
            rest = go(p + ln)
            if rest is not None:
                return [(p, ln, at[p][ln])] + rest
        dead.add(p)
        return None

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 4 * total + 100))
    try:
        return go(0)
    finally:
        sys.setrecursionlimit(limit)


@dataclass
class _Found:
    side: str
    composite: str
    shape: tuple[int, ...]
    blocks: list[tuple[int | None, int, int, int, bool, list[str]]]  # slot, axis, offset, size, T, names
    scale: float | None = None

    @property
    def unique(self) -> bool:
        return all(len(b[5]) == 1 for b in self.blocks)


def _whole_of(sk: Sketch, side: str, others: dict[str, Sketch]) -> _Found | None:
    """The other side's tensors equal to `sk` whole (same shape, or 2-D transposed)."""
    import numpy as np

    mine = sk.line(ROWS)
    tol = TOL * mine.rms + 1e-300
    for transposed in (False, True):
        want = sk.shape[::-1] if transposed else sk.shape
        if transposed and (len(sk.shape) != 2 or want == sk.shape):
            continue
        names = []
        for o in others.values():
            if o.shape != want or o.constant:
                continue
            ln = o.line(COLS if transposed else ROWS)
            if ln is not None and np.allclose(ln.values, mine.values, rtol=0.0, atol=tol):
                names.append(o.name)
        if names:
            size = sk.shape[0] if sk.shape else 1
            return _Found(side, sk.name, sk.shape, [(None, ROWS, 0, size, transposed, names)])
    return None


def _blocks_of(sk: Sketch, side: str, others: dict[str, Sketch]) -> _Found | None:
    """The other side's tensors that tile `sk` (rows or columns), else None."""
    whole = _whole_of(sk, side, others)
    if whole is not None:
        return whole
    cands = [o for o in others.values() if not o.constant and o.name != sk.name]
    for hay in sk.lines:
        needles, meta = [], []
        for o in cands:
            for ln in o.lines:
                if ln.width == hay.width and not (len(o.shape) < 2 and hay.axis == COLS):
                    needles.append((len(meta), ln.values))
                    meta.append((o.name, ln.axis != hay.axis))
        hits = _search(hay, needles)  # equal probe widths: every block spans the other dim whole
        tiling = _tile(hay.values.size, hay.slot, hits)
        if tiling is None:
            continue
        blocks = []
        for p, ln, ks in tiling:
            slot = p // hay.slot if len(sk.shape) == 3 and hay.axis == ROWS else None
            names = list(dict.fromkeys(meta[k][0] for k in ks))
            transposed = meta[ks[0]][1]
            blocks.append((slot, hay.axis, p % hay.slot if slot is not None else p, ln, transposed, names))
        if len(blocks) == 1 and len(sk.shape) != 3:
            shape_ok = [
                n for n in blocks[0][5] if others[n].shape == (sk.shape[::-1] if blocks[0][4] else sk.shape)
            ]
            if not shape_ok:
                continue
            b = blocks[0]
            blocks = [(b[0], b[1], b[2], b[3], b[4], shape_ok)]
        return _Found(side, sk.name, sk.shape, blocks)
    return None


def _constant_pairs(ref: dict[str, Sketch], tgt: dict[str, Sketch], load_ref, load_tgt) -> list[_Found]:
    """Constant tensors (zeros, ones, …): whole pairs of one shape and value, by name later."""

    def key(sk: Sketch, load):
        x = load(sk.name)
        return sk.shape, float(x.reshape(-1)[0])  # ml_dtypes' scalars convert with float() too

    rkeys: dict = {}
    for sk in ref.values():
        if sk.constant:
            rkeys.setdefault(key(sk, load_ref), []).append(sk.name)
    out = []
    for sk in tgt.values():
        if sk.constant:
            names = rkeys.get(key(sk, load_tgt))
            if names:
                out.append(
                    _Found(
                        "target",
                        sk.name,
                        sk.shape,
                        [(None, ROWS, 0, sk.shape[0] if sk.shape else 1, False, list(names))],
                    )
                )
    return out


def _scaled_pairs(ref: dict[str, Sketch], tgt: dict[str, Sketch]) -> list[_Found]:
    """Pairs of one shape (or transposed) whose row sketches are proportional, factor ≠ 1."""
    import numpy as np

    out = []
    for t in tgt.values():
        tl = t.line(ROWS)
        if t.constant or t.norm == 0:
            continue
        for r in ref.values():
            if r.constant or r.norm == 0:
                continue
            transposed = len(t.shape) == 2 and r.shape == t.shape[::-1] and r.shape != t.shape
            if r.shape != t.shape and not transposed:
                continue
            rl = r.line(COLS if transposed else ROWS)
            if rl is None or rl.values.size != tl.values.size:
                continue
            a, b = tl.values, rl.values
            den = float(np.linalg.norm(a) * np.linalg.norm(b))
            if den == 0:
                continue
            cos = float(a @ b) / den
            if cos >= SCALED_COS:
                size = t.shape[0] if t.shape else 1
                out.append(
                    _Found(
                        "target",
                        t.name,
                        t.shape,
                        [(None, ROWS, 0, size, transposed, [r.name])],
                        scale=t.norm / r.norm,
                    )
                )
                break
    return out
