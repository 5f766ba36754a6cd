"""SGLang's `dims` annotations, read into rank plans (`ffdebug.io.ranks`).

SGLang's dumper stores `meta["dims"]`, one token per tensor dim (SGLang 0.5.23 spelling, and the
older parenthesised one):

    b s[cp:zigzag,sp] h[tp] d # ep:replicated        b s(cp,zigzag) h(tp) d

A dim names the parallel axes it is sharded over, outermost first; `zigzag` is context-parallel
load balancing, `partial` a pre-all-reduce partial sum; `1` is a singleton dim; `(a*b)` a fused
dim. After `#`, `AXIS:replicated` declares replicated axes (`dp:=GROUP` is accepted and ignored).

`unshard_plan(dims, coords)` turns the annotation and each part's parallel coordinates (`{axis:
(rank, size)}`, axes of size 1 left out) into one `Staged` plan: replicated axes picked first, then
every sharded axis innermost first (`s[cp:zigzag,sp]`: the sp pieces of each cp rank are
concatenated, then the cp ranks are put back from zigzag order), the way SGLang's unsharder does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ffdebug.io.ranks import Concat, ConcatZigzag, Plan, Replicated, Staged, Sum

# SGLang's ParallelAxis values (its pseudo-axis `recompute_pseudo` is handled by the importer)
AXES = frozenset("tp cp ep sp dp etp edp attn_tp attn_dp moe_ep moe_tp moe_dp".split())
_QUALIFIERS = {"zigzag", "natural", "partial", "sharded"}
_TOKEN = re.compile(r"^(?P<name>[A-Za-z_]\w*|1|\([^)]*\))(?:\[(?P<new>[^\]]*)\]|\((?P<old>[^)]*)\))?$")


class DimsError(ValueError):
    """A dims annotation that cannot be read (the message says which token)."""


@dataclass(frozen=True)
class Shard:
    """One parallel axis a dim is split over."""

    axis: str
    zigzag: bool = False
    partial: bool = False


@dataclass(frozen=True)
class Dims:
    names: tuple[str, ...]
    shards: tuple[tuple[Shard, ...], ...]  # per dim, outermost axis first
    replicated: frozenset[str] = frozenset()

    @property
    def sharded_axes(self) -> set[str]:
        return {s.axis for dim in self.shards for s in dim}


def parse_dims(text: str) -> Dims:
    """Parse a dims string (see the module docstring)."""
    shape_part, _, decl = text.partition("#")
    tokens = shape_part.split()
    if not tokens:
        raise DimsError(f"dims {text!r}: no dims before '#'")
    names, shards = [], []
    for tok in tokens:
        m = _TOKEN.match(tok)
        if not m:
            raise DimsError(f"dims {text!r}: cannot read the token {tok!r}")
        names.append(m.group("name"))
        if m.group("new") is not None:
            shards.append(_new_modifiers(m.group("new"), tok, text))
        elif m.group("old") is not None:
            shards.append(_old_modifiers(m.group("old"), tok, text))
        else:
            shards.append(())
    replicated = set()
    for tok in decl.split():
        axis, sep, what = tok.partition(":")
        if sep and what == "replicated" and axis in AXES:
            replicated.add(axis)
        elif not tok.startswith("dp:="):
            raise DimsError(f"dims {text!r}: cannot read the declaration {tok!r}")
    return Dims(tuple(names), tuple(shards), frozenset(replicated))


def _shard(axis: str, quals: list[str], tok: str, text: str) -> Shard:
    if axis not in AXES:
        raise DimsError(f"dims {text!r}: unknown parallel axis {axis!r} in {tok!r}")
    bad = [q for q in quals if q not in _QUALIFIERS]
    if bad:
        raise DimsError(f"dims {text!r}: unknown qualifier {bad[0]!r} in {tok!r}")
    return Shard(axis, zigzag="zigzag" in quals, partial="partial" in quals)


def _new_modifiers(body: str, tok: str, text: str) -> tuple[Shard, ...]:
    """`cp:zigzag,sp` / `tp:partial` / `cp:zigzag+partial`."""
    out = []
    for mod in (p.strip() for p in body.split(",") if p.strip()):
        axis, _, quals = mod.partition(":")
        out.append(_shard(axis.strip(), [q.strip() for q in quals.split("+") if q.strip()], tok, text))
    return tuple(out)


def _old_modifiers(body: str, tok: str, text: str) -> tuple[Shard, ...]:
    """`cp,zigzag` / `tp` / `tp,partial`: a qualifier belongs to the axis before it."""
    groups: list[list[str]] = []
    for part in (p.strip() for p in body.split(",") if p.strip()):
        if part in _QUALIFIERS and groups:
            groups[-1].append(part)
        else:
            groups.append([part])
    return tuple(_shard(g[0], g[1:], tok, text) for g in groups)


Coords = dict[str, tuple[int, int]]  # axis -> (rank along it, its size), sizes > 1 only


def resolve_axes(dims: Dims, coords: list[Coords]) -> tuple[list[Coords], list[str]]:
    """(coordinates restricted to the declared axes, the axes left undeclared).

    An axis the annotation does not name is dropped when its rank follows from the declared
    axes' ranks (`attn_tp` equal to `tp` on every piece), as SGLang resolves dependent axes;
    otherwise it is undeclared: the pieces cannot be folded from this annotation."""
    declared = dims.sharded_axes | dims.replicated
    present = {a for c in coords for a in c}
    undeclared = []
    for axis in sorted(present - declared):
        seen: dict[tuple, int] = {}
        for c in coords:
            key = tuple(sorted((a, v) for a, v in c.items() if a in declared))
            if seen.setdefault(key, c.get(axis, (0, 1))[0]) != c.get(axis, (0, 1))[0]:
                undeclared.append(axis)
                break
    kept = [{a: v for a, v in c.items() if a in declared} for c in coords]
    return kept, undeclared


def unshard_plan(dims: Dims, coords: list[Coords]) -> Staged | None:
    """The plan folding the parts (`coords[i]`: part i's coordinates), or None when nothing in the
    annotation applies (every named axis has size 1 here)."""
    present = {a for c in coords for a in c}
    steps: list[tuple[Plan, tuple[tuple[int, ...], ...]]] = []
    current = [dict(c) for c in coords]
    replicated = sorted(dims.replicated & present)
    order = [(axis, None, None) for axis in replicated]
    for d, dim_shards in enumerate(dims.shards):
        order += [(s.axis, d, s) for s in reversed(dim_shards) if s.axis in present]
    if not order:
        return None
    for axis, d, shard in order:
        groups, current = _group(current, axis)
        size = max(c[axis][1] for c in coords if axis in c)
        short = [len(g) for g in groups if len(g) != size]
        if short:
            raise DimsError(f"{short[0]} of the {size} {axis} pieces of one slice are present")
        if shard is None:
            plan: Plan = Replicated()
        elif shard.partial:
            plan = Sum()
        elif shard.zigzag:
            plan = ConcatZigzag(d, size)
        else:
            plan = Concat(d)
        steps.append((plan, groups))
    if len(current) != 1:
        raise DimsError(
            f"after unsharding {len(current)} pieces are left: axes of the dump are not in the dims"
        )
    return Staged(tuple(steps))


def _group(items: list[Coords], axis: str) -> tuple[tuple[tuple[int, ...], ...], list[Coords]]:
    """Parts with equal coordinates off `axis`, each group ordered by rank along `axis`."""
    by_rest: dict[tuple, list[tuple[int, int]]] = {}
    for i, c in enumerate(items):
        rest = tuple(sorted((a, v) for a, v in c.items() if a != axis))
        by_rest.setdefault(rest, []).append((c.get(axis, (0, 1))[0], i))
    groups, projected = [], []
    for rest, members in by_rest.items():
        ranks = sorted(r for r, _ in members)
        if len(set(ranks)) != len(ranks):
            raise DimsError(f"two pieces hold {axis} rank {ranks[0]} of the same slice")
        groups.append(tuple(i for _, i in sorted(members)))
        projected.append(dict(rest))
    return tuple(groups), projected
