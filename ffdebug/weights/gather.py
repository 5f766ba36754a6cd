"""Content matching's gather pass: a tensor left unmatched by blocks that is every row of the other
side's leftovers, each once, in another order (docs/weights-diff.md, "Content matching").

After the block and slot passes (`weights.relate`), the 2-D leftovers are fingerprinted row by row
(`weights.rows`); a leftover whose rows are all found among the other side's leftovers of its
width, every part used whole, is a *gather*: `wqkv` interleaved per head group, a q / k weight
permuted per head for another rotary layout, an MLA `kv_b` with per-head blocks reordered. Gathers
are verified in full, then vote, by name template, for the port's convention exactly as blocks do
(`relate._conventions`): a composite whose rows differ from its template's convention is compared
at the convention and keeps the rows it has (`found`), so a q / k swap in one layer's interleaved
qkv is `swapped`. A gathered `X.weight`'s `X.bias`, left over with its parts' biases, follows the
same rows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ffdebug.weights.content import TOL, Relation, Segment, _fill, _numbers, _relative, segments_hold
from ffdebug.weights.rows import describe, fingerprints, match_rows, rotary_note

_OTHER = {"ref": "target", "target": "ref"}


@dataclass(frozen=True)
class _Gather:
    side: str  # the side holding the composite
    composite: str
    shape: tuple[int, ...]
    parts: tuple[tuple[str, tuple[int, ...]], ...]  # (part, composite rows holding its rows), by first row

    def segments(self) -> tuple[Segment, ...]:
        return tuple(Segment(p, None, 0, 0, len(rows), rows=rows) for p, rows in self.parts)

    def pattern(self) -> tuple:
        """The layout with the part names relative to the composite's numbers."""
        _, nums = _numbers(self.composite)
        return tuple((_relative(p, nums, None), rows) for p, rows in self.parts)


@dataclass
class GatherPlan:
    relations: list[Relation]
    rules: list[str]
    used: dict[str, set[str]]


def _find(side: str, comps: dict, pool: dict, shapes: dict) -> list[_Gather]:
    """Every composite of `side` whose rows are a gather of `pool`'s tensors (fingerprints)."""
    out, taken = [], set()
    for name, fp in comps.items():
        width = shapes[side][name][-1]
        names = [n for n in pool if n not in taken and shapes[_OTHER[side]][n][-1] == width]
        if sum(pool[n].shape[0] for n in names) < fp.shape[0]:
            continue
        found = match_rows(fp, [pool[n] for n in names], TOL)
        if found is None:
            continue
        used = sorted(set(found.parts), key=found.parts.index)  # parts by their first composite row
        parts = tuple((names[i], tuple(found.rows_of(i))) for i in used)
        out.append(_Gather(side, name, tuple(shapes[side][name]), parts))
        taken.update(p for p, _ in parts)
    return out


def _verified(g: _Gather, loads: dict) -> bool:
    return segments_hold(loads[g.side](g.composite), g.segments(), loads[_OTHER[g.side]])


def _at_convention(g: _Gather, conv: tuple | None) -> tuple[tuple[Segment, ...], tuple[Segment, ...] | None]:
    """(segments compared, segments found where they differ): the convention's rows for the same
    parts, else the gather's own."""
    own = g.segments()
    if conv is None:
        return own, None
    _, nums = _numbers(g.composite)
    named = [(_fill(rel, nums, None), rows) for rel, rows in conv]
    if None in (n for n, _ in named) or {n for n, _ in named} != {p for p, _ in g.parts}:
        return own, None
    if len({r for _, rows in named for r in rows}) != g.shape[0]:
        return own, None
    compared = tuple(Segment(n, None, 0, 0, len(rows), rows=rows) for n, rows in named)
    by_part = {s.part: s for s in own}
    found = tuple(by_part[s.part] for s in compared)
    return (compared, None) if found == compared else (compared, found)


def _rule(side: str, template: str, conv: tuple) -> str:
    from ffdebug.weights.content import _show

    parts = " + ".join(f"{_show(rel)}[rows {describe(list(rows))}]" for rel, rows in conv)
    notes = {n for _, rows in conv if (n := rotary_note(list(rows)))}
    return f"{side} {template} = {parts}" + (f" ({'; '.join(sorted(notes))})" if notes else "")


def _scattered(conv: tuple) -> bool:
    """A convention some part of which is not one run of rows (the block rules already say the rest)."""
    return any(list(rows) != list(range(rows[0], rows[0] + len(rows))) for _, rows in conv)


def _bias_of(name: str) -> str | None:
    return name[: -len("weight")] + "bias" if name.endswith(".weight") else None


def _companions(rel: Relation, left: dict[str, set[str]], shapes: dict, loads: dict) -> Relation | None:
    """`X.bias` of a gathered `X.weight`, its parts' biases left over with the right lengths, in the
    same rows (verified)."""
    comp = _bias_of(rel.composite)
    side, other = rel.side, _OTHER[rel.side]
    if comp is None or comp not in left[side] or len(shapes[side][comp]) != 1:
        return None
    segs = []
    for seg in rel.segments:
        part = _bias_of(seg.part)
        if part is None or part not in left[other] or tuple(shapes[other][part]) != (len(seg.rows),):
            return None
        segs.append(Segment(part, None, 0, 0, len(seg.rows), rows=seg.rows))
    g = _Gather(side, comp, tuple(shapes[side][comp]), tuple((s.part, s.rows) for s in segs))
    found = None
    if rel.found is not None:
        by = {s.part: s.rows for s in rel.found}
        found = tuple(
            Segment(s.part, None, 0, 0, len(s.rows), rows=by[p.part]) for s, p in zip(segs, rel.segments)
        )
    probe = g if found is None else _Gather(side, comp, g.shape, tuple((s.part, s.rows) for s in found))
    if not _verified(probe, loads):
        return None
    return Relation(side, comp, g.shape, "gathered", tuple(segs), found)


def _as_rows(rel: Relation) -> _Gather | None:
    """A row-block relation of the earlier passes in gather terms (it votes for its template)."""
    if rel.kind not in ("whole", "fused") or rel.scale is not None or len(rel.shape) != 2:
        return None
    if any(s.slot is not None or s.axis != 0 or s.transposed or s.rows is not None for s in rel.segments):
        return None
    parts = tuple((s.part, tuple(range(s.offset, s.offset + s.size))) for s in rel.segments)
    return _Gather(rel.side, rel.composite, rel.shape, parts)


def gathered(shapes: dict, left: dict[str, list[str]], loads: dict, known: list[Relation]) -> GatherPlan:
    """Relations between the 2-D leftovers of each side (`shapes[side]`: name → shape; `left[side]`:
    the names still unmatched; `loads[side](name)`: the tensor); the row-block relations `known`
    from the earlier passes vote for their templates' conventions too (a layer whose rows moved
    while the others' are plain copies is compared at the copy's rows)."""
    fps = {
        side: {n: fingerprints(loads[side](n)) for n in left[side] if len(shapes[side][n]) == 2}
        for side in ("ref", "target")
    }
    found: list[_Gather] = []
    for side in ("target", "ref"):
        done = {p for g in found for p, _ in g.parts} | {g.composite for g in found}
        comps = {n: f for n, f in fps[side].items() if n not in done}
        pool = {n: f for n, f in fps[_OTHER[side]].items() if n not in done}
        found += [g for g in _find(side, comps, pool, shapes) if len(g.parts) > 1 or side == "target"]
    verified = [g for g in found if _verified(g, loads)]
    votes: dict[tuple, Counter] = {}
    for g in verified + [g for r in known if (g := _as_rows(r)) is not None]:
        votes.setdefault((g.side, _numbers(g.composite)[0]), Counter())[g.pattern()] += 1
    convention = {k: c.most_common(1)[0][0] for k, c in votes.items()}
    relations, used = [], {"ref": set(), "target": set()}
    for g in verified:
        compared, found_rows = _at_convention(g, convention.get((g.side, _numbers(g.composite)[0])))
        relations.append(Relation(g.side, g.composite, g.shape, "gathered", compared, found_rows))
        used[g.side].add(g.composite)
        used[_OTHER[g.side]].update(p for p, _ in g.parts)
    rest = {side: set(left[side]) - used[side] for side in left}
    for rel in list(relations):
        bias = _companions(rel, rest, shapes, loads)
        if bias is not None:
            relations.append(bias)
            used[bias.side].add(bias.composite)
            used[_OTHER[bias.side]].update(bias.parts)
            rest[bias.side].discard(bias.composite)
            rest[_OTHER[bias.side]].difference_update(bias.parts)
    rules = sorted(_rule(side, tpl, conv) for (side, tpl), conv in convention.items() if _scattered(conv))
    return GatherPlan(relations, rules, used)
