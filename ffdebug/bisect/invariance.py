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

from ffdebug.compare.metrics import compare_tensors
from ffdebug.compare.severity import at_least, classify, worst
from ffdebug.errors import FFDebugError, InputIdsMismatch

MEANING = {
    "numerical": "not bit-identical but inside the ok band: batch-variant kernels, a kernel-stack "
    "property rather than a model bug",
    "slot_bug": "outside the ok band: slot-dependent logic (mask, positions, cache slot, a reduction "
    "over the batch)",
}


@dataclass
class InvarianceResult:
    slots: int
    slot_dim: int
    stages: list[dict]
    path: str
    single_path: str | None = None
    fail_on: str = "drift"
    exact: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        sev = [s["worst"]["severity"] for s in self.stages if s["worst"]]
        sev += [s["single"]["severity"] for s in self.stages if s.get("single")]
        return worst(*sev) if sev else "ok"

    @property
    def first_non_invariant(self) -> dict | None:
        for s in self.stages:
            for cmp in s["slots"] + ([s["single"]] if s.get("single") else []):
                if (cmp.get("bit_equal") or 0.0) < 1.0:
                    cls = "numerical" if cmp["severity"] == "ok" else "slot_bug"
                    return dict(
                        cmp, key=s["key"], layer=s.get("layer"), classification=cls, meaning=MEANING[cls]
                    )
        return None

    @property
    def first_slot_bug(self) -> dict | None:
        for s in self.stages:
            for cmp in s["slots"] + ([s["single"]] if s.get("single") else []):
                if cmp["severity"] != "ok":
                    return dict(cmp, key=s["key"], layer=s.get("layer"))
        return None

    def failed(self) -> bool:
        if self.exact and self.first_non_invariant is not None:
            return True
        return at_least(self.verdict, self.fail_on)

    def __bool__(self) -> bool:
        return not self.failed()

    def to_json(self) -> dict:
        from ffdebug.report.bisect_text import invariance_sentence

        return {
            "verdict": self.verdict,
            "slots": self.slots,
            "slot_dim": self.slot_dim,
            "first_non_invariant": self.first_non_invariant,
            "first_slot_bug": self.first_slot_bug,
            "stages": self.stages,
            "path": self.path,
            "single": self.single_path,
            "notes": self.notes,
            "fail_on": self.fail_on,
            "passed": not self.failed(),
            "conclusion": invariance_sentence(self),
        }


def split_slots(t, slots: int, dim: int):
    """The `slots` slot tensors of `t` along `dim`, or None when the dim does not divide."""
    if t.dim() <= dim:
        return None
    n = t.shape[dim]
    if n == slots:
        return [t.select(dim, i) for i in range(slots)]
    if n % slots == 0 and n > slots:
        return list(t.chunk(slots, dim=dim))
    return None


def _cmp(a, b, slot, against: str) -> dict:
    m = compare_tensors(a, b)
    return {
        "slot": slot,
        "against": against,
        "cos": m.cos,
        "rel": m.rel,
        "max_abs": m.max_abs,
        "bit_equal": m.bit_equal,
        "severity": classify(m.cos, m.rel),
    }


def _records(store, step: dict | None, call: int | None):
    from ffdebug.compare.pairing import Filters, group_calls

    groups = [g for g in group_calls(store, Filters(step=dict(step or {}))) if not g.warmup]
    if call is not None:
        groups = [g for g in groups if g.call == call]
    if not groups:
        raise FFDebugError(f"{store.path}: no non-warm-up call to check; check --step / --call")
    g = groups[0]
    return [g.records[sk] for sk in g.order if sk[2] == 0]


def slot_invariance(
    side,
    slots: int,
    slot_dim: int = 0,
    single=None,
    stages=(),
    step: dict | None = None,
    call: int | None = None,
    fail_on: str = "drift",
    exact: bool = False,
) -> InvarianceResult:
    """Compare every slot of a batched run with slot 0 (and slot 0 with a single-prompt run)."""
    import fnmatch

    from ffdebug.store.reader import SideStore, open_side

    if slots < 2:
        raise FFDebugError(f"--slots {slots}: give the batch size of the run, at least 2")
    store = side if isinstance(side, SideStore) else open_side(side)
    single_store = None
    if single is not None:
        single_store = single if isinstance(single, SideStore) else open_side(single)
    recs = _records(store, step, call)
    single_recs = {r.key: r for r in _records(single_store, step, None)} if single_store else {}
    out: list[dict] = []
    notes: list[str] = []
    skipped = []
    for r in recs:
        if stages and not any(fnmatch.fnmatchcase(r.key, g) for g in stages):
            continue
        if not r.has_payload:
            skipped.append(r.key)
            continue
        t = r.load()
        parts = split_slots(t, slots, slot_dim)
        if parts is None:
            skipped.append(r.key)
            continue
        if r.key == "embed.input_ids":
            for i, p in enumerate(parts[1:], start=1):
                if not bool((p == parts[0]).all()):
                    raise InputIdsMismatch(
                        f"{store.path}: slot {i}'s input ids differ from slot 0's; fill every slot with "
                        "the same prompt for a slot-invariance run"
                    )
        entry = {
            "key": r.key,
            "layer": r.layer,
            "layer_class": r.layer_class,
            "slots": [_cmp(parts[0], p, i, "slot 0") for i, p in enumerate(parts[1:], start=1)],
            "single": None,
        }
        s = single_recs.get(r.key)
        if s is not None and s.has_payload:
            st = s.load()
            one = split_slots(st, 1, slot_dim) if st.dim() > slot_dim and st.shape[slot_dim] == 1 else [st]
            if one and tuple(one[0].shape) == tuple(parts[0].shape):
                entry["single"] = _cmp(one[0], parts[0], 0, "single-prompt run")
        entry["worst"] = max(entry["slots"], key=lambda c: (c["rel"] or 0.0, -(c["bit_equal"] or 0.0)))
        out.append(entry)
    if skipped:
        notes.append(
            f"{len(skipped)} stage(s) not split into {slots} slots along dim {slot_dim} (e.g. {skipped[0]})"
        )
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
        fail_on=fail_on,
        exact=exact,
        notes=notes,
    )
