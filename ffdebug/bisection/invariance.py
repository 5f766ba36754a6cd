"""Batch-slot invariance (dump-bisect phase 8): the same prompt in every slot of a batch must give
the same tensors in every slot, and the same as a single-prompt run.

Each stage tensor of the batched run is split along `slot_dim` into `slots` slots (index when the
dim has exactly `slots` entries, equal chunks when it is a multiple: token-flattened batches) and
every slot is compared with slot 0; with `single`, slot 0 is also compared with the single-prompt
run's tensor. The first stage that is not bit-identical is classified:

  numerical  not bit-equal but inside the ok band: batch-variant kernels (reduction order depends
             on the batch shape). Expected unless the stack promises batch invariance; a
             kernel-stack property, not a model bug.
  slot_bug   outside the ok band: slot-dependent logic (masks, positions, cache slots, a reduction
             over the batch dim) — a real bug.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ffdebug import verdict as V
from ffdebug.comparison.metrics import compare_tensors
from ffdebug.coverage import Coverage, side_coverage, side_sentences
from ffdebug.errors import FFDebugError, InputIdsMismatch
from ffdebug.results import InvarianceResult, SlotCompare, SlotStage
from ffdebug.verdict import Severity


def split_slots(t, slots: int, dim: int):
    """The `slots` slot arrays of `t` along `dim`, or None when the dim does not divide."""
    import numpy as np

    if t.ndim <= dim:
        return None
    n = t.shape[dim]
    if n == slots:
        return [np.take(t, i, axis=dim) for i in range(slots)]
    if n % slots == 0 and n > slots:
        return list(np.split(t, slots, axis=dim))
    return None


def _cmp(a, b, slot, against: str) -> SlotCompare:
    m = compare_tensors(a, b)
    return SlotCompare(slot, against, m.cos, m.rel, m.max_abs, m.bit_equal, V.classify(m.cos, m.rel))


@dataclass(frozen=True)
class Checked:
    """The records of the call and rank checked, and what else the run holds (coverage)."""

    records: list
    other_calls: int  # non-warm-up calls of the run not checked
    other_ranks: list[int]  # ranks of the run not checked


def _records(store, step: dict | None, call: int | None) -> Checked:
    from ffdebug.comparison.pairing import Filters, group_calls

    every = [g for g in group_calls(store, Filters(step=dict(step or {}))) if not g.warmup]
    groups = [g for g in every if g.call == call] if call is not None else every
    if not groups:
        raise FFDebugError(f"{store.path}: no non-warm-up call to check; check --step / --call")
    g = groups[0]
    rank = min(g.ranks())
    records = [g.records[sk] for sk in g.order if sk[2] == rank]
    return Checked(records, len(every) - 1, sorted(g.ranks() - {rank}))


@dataclass
class _Walk:
    """What one pass over the batched run's stages found."""

    stages: list = field(default_factory=list)  # SlotStage
    skipped: list = field(default_factory=list)  # not split into the slots
    stats_only: list = field(default_factory=list)
    not_in_single: list = field(default_factory=list)


def _check_input_ids(parts, path: str) -> None:
    for i, p in enumerate(parts[1:], start=1):
        if not bool((p == parts[0]).all()):
            raise InputIdsMismatch(
                f"{path}: slot {i}'s input ids differ from slot 0's; fill every slot with "
                "the same prompt for a slot-invariance run"
            )


def _slot_stage(r, parts, single, slot_dim: int) -> SlotStage:
    """Every slot against slot 0, and slot 0 against the single-prompt run's record `single`."""
    entry = SlotStage(
        key=r.key,
        layer=r.layer,
        layer_class=r.layer_class,
        slots=[_cmp(parts[0], p, i, "slot 0") for i, p in enumerate(parts[1:], start=1)],
    )
    if single is not None and single.has_payload:
        st = single.load()
        one = split_slots(st, 1, slot_dim) if st.ndim > slot_dim and st.shape[slot_dim] == 1 else [st]
        if one and tuple(one[0].shape) == tuple(parts[0].shape):
            entry.single = _cmp(one[0], parts[0], 0, "single-prompt run")
    return entry


def _walk(store, recs, single_recs: dict, has_single: bool, slots: int, slot_dim: int, stages) -> _Walk:
    import fnmatch

    walk = _Walk()
    for r in recs:
        if stages and not any(fnmatch.fnmatchcase(r.key, g) for g in stages):
            continue
        if not r.has_payload:
            walk.stats_only.append(r.key)
            continue
        parts = split_slots(r.load(), slots, slot_dim)
        if parts is None:
            walk.skipped.append(r.key)
            continue
        if r.key == "embed.input_ids":
            _check_input_ids(parts, store.path)
        entry = _slot_stage(r, parts, single_recs.get(r.key), slot_dim)
        if has_single and entry.single is None:
            walk.not_in_single.append(r.key)
        walk.stages.append(entry)
    return walk


def _coverage(
    walk: _Walk, store, single_store, checked: Checked, slots: int, slot_dim: int, stages, call
) -> Coverage:
    """What the check compared and left out (docs/architecture.md: coverage blocks exit 0)."""
    coverage = Coverage(paired=len(walk.stages), sides={"batched": side_coverage(store)})
    if single_store is not None:
        coverage.sides["single"] = side_coverage(single_store)
    for label, side in coverage.sides.items():
        coverage.missing.extend(side_sentences(label, side))
    if walk.skipped:
        coverage.missing.append(
            f"{len(walk.skipped)} stage(s) not split into {slots} slots along dim {slot_dim}: "
            f"{', '.join(walk.skipped[:8])}" + (" …" if len(walk.skipped) > 8 else "")
        )
    if walk.stats_only:
        coverage.stats_only = len(walk.stats_only)
        coverage.missing.append(
            f"{len(walk.stats_only)} stage(s) dumped as statistics only: slots cannot be compared"
        )
    if walk.not_in_single:
        coverage.missing.append(
            f"{len(walk.not_in_single)} stage(s) without a same-shape counterpart in the single-prompt run: "
            + ", ".join(walk.not_in_single[:8])
        )
    if stages:
        coverage.selected_out.append(f"--stages {' '.join(stages)}")
    if checked.other_ranks:
        ranks = ", ".join(str(r) for r in checked.other_ranks)
        coverage.missing.append(f"rank(s) {ranks} of the batched run were not checked (one rank is read)")
    if checked.other_calls:
        sentence = f"{checked.other_calls} other non-warm-up call(s) of the batched run were not checked"
        if call is not None:
            coverage.selected_out.append(f"--call {call}: {sentence}")
        else:
            coverage.missing.append(sentence + "; pick one with --call (each call is a separate check)")
    return coverage


def slot_invariance(
    side,
    slots: int,
    slot_dim: int = 0,
    single=None,
    stages=(),
    step: dict | None = None,
    call: int | None = None,
    fail_on: Severity | str = Severity.DRIFT,
    exact: bool = False,
    allow_partial: bool = False,
) -> InvarianceResult:
    """Compare every slot of a batched run with slot 0 (and slot 0 with a single-prompt run)."""
    from ffdebug.store.reader import SideStore, open_side

    if slots < 2:
        raise FFDebugError(f"--slots {slots}: give the batch size of the run, at least 2")
    if slot_dim < 0:
        raise FFDebugError(
            f"--slot-dim {slot_dim}: give the dim of the batch slots, 0 or more (e.g. --slot-dim 0)"
        )
    store = side if isinstance(side, SideStore) else open_side(side)
    single_store = None
    if single is not None:
        single_store = single if isinstance(single, SideStore) else open_side(single)
    checked = _records(store, step, call)
    single_recs = {r.key: r for r in _records(single_store, step, None).records} if single_store else {}
    walk = _walk(store, checked.records, single_recs, single_store is not None, slots, slot_dim, stages)
    coverage = _coverage(walk, store, single_store, checked, slots, slot_dim, stages, call)
    out, notes = walk.stages, []
    if not out:
        raise FFDebugError(
            f"{store.path}: no stage has {slots} slots along dim {slot_dim}; check --slots / --slot-dim"
        )
    return InvarianceResult(
        slots=slots,
        slot_dim=slot_dim,
        stages=out,
        path=store.path,
        single_path=None if single_store is None else single_store.path,
        fail_on=V.parse_fail_on(fail_on),
        exact=exact,
        notes=notes,
        coverage=coverage,
        allow_partial=allow_partial,
    )
