"""The content step of a weights-diff plan: what the names left unpaired, related by content
(`weights.content.relate`), each composite cut into the other side's tensors under their names
(docs/weights-diff.md, "Content matching")."""

from __future__ import annotations

from dataclasses import dataclass

from ffdebug.weights import quant
from ffdebug.weights.layout import Sides
from ffdebug.weights.loading import TensorLoader
from ffdebug.weights.tp import Logical


@dataclass
class Related(Sides):
    plan: object = None  # content.ContentPlan


def _blocks(comp: Logical, rel, loader: TensorLoader) -> dict[str, Logical]:
    from ffdebug.weights.content import cut_shape

    found = {s.part: s for s in rel.found or ()}
    out = {}
    for seg in rel.segments:
        out[seg.part] = Logical(
            name=seg.part,
            source_name=comp.source_name
            + ("" if rel.kind == "whole" and not seg.transposed else seg.where()),
            entries=comp.entries,
            shape=cut_shape(tuple(comp.shape), seg),
            dtype=comp.dtype,
            layer=comp.layer,
            build=loader.block(comp, rel.side, seg),
            stacked_from=comp.source_name,
            segment=seg,
            found=(
                (found[seg.part], loader.block(comp, rel.side, found[seg.part]))
                if seg.part in found
                else None
            ),
            relation=rel,
        )
    return out


def _slots(cube: Logical, side: str, loader: TensorLoader) -> dict[str, Logical]:
    """A 3-D tensor as one tensor per slot, `name[h]` (`relate`'s second pass related them)."""
    from ffdebug.weights.content import Segment

    out = {}
    for h in range(cube.shape[0]):
        seg = Segment(f"{cube.name}[{h}]", h, 0, 0, cube.shape[1])
        out[seg.part] = Logical(
            name=seg.part,
            source_name=f"{cube.source_name}[{h}]",
            entries=cube.entries,
            shape=tuple(cube.shape[1:]),
            dtype=cube.dtype,
            layer=cube.layer,
            build=loader.block(cube, side, seg),
            stacked_from=cube.source_name,
            segment=seg,
        )
    return out


def pair_by_content(sides: Sides, only_ref: list[str], only_tgt: list[str], loader: TensorLoader) -> Related:
    """Each composite content matching related is replaced by its blocks (fp8 tensors are not
    sketched); the plan is kept for the JSON `content`."""
    from ffdebug.weights.relate import relate

    ref, tgt = sides.ref, sides.tgt
    plan = relate(
        {n: ref[n].shape for n in only_ref if not quant.is_fp8(ref[n].dtype)},
        {n: tgt[n].shape for n in only_tgt if not quant.is_fp8(tgt[n].dtype)},
        lambda n: loader.load(ref[n], "ref"),
        lambda n: loader.load(tgt[n], "target"),
    )
    out = Related(dict(ref), dict(tgt), plan=plan)
    for side, names in plan.split_slots.items():  # a 3-D tensor related slot by slot: its slots
        mine, _ = out.of(side)
        for name in names:
            mine.update(_slots(mine.pop(name), side, loader))
    only = {"ref": set(only_ref), "target": set(only_tgt)}
    for rel in plan.relations:
        mine, _ = out.of(rel.side)
        if rel.composite not in mine or rel.composite not in only[rel.side]:
            continue
        mine.update(_blocks(mine.pop(rel.composite), rel, loader))
    out.notes.append(
        f"content matching paired {sum(len(r.segments) for r in plan.relations)} tensor(s) the names "
        f"left unpaired ({plan.seconds:.2f} s)"
    )
    return out
