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
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field

from ffdebug.weights.sketch import COLS, ROWS, Sketch, sketch

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

    def where(self) -> str:
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
    kind: str  # whole | fused | stacked
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
    """The block of composite tensor `x` that `seg` describes, in the part's layout."""
    y = x[seg.slot] if seg.slot is not None else x
    y = y.narrow(seg.axis if y.dim() > 1 else 0, seg.offset, seg.size)
    return (y.t() if seg.transposed else y).contiguous()


def cut_shape(shape: tuple[int, ...], seg: Segment) -> tuple[int, ...]:
    s = list(shape[1:] if seg.slot is not None else shape)
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
    """(position, needle index, length) of each needle found in sketch line `hay`."""
    import torch

    h = hay.values
    n = h.numel()
    tol = TOL * hay.rms + 1e-300
    if not needles or n == 0:
        return []
    firsts = torch.tensor([float(v[0]) for _, v in needles], dtype=torch.float64)
    order = torch.argsort(firsts)
    sf = firsts[order]
    lo = torch.searchsorted(sf, h - tol)
    hi = torch.searchsorted(sf, h + tol, right=True)
    counts = hi - lo
    total = int(counts.sum())
    if total == 0:
        return []
    pos = torch.repeat_interleave(torch.arange(n), counts)
    starts = torch.repeat_interleave(lo, counts)
    base = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    k = order[starts + torch.arange(total) - base]
    lengths = torch.tensor([v.numel() for _, v in needles])[k]
    end = pos + lengths
    ok = (end <= n) & ((pos // hay.slot) == ((end - 1) // hay.slot))
    out = []
    for p, kk, ln in zip(pos[ok].tolist(), k[ok].tolist(), lengths[ok].tolist()):
        v = needles[kk][1]
        if torch.allclose(h[p : p + ln], v, rtol=0.0, atol=tol):
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
    import torch

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
            if ln is not None and torch.allclose(ln.values, mine.values, rtol=0.0, atol=tol):
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
        tiling = _tile(hay.values.numel(), hay.slot, hits)
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
        return sk.shape, float(x.reshape(-1)[0])

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
            if rl is None or rl.values.numel() != tl.values.numel():
                continue
            a, b = tl.values, rl.values
            den = float(a.norm() * b.norm())
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


# ------------------------------------------------------------------------------------------------
# 2. verification


def _verify(f: _Found, load_comp, load_part) -> bool:
    """Every block of the composite within the ok band of its part (one part in memory)."""
    from ffdebug import verdict as V
    from ffdebug.compare.metrics import compare_tensors

    x = load_comp(f.composite)
    for slot, axis, offset, size, transposed, names in f.blocks:
        seg = Segment(names[0], slot, axis, offset, size, transposed)
        y = cut(x, seg)
        p = load_part(names[0])
        if tuple(y.shape) != tuple(p.shape):
            return False
        if f.scale is not None:
            y = y.double() / f.scale
        m = compare_tensors(p, y)
        if not V.is_ok(V.classify(m.cos, m.rel)):
            return False
    return True


# ------------------------------------------------------------------------------------------------
# 3. rules


def _pattern(f_side: str, comp: str, blocks, chosen: list[str]) -> tuple:
    tpl, nums = _numbers(comp)
    per_slot: dict = {}
    for (slot, axis, offset, size, transposed, _), name in zip(blocks, chosen):
        per_slot.setdefault(slot, []).append((_relative(name, nums, slot), axis, offset, size, transposed))
    return (f_side, tpl), [tuple(v) for v in per_slot.values()]


def _kind(shape: tuple, blocks) -> str:
    if len(shape) == 3 and blocks and blocks[0][0] is not None:
        return "stacked"
    return "whole" if len(blocks) == 1 else "fused"


def _segments_from(pattern: tuple, comp: str, shape: tuple) -> tuple[Segment, ...] | None:
    _, nums = _numbers(comp)
    slots = range(shape[0]) if len(shape) == 3 and pattern and pattern[0] is not None else [None]
    segs = []
    for slot in slots:
        for rel, axis, offset, size, transposed in pattern[1]:
            name = _fill(rel, nums, slot)
            if name is None:
                return None
            segs.append(Segment(name, slot, axis, offset, size, transposed))
    return tuple(segs)


def relate(ref_shapes: dict, tgt_shapes: dict, load_ref, load_tgt) -> ContentPlan:
    """Relations between the unpaired tensors of each side (names → shapes; `load_*(name)` reads
    one tensor as the comparison would)."""
    t0 = time.perf_counter()
    ref = {n: s for n in ref_shapes if (s := sketch(n, load_ref(n))) is not None}
    tgt = {n: s for n in tgt_shapes if (s := sketch(n, load_tgt(n))) is not None}
    loads = {"ref": load_ref, "target": load_tgt}
    other = {"ref": "target", "target": "ref"}
    found: list[_Found] = []
    for sk in tgt.values():
        if not sk.constant and (f := _blocks_of(sk, "target", ref)) is not None:
            found.append(f)
    whole_parts = {n for f in found for b in f.blocks for n in b[5]}
    comp_done = {f.composite for f in found}
    for sk in ref.values():
        if sk.constant or sk.name in whole_parts:
            continue
        f = _blocks_of(sk, "ref", {n: s for n, s in tgt.items() if n not in comp_done})
        if f is not None and len(f.blocks) > 1:
            found.append(f)
    found += _constant_pairs(ref, tgt, load_ref, load_tgt)
    used_t = {f.composite for f in found if f.side == "target"} | {
        n for f in found if f.side == "ref" for b in f.blocks for n in b[5]
    }
    used_r = {f.composite for f in found if f.side == "ref"} | {
        n for f in found if f.side == "target" for b in f.blocks for n in b[5]
    }
    found += _scaled_pairs(
        {n: s for n, s in ref.items() if n not in used_r}, {n: s for n, s in tgt.items() if n not in used_t}
    )

    # 2. verify the unique ones now; ambiguous ones once their names are chosen
    verified = []
    for f in found:
        if not f.unique or _verify(f, loads[f.side], loads[other[f.side]]):
            verified.append(f)

    # 3. conventions from unambiguous relations
    votes: dict[tuple, Counter] = {}
    for f in verified:
        if f.unique:
            key, pats = _pattern(f.side, f.composite, f.blocks, [b[5][0] for b in f.blocks])
            slot_tag = f.blocks[0][0] is not None
            for p in pats:
                votes.setdefault(key, Counter())[(slot_tag, p)] += 1
    convention = {k: c.most_common(1)[0][0] for k, c in votes.items()}

    relations: list[Relation] = []
    taken: dict[str, set[str]] = {"ref": set(), "target": set()}
    notes: list[str] = []
    for f in verified:
        part_side = other[f.side]
        key = (f.side, _numbers(f.composite)[0])
        conv = convention.get(key)
        conv_segs = _segments_from(_as_pattern(conv), f.composite, f.shape) if conv else None
        _, nums = _numbers(f.composite)
        chosen = []
        for slot, axis, offset, _size, _transposed, names in f.blocks:
            free = [n for n in names if n not in taken[part_side] and n not in chosen]
            pick = None
            if conv_segs:
                pick = next(
                    (
                        s.part
                        for s in conv_segs
                        if s.slot == slot and s.offset == offset and s.axis == axis and s.part in free
                    ),
                    None,
                )
            if pick is None and free:
                same = [n for n in free if _numbers(n)[1][: len(nums)] == nums]
                pick = (same or free)[0]
            if pick is None:
                break
            chosen.append(pick)
        if len(chosen) != len(f.blocks):
            continue
        if f.side in taken and f.composite in taken[f.side]:
            continue
        if not f.unique:
            probe_f = _Found(
                f.side, f.composite, f.shape, [b[:5] + ([c],) for b, c in zip(f.blocks, chosen)], f.scale
            )
            if not _verify(probe_f, loads[f.side], loads[part_side]):
                continue
        segs = tuple(Segment(c, b[0], b[1], b[2], b[3], b[4]) for b, c in zip(f.blocks, chosen))
        compared, found_layout = segs, None
        if conv_segs and set(s.part for s in conv_segs) == set(chosen) and len(conv_segs) == len(segs):
            if conv_segs != segs:
                compared, found_layout = conv_segs, segs
        taken[f.side].add(f.composite)
        taken[part_side].update(chosen)
        relations.append(
            Relation(
                f.side,
                f.composite,
                f.shape,
                _kind(f.shape, f.blocks),
                compared,
                found_layout,
                scale=f.scale,
                ambiguous=not f.unique,
            )
        )

    # 4. left-overs covered by a convention: paired by the rule
    shapes = {"ref": ref_shapes, "target": tgt_shapes}
    for side in ("target", "ref"):
        part_side = other[side]
        for name, shape in shapes[side].items():
            if name in taken[side]:
                continue
            conv = convention.get((side, _numbers(name)[0]))
            segs = _segments_from(_as_pattern(conv), name, tuple(shape)) if conv else None
            if not segs or any(s.part not in shapes[part_side] or s.part in taken[part_side] for s in segs):
                continue
            if any(cut_shape(tuple(shape), s) != tuple(shapes[part_side][s.part]) for s in segs):
                continue
            taken[side].add(name)
            taken[part_side].update(s.part for s in segs)
            kind = "stacked" if segs[0].slot is not None else ("whole" if len(segs) == 1 else "fused")
            relations.append(Relation(side, name, tuple(shape), kind, segs, how="name rule"))

    rules = []
    for (side, tpl), conv in convention.items():
        slot_tag, pat = conv
        parts = " + ".join(_show(rel) + (".T" if t else "") for rel, *_, t in pat)
        rules.append(f"{side} {tpl} = {parts}" + (" (per expert slot)" if slot_tag else ""))
    return ContentPlan(
        relations=relations,
        unmatched_ref=[n for n in ref_shapes if n not in taken["ref"]],
        unmatched_target=[n for n in tgt_shapes if n not in taken["target"]],
        rules=sorted(rules),
        seconds=time.perf_counter() - t0,
        notes=notes,
    )


def _as_pattern(conv) -> tuple | None:
    """A convention (slot tag, per-slot blocks) as `_segments_from` takes it."""
    if conv is None:
        return None
    slot_tag, pat = conv
    return (0 if slot_tag else None, pat)
