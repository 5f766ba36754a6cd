"""Name mapping: rewrite target tensor names into reference names before pairing.

Applied in this order to every target name: `--strip-prefix P` (each, when the name starts with
it), `--add-prefix P`, then every `--map OLD=NEW` and alias-file rule in order (`re.sub`, so OLD
is a regular expression). `{L}` (or `{N}`) in OLD stands for a layer number and is reused in NEW:
`transformer.h.{L}.=model.layers.{L}.` (the rules are `ffdebug/name_rules.py`'s, shared with the
stage map).

Alias files: one `OLD=NEW` rule a line (`#` comments), or a JSON / YAML mapping (optionally under
an `aliases:` key) of OLD to NEW.

`--fuse FUSED=PART+PART[+…][@DIM]` pairs a fused tensor on one side with its parts on the other
(`qkv_proj=q_proj+k_proj+v_proj`): the fused tensor is split (or the parts concatenated) along
DIM (default 0) by the shapes found on the other side.

`--stack STACKED=PART+PART[+…][@DIM]` pairs a stacked tensor holding all experts of an MoE layer
(`experts.gate_up_proj` [E, 2I, H], as transformers 5 holds them) with one tensor per expert and
part (`experts.{E}.gate_proj.weight` [I, H], `experts.{E}.up_proj.weight`, as checkpoints store
them): expert e of the stacked tensor is its parts concatenated along DIM (default 0, a dim of one
expert's tensor). `{E}` stands for the expert number in every part. A part without `.weight` gets
the stacked name's ending; a bare stacked parameter (`experts.down_proj`) also finds `….weight`
parts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ffdebug.errors import FFDebugError
from ffdebug.name_rules import MapRule, parse_map, read_alias_file


@dataclass(frozen=True)
class NameMap:
    strip_prefix: tuple[str, ...] = ()
    add_prefix: str | None = None
    rules: tuple[MapRule, ...] = ()

    @property
    def identity(self) -> bool:
        return not (self.strip_prefix or self.add_prefix or self.rules)

    def apply(self, name: str) -> str:
        for p in self.strip_prefix:
            if p and name.startswith(p):
                name = name[len(p) :]
        if self.add_prefix:
            name = self.add_prefix + name
        for rule in self.rules:
            name = rule.apply(name)
        return name


def build_name_map(
    strip_prefix=(), add_prefix: str | None = None, maps=(), alias_file: str | None = None
) -> NameMap:
    if isinstance(strip_prefix, str):
        strip_prefix = (strip_prefix,)
    if isinstance(maps, str):
        maps = (maps,)
    rules = [parse_map(m) for m in maps or ()]
    if alias_file:
        rules.extend(read_alias_file(alias_file))
    return NameMap(tuple(strip_prefix or ()), add_prefix or None, tuple(rules))


@dataclass(frozen=True)
class FuseRule:
    fused: str  # one name component, e.g. "qkv_proj"
    parts: tuple[str, ...]  # e.g. ("q_proj", "k_proj", "v_proj")
    dim: int = 0
    spec: str = ""

    def part_names(self, fused_name: str) -> list[str] | None:
        """`a.qkv_proj.weight` → [`a.q_proj.weight`, …]; None when the component is absent."""
        comps = fused_name.split(".")
        if self.fused not in comps:
            return None
        i = comps.index(self.fused)
        return [".".join(comps[:i] + [p] + comps[i + 1 :]) for p in self.parts]


def parse_fuse(spec: str) -> FuseRule:
    m = re.fullmatch(r"\s*([\w-]+)\s*=\s*([\w-]+(?:\s*\+\s*[\w-]+)+)\s*(?:@\s*(-?\d+))?\s*", spec)
    if not m:
        raise FFDebugError(
            f"--fuse {spec!r} is invalid: use FUSED=PART+PART[@DIM], e.g. 'qkv_proj=q_proj+k_proj+v_proj'"
        )
    parts = tuple(p.strip() for p in m.group(2).split("+"))
    return FuseRule(m.group(1), parts, int(m.group(3) or 0), spec)


@dataclass(frozen=True)
class StackRule:
    stacked: str  # dotted components, e.g. "experts.gate_up_proj"
    parts: tuple[str, ...]  # each with {E}, e.g. ("experts.{E}.gate_proj.weight", …)
    dim: int = 0  # concatenation dim of the parts, within one expert
    spec: str = ""

    def split(self, name: str) -> tuple[str, str] | None:
        """(prefix, ending) around the stacked components in `name`, else None."""
        comps, want = name.split("."), self.stacked.split(".")
        k = len(want)
        for i in range(len(comps) - k + 1):
            if comps[i : i + k] == want:
                prefix = ".".join(comps[:i]) + ("." if i else "")
                rest = comps[i + k :]
                return prefix, ("." + ".".join(rest)) if rest else ""
        return None

    def expert_parts(self, name: str, count: int, present) -> list[list[str]] | None:
        """Part names of stacked tensor `name` for experts 0..count-1 (None when the stacked
        components are not in `name`). A bare stacked parameter (no ending) whose parts are not in
        `present` (the other side's names) looks for parts ending in `.weight` instead."""
        got = self.split(name)
        if got is None:
            return None
        prefix, ending = got
        out = [[prefix + p.replace("{E}", str(e)) + ending for p in self.parts] for e in range(count)]
        if not ending and not any(n in present for names in out for n in names):
            alt = [[n if n.endswith((".weight", ".bias")) else n + ".weight" for n in names] for names in out]
            if any(n in present for names in alt for n in names):
                return alt
        return out


def parse_stack(spec: str) -> StackRule:
    part = r"[\w.-]*\{E\}[\w.-]*"
    m = re.fullmatch(rf"\s*([\w.-]+)\s*=\s*({part}(?:\s*\+\s*{part})*)\s*(?:@\s*(-?\d+))?\s*", spec)
    if not m or m.group(1).startswith(".") or m.group(1).endswith("."):
        raise FFDebugError(
            f"--stack {spec!r} is invalid: use STACKED=PART+PART[@DIM] with {{E}} for the expert "
            "number in every part, e.g. 'experts.gate_up_proj=experts.{E}.gate_proj.weight+"
            "experts.{E}.up_proj.weight'"
        )
    parts = tuple(p.strip() for p in m.group(2).split("+"))
    if any(p.count("{E}") != 1 for p in parts):
        raise FFDebugError(f"--stack {spec!r}: every part needs {{E}} exactly once")
    return StackRule(m.group(1), parts, int(m.group(3) or 0), spec)


def unused_rules(name_map: NameMap, names, side: str) -> list[str]:
    """A warning for each `--strip-prefix` / `--map` / alias-file rule that changes none of `names`
    (the side the rules rewrite, applied in order as `NameMap.apply` does)."""
    rules = name_map.rules
    hits = [0] * len(rules)
    stripped = dict.fromkeys(name_map.strip_prefix, 0)
    for name in names:
        for p in name_map.strip_prefix:
            if p and name.startswith(p):
                stripped[p] += 1
                name = name[len(p) :]
        if name_map.add_prefix:
            name = name_map.add_prefix + name
        for i, rule in enumerate(rules):
            if rule.pattern.search(name):
                hits[i] += 1
            name = rule.apply(name)
    out = [
        f"--map / alias rule {rule.spec!r} matched no {side} name (it rewrites {side} names)"
        for rule, n in zip(rules, hits)
        if n == 0
    ]
    out += [f"--strip-prefix {p!r} matched no {side} name" for p, n in stripped.items() if n == 0]
    return out
