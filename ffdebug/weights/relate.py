"""Content matching's steps 2-4 (`weights.content`'s docstring): verify the candidate relations,
learn the port's conventions, choose the part names, pair left-overs by the rule (docs/weights-diff.md,
"Content matching")."""

from __future__ import annotations

import time
from collections import Counter

from ffdebug.weights.content import (
    ContentPlan,
    Relation,
    Segment,
    _blocks_of,
    _constant_pairs,
    _fill,
    _Found,
    _numbers,
    _relative,
    _scaled_pairs,
    _show,
    cut_shape,
    segments_hold,
)
from ffdebug.weights.sketch import Sketch, sketch

_OTHER = {"ref": "target", "target": "ref"}


# ------------------------------------------------------------------------------------------------
# 2. verification


def _verify(f: _Found, load_comp, load_part) -> bool:
    """Every block of the composite within the ok band of its part (one part in memory)."""
    segs = [Segment(names[0], slot, axis, offset, size, t) for slot, axis, offset, size, t, names in f.blocks]
    return segments_hold(load_comp(f.composite), segs, load_part, f.scale)


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


def _candidates(ref: dict[str, Sketch], tgt: dict[str, Sketch], load_ref, load_tgt) -> list[_Found]:
    """1. Blocks (target composites first, then reference ones), constant pairs, scaled copies."""
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
    return found


def _conventions(verified: list[_Found]) -> dict:
    """3. The most common layout per (side, name template) among the unambiguous relations."""
    votes: dict[tuple, Counter] = {}
    for f in verified:
        if f.unique:
            key, pats = _pattern(f.side, f.composite, f.blocks, [b[5][0] for b in f.blocks])
            slot_tag = f.blocks[0][0] is not None
            for p in pats:
                votes.setdefault(key, Counter())[(slot_tag, p)] += 1
    return {k: c.most_common(1)[0][0] for k, c in votes.items()}


def _choose(f: _Found, conv_segs, taken: set[str]) -> list[str] | None:
    """The part name of each block: where the convention puts it, else one with the composite's
    numbers, else the first free one; None when a block has no free name."""
    _, nums = _numbers(f.composite)
    chosen: list[str] = []
    for slot, axis, offset, _size, _transposed, names in f.blocks:
        free = [n for n in names if n not in taken and n not in chosen]
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
            return None
        chosen.append(pick)
    return chosen


def _relation(f: _Found, convention: dict, taken: dict[str, set[str]], loads: dict) -> Relation | None:
    """3. One verified candidate as a relation, compared at the convention's layout."""
    part_side = _OTHER[f.side]
    conv = convention.get((f.side, _numbers(f.composite)[0]))
    conv_segs = _segments_from(_as_pattern(conv), f.composite, f.shape) if conv else None
    chosen = _choose(f, conv_segs, taken[part_side])
    if chosen is None or f.composite in taken[f.side]:
        return None
    if not f.unique:
        probe = _Found(
            f.side, f.composite, f.shape, [b[:5] + ([c],) for b, c in zip(f.blocks, chosen)], f.scale
        )
        if not _verify(probe, loads[f.side], loads[part_side]):
            return None
    segs = tuple(Segment(c, b[0], b[1], b[2], b[3], b[4]) for b, c in zip(f.blocks, chosen))
    compared, found_layout = segs, None
    if conv_segs and set(s.part for s in conv_segs) == set(chosen) and len(conv_segs) == len(segs):
        if conv_segs != segs:
            compared, found_layout = conv_segs, segs
    taken[f.side].add(f.composite)
    taken[part_side].update(chosen)
    kind = _kind(f.shape, f.blocks)
    return Relation(
        f.side, f.composite, f.shape, kind, compared, found_layout, scale=f.scale, ambiguous=not f.unique
    )


def _by_rule(shapes: dict, convention: dict, taken: dict[str, set[str]]) -> list[Relation]:
    """4. Left-overs a convention covers, paired by the rule."""
    out = []
    for side in ("target", "ref"):
        part_side = _OTHER[side]
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
            out.append(Relation(side, name, tuple(shape), kind, segs, how="name rule"))
    return out


def _rule_lines(convention: dict) -> list[str]:
    rules = []
    for (side, tpl), conv in convention.items():
        slot_tag, pat = conv
        parts = " + ".join(_show(rel) + (".T" if t else "") for rel, *_, t in pat)
        rules.append(f"{side} {tpl} = {parts}" + (" (per expert slot)" if slot_tag else ""))
    return sorted(rules)


def relate(ref_shapes: dict, tgt_shapes: dict, load_ref, load_tgt) -> ContentPlan:
    """Relations between the unpaired tensors of each side (names → shapes; `load_*(name)` reads
    one tensor as the comparison would); the steps are `weights.content`'s docstring. A 3-D
    tensor still unmatched on one side while tensors are left on the other is then taken apart
    into its slots (`name[h]`: a per-head split such as an absorbed MLA's `W_kc` / `W_vc` cut
    from `kv_b`) and the leftovers are related again; `plan.split_slots` names those cut."""
    plan = _by_slots(
        _relate_once(ref_shapes, tgt_shapes, load_ref, load_tgt), ref_shapes, tgt_shapes, load_ref, load_tgt
    )
    return _by_rows(plan, ref_shapes, tgt_shapes, load_ref, load_tgt)


def _by_rows(plan: ContentPlan, ref_shapes: dict, tgt_shapes: dict, load_ref, load_tgt) -> ContentPlan:
    """The gather pass over what blocks and slots left (`weights.gather`)."""
    from ffdebug.weights.gather import gathered

    left = {"ref": plan.unmatched_ref, "target": plan.unmatched_target}
    if not (left["ref"] and left["target"]):
        return plan
    t0 = time.perf_counter()
    shapes = {"ref": ref_shapes, "target": tgt_shapes}
    found = gathered(shapes, left, {"ref": load_ref, "target": load_tgt}, plan.relations)
    plan.relations += found.relations
    plan.rules = sorted(set(plan.rules) | set(found.rules))
    plan.unmatched_ref = [n for n in plan.unmatched_ref if n not in found.used["ref"]]
    plan.unmatched_target = [n for n in plan.unmatched_target if n not in found.used["target"]]
    plan.seconds += time.perf_counter() - t0
    return plan


def _by_slots(plan: ContentPlan, ref_shapes: dict, tgt_shapes: dict, load_ref, load_tgt) -> ContentPlan:
    """The slot pass: 3-D leftovers cut into `name[h]` and related again."""
    left = {"ref": plan.unmatched_ref, "target": plan.unmatched_target}
    shapes = {"ref": ref_shapes, "target": tgt_shapes}
    cubes = {side: [n for n in left[side] if len(shapes[side][n]) == 3] for side in left}
    if not (cubes["ref"] or cubes["target"]) or not (left["ref"] and left["target"]):
        return plan
    slotted, loads = {}, {}
    for side, load in (("ref", load_ref), ("target", load_tgt)):
        flat = {n: shapes[side][n] for n in left[side] if n not in cubes[side]}
        owner: dict[str, tuple[str, int]] = {}
        for n in cubes[side]:
            for h in range(shapes[side][n][0]):
                flat[f"{n}[{h}]"] = tuple(shapes[side][n][1:])
                owner[f"{n}[{h}]"] = (n, h)
        slotted[side] = (flat, owner)
        loads[side] = lambda name, load=load, owner=owner: (
            load(owner[name][0])[owner[name][1]] if name in owner else load(name)
        )
    again = _relate_once(slotted["ref"][0], slotted["target"][0], loads["ref"], loads["target"])
    if not again.relations:
        return plan
    plan.relations += again.relations
    plan.rules = sorted(set(plan.rules) | set(again.rules))
    for side, attr in (("ref", "unmatched_ref"), ("target", "unmatched_target")):
        flat, owner = slotted[side]
        unmatched = set(getattr(again, attr))
        whole = [
            n for n in cubes[side] if not any(f"{n}[{h}]" in unmatched for h in range(shapes[side][n][0]))
        ]
        plan.split_slots[side] = whole
        kept = [n for n in getattr(again, attr) if n not in owner] + [
            n for n in cubes[side] if n not in whole
        ]
        setattr(plan, attr, kept)
    plan.seconds += again.seconds
    return plan


def _relate_once(ref_shapes: dict, tgt_shapes: dict, load_ref, load_tgt) -> ContentPlan:
    """One pass of the steps over these tensors."""
    t0 = time.perf_counter()
    ref = {n: s for n in ref_shapes if (s := sketch(n, load_ref(n))) is not None}
    tgt = {n: s for n in tgt_shapes if (s := sketch(n, load_tgt(n))) is not None}
    loads = {"ref": load_ref, "target": load_tgt}
    found = _candidates(ref, tgt, load_ref, load_tgt)
    # 2. verify the unique ones now; ambiguous ones once their names are chosen
    verified = [f for f in found if not f.unique or _verify(f, loads[f.side], loads[_OTHER[f.side]])]
    convention = _conventions(verified)
    taken: dict[str, set[str]] = {"ref": set(), "target": set()}
    relations = [r for f in verified if (r := _relation(f, convention, taken, loads)) is not None]
    relations += _by_rule({"ref": ref_shapes, "target": tgt_shapes}, convention, taken)
    return ContentPlan(
        relations=relations,
        unmatched_ref=[n for n in ref_shapes if n not in taken["ref"]],
        unmatched_target=[n for n in tgt_shapes if n not in taken["target"]],
        rules=_rule_lines(convention),
        seconds=time.perf_counter() - t0,
        notes=[],
    )


def _as_pattern(conv) -> tuple | None:
    """A convention (slot tag, per-slot blocks) as `_segments_from` takes it."""
    if conv is None:
        return None
    slot_tag, pat = conv
    return (0 if slot_tag else None, pat)
