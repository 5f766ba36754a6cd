"""Pair the records of two sides: calls by step tags and input ids, then stages by key.

A *call group* is every record with the same step tags and call index. Reference groups are
matched to target groups with equal step tags, preferring equal input ids, then equal call index
among non-warm-up calls, then the call that looks like the same prefill (`pick_prefill_call`).
Groups tagged `phase=warmup` (or guessed so: a dummy batch of one repeated id) that have no
counterpart, on either side, are set aside, never reported as divergences or missing calls.

Ranks (`pair_stages`, docs/architecture.md "Ranks"): the same ranks on both sides pair rank by
rank; otherwise the reference is folded to one rank as its manifest declares, and every target
rank is compared: folded when the manifest says `reduction="partial"` (summed) or gives a `shard`
(concatenated along `shard.dim`), else each rank on its own as a replica of the reference.
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
from dataclasses import dataclass, field

from ffdebug.comparison.align import LENS_KEY, MASK_KEY
from ffdebug.io.ranks import Replicated, fold, manifest_plan
from ffdebug.io.record import Record
from ffdebug.io.side import SideStore
from ffdebug.store.schema import WARMUP_PHASES, looks_like_dummy_ids


def _tags_key(rec: Record) -> tuple:
    step = rec.step
    return tuple(sorted((str(k), str(v)) for k, v in step.items()))


@dataclass
class CallGroup:
    tags: tuple
    call: int | None
    phase: str | None
    records: dict = field(default_factory=dict)  # (key, invocation, rank) -> Record
    order: list = field(default_factory=list)
    input_ids: Record | None = None
    token_mask: Record | None = None  # the attention mask of a padded batch (comparison/align.py)
    seq_lens: Record | None = None  # the sequence lengths of a packed batch (comparison/align.py)

    @property
    def warmup(self) -> bool:
        return self.phase in WARMUP_PHASES

    @functools.cached_property
    def depths(self) -> dict:
        """Stage key -> blocks of this call at and before it: layer + 1 inside block L, 0 for what
        runs before the first block (the embedding), the block count + 1 after the last one (the
        element-wise rule's depth, `verdict.elem_scale`)."""
        count = max((r.layer + 1 for r in self.records.values() if r.layer is not None), default=0)
        out, seen_block = {}, False
        for sk in self.order:
            layer = self.records[sk].layer
            seen_block = seen_block or layer is not None
            out[sk] = layer + 1 if layer is not None else (count + 1 if seen_block else 0)
        return out

    def ids_digest(self) -> str | None:
        import numpy as np

        if self.input_ids is None:
            return None
        t = self.input_ids.load()
        if self.token_mask is not None and self.token_mask.has_payload:  # a padded batch: its tokens
            mask = self.token_mask.load().astype(bool)
            if tuple(mask.shape) == tuple(t.shape) and not bool(mask.all()):
                t = t[mask]
        return hashlib.sha256(np.ascontiguousarray(t).tobytes() + str(list(t.shape)).encode()).hexdigest()

    def ranks(self) -> set[int]:
        return {sk[2] for sk in self.order}

    def shape_of(self, key: str) -> list | None:
        for sk in self.order:
            if sk[0] == key:
                return list(self.records[sk].shape)
        return None


@dataclass
class Filters:
    layers: object = None  # LayerSelection
    stages: tuple[str, ...] = ()
    step: dict = field(default_factory=dict)
    rank: int | None = None
    exclude: tuple[str, ...] = ()  # `--exclude GLOB`: stage keys left out (after the stage map)

    def keep(self, rec: Record, num_layers: int | None) -> bool:
        if self.rank is not None and rec.rank != self.rank:
            return False
        if self.step:
            merged = dict(rec.step, phase=rec.phase)
            for k, v in self.step.items():
                if str(merged.get(k)) != str(v):
                    return False
        layer = rec.layer
        if self.layers is not None and layer is not None and not self.layers.contains(layer, num_layers):
            return False
        always = rec.key in ("embed.input_ids", MASK_KEY, LENS_KEY)  # the gate and the alignment read them
        if self.stages and not always:
            if not any(fnmatch.fnmatchcase(rec.key, g) for g in self.stages):
                return False
        if self.exclude and not always:
            if any(fnmatch.fnmatchcase(rec.key, g) for g in self.exclude):
                return False
        return True


def group_calls(store: SideStore, filters: Filters) -> list[CallGroup]:
    layers = [r.layer for r in store.records if r.layer is not None]
    num_layers = max(layers) + 1 if layers else None
    groups: dict[tuple, CallGroup] = {}
    for rec in store.records:
        if not filters.keep(rec, num_layers):
            continue
        # calls are numbered per tag set, phase included: warm-up call 0 and real call 0 are two calls
        gk = (_tags_key(rec), rec.phase, rec.call)
        g = groups.get(gk)
        if g is None:
            g = groups[gk] = CallGroup(tags=gk[0], call=gk[2], phase=gk[1])
        if rec.key == MASK_KEY:  # alignment data, not a stage
            g.token_mask = g.token_mask or rec
            continue
        if rec.key == LENS_KEY:
            g.seq_lens = g.seq_lens or rec
            continue
        sk = (rec.key, rec.invocation, rec.rank)
        if sk in g.records:  # same key twice in one call (free taps in a loop): number them
            n = 1
            while (rec.key, f"{rec.invocation}#{n}", rec.rank) in g.records:
                n += 1
            sk = (rec.key, f"{rec.invocation}#{n}", rec.rank)
        g.records[sk] = rec
        g.order.append(sk)
        if rec.key == "embed.input_ids" or rec.extra.get("input_ids"):
            g.input_ids = g.input_ids or rec
    for g in groups.values():
        # Engines that do not tag their warm-up: a dummy batch is a warm-up guess, never a real call.
        if g.phase is None and g.input_ids is not None and g.input_ids.has_payload:
            if looks_like_dummy_ids(g.input_ids.load()):
                g.phase = "warmup_guess"
    return list(groups.values())


def pick_prefill_call(groups: list[CallGroup], like: CallGroup | None = None) -> CallGroup | None:
    """The call that looks like the prefill, for engines that do not tag their calls.

    Warm-up calls (tagged or guessed) are skipped. With `like` (the reference's call), calls whose
    block inputs have the same shapes come first; then calls that process more than one token per
    sequence (a prefill, not a decode step); then the earliest.
    """
    real = [g for g in groups if not g.warmup]
    if not real:
        return None

    def score(g: CallGroup) -> tuple:
        same = 0
        if like is not None:
            for sk in like.order[:64]:
                shape = g.shape_of(sk[0])
                if shape is not None and shape == list(like.records[sk].shape):
                    same += 1
        ids = g.shape_of("embed.input_ids")
        prefill = ids is not None and len(ids) >= 1 and ids[-1] > 1
        return (-same, not prefill, g.call if g.call is not None else 0)

    return min(real, key=score)


@dataclass
class Pairing:
    pairs: list[tuple[CallGroup, CallGroup]]
    unpaired_ref: list[CallGroup]
    unpaired_target: list[CallGroup]
    warmup_skipped: list[CallGroup]  # the target's warm-up calls without a counterpart
    warmup_skipped_ref: list[CallGroup] = field(default_factory=list)  # the reference's


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
        cands = [i for i in cands if tgt_groups[i].phase == rg.phase] or cands
        if not cands:
            unpaired_ref.append(rg)
            continue
        choice = None
        # one token per sequence (a decode step) does not identify a call: those pair by index
        rd = rg.ids_digest() if not _one_token(rg) else None
        if rd is not None:
            same = [i for i in cands if digest(i) == rd]
            if same:
                choice = (
                    same[0] if not rg.warmup else next((i for i in same if tgt_groups[i].warmup), same[0])
                )
        if choice is None:
            real = [i for i in cands if tgt_groups[i].warmup == rg.warmup]
            exact = [i for i in real if tgt_groups[i].call == rg.call]
            if exact and _shapes_agree(rg, tgt_groups[exact[0]]):
                choice = exact[0]
            elif real:
                best = pick_prefill_call([tgt_groups[i] for i in real], like=rg) if not rg.warmup else None
                choice = next((i for i in real if tgt_groups[i] is best), exact[0] if exact else real[0])
        if choice is None:
            unpaired_ref.append(rg)
            continue
        used.add(choice)
        pairs.append((rg, tgt_groups[choice]))
    left = [g for i, g in enumerate(tgt_groups) if i not in used]
    warm = [g for g in left if g.warmup]
    warm_ref = [g for g in unpaired_ref if g.warmup]
    real_ref = [g for g in unpaired_ref if not g.warmup]
    return Pairing(pairs, real_ref, [g for g in left if not g.warmup], warm, warm_ref)


def _one_token(g: CallGroup) -> bool:
    shape = list(g.input_ids.shape) if g.input_ids is not None else []
    return bool(shape) and shape[-1] == 1


def _shapes_agree(a: CallGroup, b: CallGroup) -> bool:
    """Block inputs of both calls have the same shapes (where both dumped them)."""
    for sk in a.order[:64]:
        shape = b.shape_of(sk[0])
        if shape is not None and shape != list(a.records[sk].shape):
            return False
    return True


def merge_rank_records(parts: list[Record]) -> Record:
    """Fold one stage's per-rank records as their manifest says (partial sums, shards, replicas)."""
    plan, ordered = manifest_plan(parts)
    return fold(ordered, plan)


def check_input_ids(pairs: list[tuple[CallGroup, CallGroup]]):
    """The gate before numerics (`ffdebug.comparison.gate`): raises InputIdsMismatch (exit 3) for
    different external inputs, returns the call where a generation diverged (or None)."""
    from ffdebug.comparison.gate import gate_inputs

    return gate_inputs(pairs)


@dataclass
class StageUnit:
    """One reference stage and what it is compared with: one target record, a fold of the
    target's ranks the manifest declares, or the target's per-rank replicas (`replicas`: each is
    compared with the reference, and a fold that explains them is tried when they disagree)."""

    group: CallGroup  # the reference's call group
    sk: tuple  # the reference's stage key (key, invocation, rank)
    ref: Record
    target: Record
    replicas: tuple[Record, ...] = ()
    note: str | None = None  # how the pair was made when not by key (`by_module_path`)

    @property
    def target_ranks(self) -> set[int]:
        if self.replicas:
            return {p.rank for p in self.replicas}
        return {p.rank for p in self.target.parts} if self.target.parts else {self.target.rank}

    def own_records(self) -> list[Record]:
        """The unit's own records: reference, target, replicas."""
        return [self.ref, self.target, *self.replicas]

    def payload_records(self) -> list[Record]:
        """The records whose tensors comparing the unit reads (none for a stats-only or
        shape-mismatched pair)."""
        out = [self.ref]
        for t in self.replicas or (self.target,):
            if list(self.ref.shape or []) == list(t.shape or []) and self.ref.has_payload and t.has_payload:
                out.append(t)
        return out if len(out) > 1 else []


@dataclass
class StagePairing:
    """The stages of one paired call: units to compare, and the records left on one side."""

    units: list[StageUnit]
    only_ref: list[Record]
    only_target: list[Record]


def _by_stage(group: CallGroup) -> tuple[list[tuple], dict[tuple, list[Record]]]:
    """(key, invocation) -> the records of every rank, in first-capture order."""
    order: list[tuple] = []
    parts: dict[tuple, list[Record]] = {}
    for sk in group.order:
        stage = (sk[0], sk[1])
        if stage not in parts:
            parts[stage] = []
            order.append(stage)
        parts[stage].append(group.records[sk])
    return order, parts


def pair_stages(rg: CallGroup, tg: CallGroup) -> StagePairing:
    """Pair the stages of one paired call across ranks.

    Same ranks on both sides: rank r with rank r. Otherwise the reference is folded to one rank
    (as its manifest declares; replicated: rank 0 stands), and then: one target rank (also
    `--rank N`): stage with stage; several: each stage's target ranks folded as the manifest
    declares (partial sums, shards), else every target rank is a replica compared with the
    reference — never a target rank left out."""
    ref_ranks, tgt_ranks = rg.ranks(), tg.ranks()
    if ref_ranks == tgt_ranks:
        return _leftovers(rg, tg, _pair_exact(rg, tg))
    if len(ref_ranks) > 1:  # the reference folded to one rank by its manifest (replicated: rank 0)
        rg = fold_all(rg)
    if len(tgt_ranks) > 1:  # every target rank compared: declared folds, else each as a replica
        return _pair_replicas(rg, tg)
    return _leftovers(rg, tg, _pair_by_stage(rg, tg))


def _leftovers(rg: CallGroup, tg: CallGroup, sp: StagePairing) -> StagePairing:
    """What the keys left, paired by module path, then by position (`comparison.leftovers`)."""
    from ffdebug.comparison.leftovers import by_module_path, by_position

    return by_position(rg, tg, by_module_path(rg, sp))


def fold_all(group: CallGroup) -> CallGroup:
    """`group` with every stage's ranks folded to one record, as its manifest declares."""
    order, parts = _by_stage(group)
    out = CallGroup(tags=group.tags, call=group.call, phase=group.phase, input_ids=group.input_ids)
    for stage in order:
        pieces = parts[stage]
        rec = pieces[0] if len(pieces) == 1 else merge_rank_records(pieces)
        sk = (stage[0], stage[1], 0)
        out.records[sk] = rec
        out.order.append(sk)
    return out


def _pair_exact(rg: CallGroup, tg: CallGroup) -> StagePairing:
    units, only_ref = [], []
    for sk in rg.order:
        t = tg.records.get(sk)
        if t is None:
            only_ref.append(rg.records[sk])
        else:
            units.append(StageUnit(rg, sk, rg.records[sk], t))
    only_target = [tg.records[sk] for sk in tg.order if sk not in rg.records]
    return StagePairing(units, only_ref, only_target)


def _pair_by_stage(rg: CallGroup, tg: CallGroup) -> StagePairing:
    """One rank on each side (whatever its number): pair by (key, invocation)."""
    tgt = {(sk[0], sk[1]): tg.records[sk] for sk in tg.order}
    ref_stages = {(sk[0], sk[1]) for sk in rg.order}
    units, only_ref = [], []
    for sk in rg.order:
        t = tgt.get((sk[0], sk[1]))
        if t is None:
            only_ref.append(rg.records[sk])
        else:
            units.append(StageUnit(rg, sk, rg.records[sk], t))
    only_target = [tg.records[sk] for sk in tg.order if (sk[0], sk[1]) not in ref_stages]
    return StagePairing(units, only_ref, only_target)


def _pair_replicas(rg: CallGroup, tg: CallGroup) -> StagePairing:
    order, parts = _by_stage(tg)
    ref_stages = {(sk[0], sk[1]): sk for sk in rg.order}
    units, only_ref = [], []
    for sk in rg.order:
        pieces = parts.get((sk[0], sk[1]))
        if pieces is None:
            only_ref.append(rg.records[sk])
            continue
        if len(pieces) == 1:
            units.append(StageUnit(rg, sk, rg.records[sk], pieces[0]))
            continue
        plan, ordered = manifest_plan(pieces)
        if isinstance(plan, Replicated):
            ordered = tuple(sorted(pieces, key=lambda r: r.rank))
            units.append(StageUnit(rg, sk, rg.records[sk], fold(ordered, plan), replicas=ordered))
        else:
            units.append(StageUnit(rg, sk, rg.records[sk], fold(ordered, plan)))
    only_target = [r for stage in order if stage not in ref_stages for r in parts[stage]]
    return StagePairing(units, only_ref, only_target)
