"""Pair the records of two sides: calls by step tags and input ids, then stages by key.

A *call group* is every record with the same step tags and call index. Reference groups are
matched to target groups with equal step tags, preferring equal input ids, then equal call index
among non-warm-up calls. Target groups tagged `phase=warmup` (or guessed so) that have no
counterpart are set aside, never reported as divergences.
"""

from __future__ import annotations

import fnmatch
import hashlib
from dataclasses import dataclass, field

from ffdebug.errors import InputIdsMismatch
from ffdebug.store.reader import Record, SideStore

WARMUP_PHASES = ("warmup", "warmup_guess")


def _tags_key(rec: Record) -> tuple:
    step = rec.get("step") or {}
    return tuple(sorted((str(k), str(v)) for k, v in step.items()))


@dataclass
class CallGroup:
    tags: tuple
    call: int | None
    phase: str | None
    records: dict = field(default_factory=dict)  # (key, invocation, rank) -> Record
    order: list = field(default_factory=list)
    input_ids: Record | None = None

    @property
    def warmup(self) -> bool:
        return self.phase in WARMUP_PHASES

    def ids_digest(self) -> str | None:
        if self.input_ids is None:
            return None
        t = self.input_ids.load()
        return hashlib.sha256(t.contiguous().numpy().tobytes() + str(list(t.shape)).encode()).hexdigest()


@dataclass
class Filters:
    layers: object = None  # LayerSelection
    stages: tuple[str, ...] = ()
    step: dict = field(default_factory=dict)
    rank: int | None = None

    def keep(self, rec: Record, num_layers: int | None) -> bool:
        if self.rank is not None and (rec.get("rank") or 0) != self.rank:
            return False
        if self.step:
            step = rec.get("step") or {}
            merged = dict(step, phase=rec.get("phase"))
            for k, v in self.step.items():
                if str(merged.get(k)) != str(v):
                    return False
        layer = rec.get("layer")
        if self.layers is not None and layer is not None and not self.layers.contains(layer, num_layers):
            return False
        if self.stages and rec.key != "embed.input_ids":
            if not any(fnmatch.fnmatchcase(rec.key, g) for g in self.stages):
                return False
        return True


def group_calls(store: SideStore, filters: Filters) -> list[CallGroup]:
    layers = [r.get("layer") for r in store.records if r.get("layer") is not None]
    num_layers = max(layers) + 1 if layers else None
    groups: dict[tuple, CallGroup] = {}
    for rec in store.records:
        if not filters.keep(rec, num_layers):
            continue
        gk = (_tags_key(rec), rec.get("call"))
        g = groups.get(gk)
        if g is None:
            g = groups[gk] = CallGroup(tags=gk[0], call=gk[1], phase=rec.get("phase"))
        if rec.get("phase") in WARMUP_PHASES:
            g.phase = rec.get("phase")
        sk = (rec.key, rec.get("invocation") or 0, rec.get("rank") or 0)
        if sk in g.records:  # same key twice in one call (free taps in a loop): number them
            n = 1
            while (rec.key, f"{rec.get('invocation') or 0}#{n}", rec.get("rank") or 0) in g.records:
                n += 1
            sk = (rec.key, f"{rec.get('invocation') or 0}#{n}", rec.get("rank") or 0)
        g.records[sk] = rec
        g.order.append(sk)
        if rec.key == "embed.input_ids" or (rec.get("extra") or {}).get("input_ids"):
            g.input_ids = g.input_ids or rec
    return list(groups.values())


@dataclass
class Pairing:
    pairs: list[tuple[CallGroup, CallGroup]]
    unpaired_ref: list[CallGroup]
    unpaired_target: list[CallGroup]
    warmup_skipped: list[CallGroup]


def pair_calls(ref_groups: list[CallGroup], tgt_groups: list[CallGroup]) -> Pairing:
    pairs: list[tuple[CallGroup, CallGroup]] = []
    used: set[int] = set()
    unpaired_ref: list[CallGroup] = []
    by_tags: dict[tuple, list[int]] = {}
    for i, g in enumerate(tgt_groups):
        by_tags.setdefault(g.tags, []).append(i)
    digest_cache: dict[int, str | None] = {}

    def digest(i: int) -> str | None:
        if i not in digest_cache:
            digest_cache[i] = tgt_groups[i].ids_digest()
        return digest_cache[i]

    for rg in ref_groups:
        cands = [i for i in by_tags.get(rg.tags, []) if i not in used]
        if not cands:
            unpaired_ref.append(rg)
            continue
        choice = None
        rd = rg.ids_digest()
        if rd is not None:
            same = [i for i in cands if digest(i) == rd]
            if same:
                choice = (
                    same[0] if not rg.warmup else next((i for i in same if tgt_groups[i].warmup), same[0])
                )
        if choice is None:
            real = [i for i in cands if tgt_groups[i].warmup == rg.warmup]
            exact = [i for i in real if tgt_groups[i].call == rg.call]
            choice = exact[0] if exact else (real[0] if real else None)
        if choice is None:
            unpaired_ref.append(rg)
            continue
        used.add(choice)
        pairs.append((rg, tgt_groups[choice]))
    left = [g for i, g in enumerate(tgt_groups) if i not in used]
    warm = [g for g in left if g.warmup]
    return Pairing(pairs, unpaired_ref, [g for g in left if not g.warmup], warm)


def check_input_ids(pairs: list[tuple[CallGroup, CallGroup]]) -> None:
    """The gate before numerics: equal input ids on both sides of every paired call."""
    import torch

    for rg, tg in pairs:
        if rg.input_ids is None and tg.input_ids is None:
            continue
        where = f"call {rg.call}" + (f" {dict(rg.tags)}" if rg.tags else "")
        if rg.input_ids is None or tg.input_ids is None:
            missing = "reference" if rg.input_ids is None else "target"
            raise InputIdsMismatch(
                f"input ids: the {missing} side has no embed.input_ids for {where}; dump both sides "
                "with the same inputs (fix tokenization first)"
            )
        r, t = rg.input_ids.load(), tg.input_ids.load()
        if tuple(r.shape) != tuple(t.shape):
            raise InputIdsMismatch(
                f"input ids differ at {where}: shape {list(r.shape)} vs {list(t.shape)} (fix tokenization first)"
            )
        if not torch.equal(r, t):
            pos = torch.nonzero(r != t)[0].tolist()
            raise InputIdsMismatch(
                f"input ids differ at {where}, first at position {pos}: ref {int(r[tuple(pos)])} vs "
                f"target {int(t[tuple(pos)])} (fix tokenization first)"
            )
