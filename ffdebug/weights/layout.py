"""Layout steps of a weights-diff plan: stacked experts cut per expert, fused tensors split or
concatenated, fp8 tensors paired with their scales. Each takes both sides' logical tensor maps
(`tp.Logical` by name) and returns new ones; the tensors stay unread (their `build` cuts them
when compared, `weights.loading`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ffdebug.weights import quant
from ffdebug.weights.loading import TensorLoader
from ffdebug.weights.names import StackRule, parse_stack
from ffdebug.weights.schema import stacked_suggestions
from ffdebug.weights.tp import Logical

Tensors = dict[str, Logical]


@dataclass
class Sides:
    """Both sides' logical tensors after a step, and what the step has to say."""

    ref: Tensors
    tgt: Tensors
    notes: list[str] = field(default_factory=list)

    def of(self, side: str) -> tuple[Tensors, Tensors]:
        """(this side's map, the other side's)."""
        return (self.ref, self.tgt) if side == "ref" else (self.tgt, self.ref)


# -- stacked experts -------------------------------------------------------------------------------


def stack_sizes(rule: StackRule, lg: Logical, experts: list[list[str]], other: Tensors) -> tuple:
    """(sizes of the parts along the rule's dim, None) or (None, why the stacked tensor does not
    hold the other side's parts); one part's size may be inferred as the remainder."""
    expert_shape = tuple(lg.shape[1:])
    nd = len(expert_shape)
    if not -nd <= rule.dim < nd:
        return None, f"dim {rule.dim} is out of range for an expert of shape {list(expert_shape)}"
    d = rule.dim % nd
    shapes = []
    for i in range(len(rule.parts)):
        shapes.append(next((tuple(other[n[i]].shape) for n in experts if n[i] in other), None))
    for s in shapes:
        if s is not None and (len(s) != nd or s[:d] + s[d + 1 :] != expert_shape[:d] + expert_shape[d + 1 :]):
            return None, (
                f"{list(lg.shape)}: one expert {list(expert_shape)} does not hold parts of shape "
                f"{[list(x) for x in shapes if x is not None]} along dim {d}"
            )
    known = sum(s[d] for s in shapes if s is not None)
    missing = [i for i, s in enumerate(shapes) if s is None]
    if len(missing) > 1 or (not missing and known != expert_shape[d]) or known > expert_shape[d]:
        return None, (
            f"{list(lg.shape)}: the parts add up to {known} along dim {d}, one expert holds {expert_shape[d]}"
        )
    sizes = [s[d] if s is not None else expert_shape[d] - known for s in shapes]
    if any(x <= 0 for x in sizes):
        return None, f"{list(lg.shape)}: no room for part {rule.parts[missing[0]]}"
    return sizes, None


def _expert_parts(lg: Logical, side: str, experts, sizes, d: int, loader: TensorLoader) -> Tensors:
    parts: Tensors = {}
    for e, names in enumerate(experts):
        offset = 0
        cut = len(names) > 1
        for part, size in zip(names, sizes):
            shape = list(lg.shape[1:])
            shape[d] = size
            index = [str(e)] + [":"] * d + [f"{offset}:{offset + size}"]
            parts[part] = Logical(
                name=part,
                source_name=f"{lg.source_name}[{', '.join(index if cut else index[:1])}]",
                entries=lg.entries,
                shape=tuple(shape),
                dtype=lg.dtype,
                layer=lg.layer,
                build=loader.expert(lg, side, e, d, offset, size, cut),
                stacked_from=lg.source_name,
            )
            offset += size
    return parts


def stack(sides: Sides, rules, loader: TensorLoader) -> Sides:
    """Cut each stacked tensor ([E, …], all experts of one MoE layer) into one logical tensor
    per expert and part, under the other side's per-expert names (either side may be stacked)."""
    out = Sides(dict(sides.ref), dict(sides.tgt))
    for rule in rules:
        for side in ("target", "ref"):
            mine, other = out.of(side)
            for name in list(mine):
                lg = mine[name]
                if name in other or len(lg.shape) < 2 or rule.split(name) is None:
                    continue
                experts = rule.expert_parts(name, lg.shape[0], other)
                if not any(p in other for names in experts for p in names):
                    continue
                if any(p in mine for names in experts for p in names):
                    continue
                sizes, problem = stack_sizes(rule, lg, experts, other)
                if problem:
                    out.notes.append(f"--stack {rule.spec}: {name} {problem}")
                    continue
                parts = _expert_parts(lg, side, experts, sizes, rule.dim % (len(lg.shape) - 1), loader)
                items = list(mine.items())
                mine.clear()
                for n, t in items:  # the parts take the stacked tensor's place
                    mine.update(parts if n == name else {n: t})
    return out


def auto_stack(sides: Sides, loader: TensorLoader) -> Sides:
    """Apply stacking the only-in lists show by name and shape (load-audit: layout only;
    every expert's values are still compared)."""
    found = stacked_suggestions(
        {n: t.shape for n, t in sides.ref.items() if n not in sides.tgt},
        {n: t.shape for n, t in sides.tgt.items() if n not in sides.ref},
    )
    if not found:
        return sides
    out = stack(sides, [parse_stack(s["apply"].split(" ", 1)[1].strip("'")) for s in found], loader)
    out.notes += [f"paired {s['matches']} stacked expert tensor(s) by shape: {s['apply']}" for s in found]
    return out


# -- fused tensors ---------------------------------------------------------------------------------


def _split_target(rule, name: str, out: Sides, loader: TensorLoader) -> None:
    """A target fused tensor cut into the reference's parts."""
    parts = rule.part_names(name)
    if not parts or name in out.ref or not all(p in out.ref for p in parts):
        return
    if any(p in out.tgt for p in parts):
        return
    fused = out.tgt[name]
    sizes = [out.ref[p].shape[rule.dim] if out.ref[p].shape else 0 for p in parts]
    if fused.shape and sum(sizes) != fused.shape[rule.dim]:
        out.notes.append(
            f"--fuse {rule.spec}: {name} has {fused.shape[rule.dim]} along dim {rule.dim}, "
            f"the parts {sum(sizes)}"
        )
        return
    del out.tgt[name]
    cache: dict = {}
    offset = 0
    for p, size in zip(parts, sizes):
        shape = list(fused.shape)
        shape[rule.dim] = size
        out.tgt[p] = Logical(
            name=p,
            source_name=f"{fused.source_name}[{offset}:{offset + size}]",
            entries=fused.entries,
            shape=tuple(shape),
            dtype=fused.dtype,
            layer=fused.layer,
            scale=fused.scale,
            build=loader.split(fused, rule.dim, offset, size, cache),
        )
        offset += size


def _join_target(rule, name: str, out: Sides, loader: TensorLoader) -> None:
    """Target parts concatenated into the reference's fused tensor."""
    parts = rule.part_names(name)
    if not parts or name in out.tgt or not all(p in out.tgt for p in parts):
        return
    if any(p in out.ref for p in parts):
        return
    pieces = [out.tgt.pop(p) for p in parts]
    shape = list(pieces[0].shape)
    shape[rule.dim] = sum(p.shape[rule.dim] for p in pieces)
    out.tgt[name] = Logical(
        name=name,
        source_name="+".join(p.source_name for p in pieces),
        entries=pieces[0].entries,
        shape=tuple(shape),
        dtype=pieces[0].dtype,
        layer=pieces[0].layer,
        build=loader.cat(pieces, rule.dim),
    )


def fuse(sides: Sides, rules, loader: TensorLoader) -> Sides:
    """--fuse FUSED=PART+PART: a fused tensor on either side paired with its parts on the other
    (the target side is cut or joined; the reference is never rewritten)."""
    out = Sides(dict(sides.ref), dict(sides.tgt))
    for rule in rules:
        for name in list(out.tgt):
            _split_target(rule, name, out, loader)
        for name in list(out.ref):
            _join_target(rule, name, out, loader)
    return out


# -- fp8 scales --------------------------------------------------------------------------------


@dataclass
class Scaled(Sides):
    dequantized: list[dict] = field(default_factory=list)  # the JSON `dequantized` items


def attach_scales(sides: Sides, dequant: str) -> Scaled:
    """Pair fp8 tensors with their scale tensors; scales used for dequant leave the schema
    (`dequant`: auto = when the other side is not fp8, always, none)."""
    out = Scaled(dict(sides.ref), dict(sides.tgt))
    if dequant == "none":
        return out
    for side in ("ref", "target"):
        mine, other = out.of(side)
        by_source = {t.source_name: t for t in mine.values()}
        for name, t in list(mine.items()):
            if not quant.is_fp8(t.dtype):
                continue
            counterpart = other.get(name)
            if dequant == "auto" and (counterpart is None or quant.is_fp8(counterpart.dtype)):
                continue
            scale = next(
                (by_source[c] for c in quant.scale_candidates(t.source_name) if c in by_source), None
            )
            if name in mine:  # (a scale popped by an earlier tensor stays out)
                mine[name] = replace(t, scale=scale)
            if scale is not None and scale.name not in other:
                mine.pop(scale.name, None)
            out.dequantized.append(
                {
                    "name": name,
                    "side": side,
                    "dtype": t.dtype,
                    "scale": scale.source_name if scale is not None else None,
                    "scale_shape": list(scale.shape) if scale is not None else None,
                }
            )
            if scale is None:
                out.notes.append(f"{name}: no scale tensor found on the {side} side; cast without scaling")
    return out
