"""Schema diff (names, shapes, dtypes) and rename suggestions, before any number is computed.

Suggestions come from the only-in lists (names with their shapes):
- prefix differences: a target name and a reference name of equal shape sharing their longest
  dotted suffix; the prefixes, with layer numbers generalised to `{L}`, vote. `model.` present on
  one side only → `--strip-prefix model.`; different prefixes (`transformer.h.{L}.` vs
  `model.layers.{L}.`) → `--map`;
- fused tensors: one name whose component (`qkv_proj`) stands where the other side has several
  (`q_proj`, `k_proj`, `v_proj`) and whose dim 0 is the sum of theirs → `--fuse`.
Rounds repeat on what is left after applying the previous round's suggestions (at most 3).
"""

from __future__ import annotations

import re
from collections import defaultdict

from ffdebug.weights.names import FuseRule, NameMap, parse_fuse, parse_map

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


__all__ = ["FuseRule", "apply_hint", "parse_fuse", "suggest_renames"]
