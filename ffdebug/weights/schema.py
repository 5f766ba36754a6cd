"""Schema diff (names, shapes, dtypes) and rename suggestions, before any number is computed.

Suggestions come from the only-in lists (names with their shapes):
- prefix differences: a target name and a reference name of equal shape sharing their longest
  dotted suffix; the prefixes, with layer numbers generalised to `{L}`, vote. `model.` present on
  one side only → `--strip-prefix model.`; different prefixes (`transformer.h.{L}.` vs
  `model.layers.{L}.`) → `--map`;
- fused tensors: one name whose component (`qkv_proj`) stands where the other side has several
  (`q_proj`, `k_proj`, `v_proj`) and whose dim 0 is the sum of theirs → `--fuse`.
- stacked experts: a tensor [E, …] (`experts.gate_up_proj`) on one side where the other has E
  tensors per part (`experts.{E}.gate_proj.weight`, `experts.{E}.up_proj.weight`, numbered 0..E-1)
  whose leaf names it spells and whose shapes make up one expert along one dim (one part: the
  same leaf name, or the only part of that shape) → `--stack`.
Rounds repeat on what is left after applying the previous round's suggestions (at most 3).
"""

from __future__ import annotations

import re
from collections import defaultdict

from ffdebug.name_rules import parse_map
from ffdebug.weights.names import FuseRule, NameMap, parse_fuse

_NUM = re.compile(r"^\d+$")


def _template(prefix: str) -> tuple[str, tuple[str, ...]]:
    comps = prefix.split(".")
    nums = tuple(c for c in comps if _NUM.match(c))
    return ".".join("{L}" if _NUM.match(c) else c for c in comps), nums


def _regex_of(template: str) -> str:
    return "^" + "{L}".join(re.escape(part) for part in template.split("{L}"))


def _prefix_suggestions(only_ref: dict, only_tgt: dict) -> list[dict]:
    index: dict[str, list[str]] = defaultdict(list)
    for r in only_ref:
        comps = r.split(".")
        for k in range(1, len(comps) + 1):
            index[".".join(comps[-k:])].append(r)
    votes: dict[tuple[str, str], list[tuple[str, str]]] = defaultdict(list)
    for t, t_shape in only_tgt.items():
        comps = t.split(".")
        for k in range(len(comps), 0, -1):
            suffix = ".".join(comps[-k:])
            found = None
            for r in index.get(suffix, ()):
                r_comps = r.split(".")
                if k < min(2, len(comps), len(r_comps)) or tuple(only_ref[r]) != tuple(t_shape):
                    continue
                tp = ".".join(comps[:-k]) + ("." if k < len(comps) else "")
                rp = ".".join(r_comps[:-k]) + ("." if k < len(r_comps) else "")
                (tt, tn), (rt, rn) = _template(tp), _template(rp)
                if tn != rn or len(tn) > 1:
                    continue
                found = (tt, rt, r)
                break
            if found:
                votes[(found[0], found[1])].append((t, found[2]))
                break
    used_t: set[str] = set()
    used_r: set[str] = set()
    out = []
    for (tp, rp), pairs in sorted(votes.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        pairs = [(t, r) for t, r in pairs if t not in used_t and r not in used_r]
        if not pairs:
            continue
        used_t.update(t for t, _ in pairs)
        used_r.update(r for _, r in pairs)
        if "{L}" not in tp + rp and (tp == "" or rp == ""):
            prefix = tp or rp
            apply = f"--strip-prefix {prefix}"
            kind = "strip_prefix"
        else:
            apply = f"--map '{_regex_of(tp)}={rp}'"
            kind = "map"
        out.append(
            {
                "from": tp + "*",
                "to": rp + "*",
                "matches": len(pairs),
                "kind": kind,
                "apply": apply,
                "example": {"from": pairs[0][0], "to": pairs[0][1]},
            }
        )
    # More specific rules first, so a general prefix map does not shadow them.
    out.sort(key=lambda s: (s["kind"] != "strip_prefix", -len(s["from"])))
    return out


def _spells(fused: str, parts: list[str]) -> list[str] | None:
    """The parts in the order the fused component spells them (`qkv_proj` → q, k, v), else None."""

    def common_prefix(xs):
        p = xs[0]
        for x in xs[1:]:
            while not x.startswith(p):
                p = p[:-1]
        return p

    pre = common_prefix(parts)
    suf = common_prefix([p[::-1] for p in parts])[::-1]
    cores = {p: p[len(pre) : len(p) - len(suf)] for p in parts}
    if not fused.startswith(pre) or not fused.endswith(suf) or any(not c for c in cores.values()):
        return None
    body = fused[len(pre) : len(fused) - len(suf) if suf else None].replace("_", "")
    order = []
    while body:
        nxt = next((p for p in parts if p not in order and body.startswith(cores[p].replace("_", ""))), None)
        if nxt is None:
            return None
        order.append(nxt)
        body = body[len(cores[nxt].replace("_", "")) :]
    return order if len(order) == len(parts) else None


def _fused_one_way(fused_side: dict, parts_side: dict) -> dict:
    """{(fused component, parts): [(fused name, [part names])]} found by name and shape."""
    groups: dict[tuple[str, int, int], dict[str, str]] = defaultdict(dict)
    for name in parts_side:
        comps = name.split(".")
        for i, c in enumerate(comps):
            key = (".".join(comps[:i] + ["*"] + comps[i + 1 :]), i, len(comps))
            groups[key][c] = name
    found: dict = defaultdict(list)
    for name, shape in fused_side.items():
        comps = name.split(".")
        for i, c in enumerate(comps):
            members = groups.get((".".join(comps[:i] + ["*"] + comps[i + 1 :]), i, len(comps)))
            if not members or len(members) < 2 or c in members:
                continue
            shapes = [tuple(parts_side[n]) for n in members.values()]
            if not shape or any(len(s) != len(shape) or s[1:] != tuple(shape[1:]) for s in shapes):
                continue
            if sum(s[0] for s in shapes) != shape[0]:
                continue
            order = _spells(c, list(members))
            if order is None:
                order = list(members)  # by shape alone, in the other side's order
            found[(c, tuple(order))].append((name, [members[p] for p in order]))
            break
    return found


def _fused_suggestions(only_ref: dict, only_tgt: dict) -> list[dict]:
    out = []
    for (c, parts), hits in _fused_one_way(only_tgt, only_ref).items():
        out.append(
            {
                "from": hits[0][0],
                "to": hits[0][1],
                "matches": len(hits),
                "kind": "fused",
                "apply": f"--fuse {c}={'+'.join(parts)}",
            }
        )
    for (c, parts), hits in _fused_one_way(only_ref, only_tgt).items():
        out.append(
            {
                "from": hits[0][1],
                "to": hits[0][0],
                "matches": len(hits),
                "kind": "fused",
                "apply": f"--fuse {c}={'+'.join(parts)}",
            }
        )
    return out


def _expert_groups(side: dict) -> dict[tuple[str, str], tuple[int, tuple]]:
    """{(before, after): (E, shape)}: names equal but for one number component, numbered 0..E-1
    (E ≥ 2), all of one shape (`model.layers.1.mlp.experts`, `gate_proj.weight`)."""
    groups: dict[tuple[str, str], dict[int, tuple]] = defaultdict(dict)
    for name, shape in side.items():
        comps = name.split(".")
        for i, c in enumerate(comps[1:-1], start=1):
            if _NUM.match(c):
                groups[(".".join(comps[:i]), ".".join(comps[i + 1 :]))][int(c)] = tuple(shape)
    out = {}
    for key, members in groups.items():
        shapes = set(members.values())
        if len(members) >= 2 and sorted(members) == list(range(len(members))) and len(shapes) == 1:
            out[key] = (len(members), shapes.pop())
    return out


def _spelled(leaf: str, leaves: list[str]) -> list[str] | None:
    """The leaves, in order, whose cores spell `leaf` (`gate_up_proj` → gate_proj, up_proj)."""
    suffix = ""
    for cand in ("_proj", "_weight", ""):
        if leaf.endswith(cand) and all(x.endswith(cand) for x in leaves):
            suffix = cand
            break
    cores = {x: x[: len(x) - len(suffix)].replace("_", "") for x in leaves}
    body = leaf[: len(leaf) - len(suffix)].replace("_", "")
    order: list[str] = []
    while body:
        nxt = max(
            (x for x in leaves if x not in order and cores[x] and body.startswith(cores[x])),
            key=lambda x: len(cores[x]),
            default=None,
        )
        if nxt is None:
            return None
        order.append(nxt)
        body = body[len(cores[nxt]) :]
    return order if len(order) >= 2 else None


def _stacked_one_way(stacked_side: dict, expert_side: dict) -> list[tuple[str, str, list[str], int]]:
    """[(stacked name, rule spec, part names of expert 0, dim)] found by name and shape."""
    groups = _expert_groups(expert_side)
    by_before: dict[str, list[tuple[str, int, tuple]]] = defaultdict(list)
    for (before, after), (count, shape) in groups.items():
        by_before[before].append((after, count, shape))
    found = []
    for name, shape in stacked_side.items():
        shape = tuple(shape)
        comps = name.split(".")
        if len(shape) < 2:
            continue
        for k in (1, 2):
            before, rest = ".".join(comps[:-k]), comps[-k:]
            cands = [
                (after, s)
                for after, count, s in by_before.get(before, ())
                if count == shape[0] and len(s) == len(shape) - 1
            ]
            if not cands:
                continue
            hit = _stack_parts(rest[0], shape[1:], cands)
            if hit is None:
                continue
            parts, dim = hit
            anchor = before.rsplit(".", 1)[-1]
            spec = f"{anchor}.{'.'.join(rest)}=" + "+".join(f"{anchor}.{{E}}.{a}" for a in parts)
            if dim:
                spec += f"@{dim}"
            found.append((name, spec, [f"{before}.0.{a}" for a in parts], dim))
            break
    return found


def _stack_parts(leaf: str, expert_shape: tuple, cands: list[tuple[str, tuple]]):
    """(part 'after' names, concat dim) making up one expert of a stacked tensor, else None."""
    same_leaf = [a for a, s in cands if a.split(".")[0] == leaf and s == expert_shape]
    if len(same_leaf) == 1:
        return same_leaf, 0
    by_ending: dict[str, dict[str, tuple]] = defaultdict(dict)
    for a, s in cands:
        head, _, ending = a.partition(".")
        by_ending[ending][head] = s
    for ending, members in by_ending.items():
        order = _spelled(leaf, list(members))
        if order is None:
            continue
        shapes = [members[h] for h in order]
        for d in range(len(expert_shape)):
            if sum(s[d] for s in shapes) == expert_shape[d] and all(
                s[:d] + s[d + 1 :] == expert_shape[:d] + expert_shape[d + 1 :] for s in shapes
            ):
                return [h + ("." + ending if ending else "") for h in order], d
    by_shape = [a for a, s in cands if s == expert_shape]
    return (by_shape, 0) if len(by_shape) == 1 else None


def stacked_suggestions(only_ref: dict, only_tgt: dict) -> list[dict]:
    """`--stack` suggestions for stacked expert tensors on one side, per-expert ones on the other."""
    out: dict[str, dict] = {}
    for stacked_side, expert_side, stacked_is_ref in (
        (only_ref, only_tgt, True),
        (only_tgt, only_ref, False),
    ):
        for name, spec, parts, _ in _stacked_one_way(stacked_side, expert_side):
            s = out.get(spec)
            if s is None:
                frm, to = (parts, name) if stacked_is_ref else (name, parts)
                out[spec] = {
                    "from": frm,
                    "to": to,
                    "matches": 1,
                    "kind": "stacked",
                    "apply": f"--stack '{spec}'",
                }
            else:
                s["matches"] += 1
    return list(out.values())


def suggest_renames(only_ref: dict, only_tgt: dict, rounds: int = 3) -> list[dict]:
    """Suggestions `{from, to, matches, kind, apply, …}` for two only-in lists ({name: shape})."""
    only_ref, only_tgt = dict(only_ref), dict(only_tgt)
    out: list[dict] = []
    for _ in range(rounds):
        if not only_ref or not only_tgt:
            break
        found = _prefix_suggestions(only_ref, only_tgt)
        if not found:
            break
        out.extend(found)
        only_ref, only_tgt = _apply(found, only_ref, only_tgt)
    if only_ref and only_tgt:
        out.extend(_fused_suggestions(only_ref, only_tgt))
        out.extend(stacked_suggestions(only_ref, only_tgt))
    return out


def _apply(suggestions: list[dict], only_ref: dict, only_tgt: dict) -> tuple[dict, dict]:
    strip = tuple(s["apply"].split(" ", 1)[1] for s in suggestions if s["kind"] == "strip_prefix")
    rules = tuple(
        parse_map(s["apply"].split(" ", 1)[1].strip("'")) for s in suggestions if s["kind"] == "map"
    )
    ref_map = NameMap(strip_prefix=strip)
    tgt_map = NameMap(strip_prefix=strip, rules=rules)
    ref = {ref_map.apply(n): s for n, s in only_ref.items()}
    tgt = {tgt_map.apply(n): s for n, s in only_tgt.items()}
    common = set(ref) & set(tgt)
    return (
        {n: s for n, s in ref.items() if n not in common},
        {n: s for n, s in tgt.items() if n not in common},
    )


def apply_hint(suggestions: list[dict]) -> str:
    """All suggestions as one option string to re-run with."""
    return " ".join(dict.fromkeys(s["apply"] for s in suggestions))


__all__ = ["FuseRule", "apply_hint", "parse_fuse", "stacked_suggestions", "suggest_renames"]
