"""The same-inputs gate of trainer stores: a training run's inputs are compared before its numbers.

Two trainer runs fed different prompts or different noise differ everywhere, and the first
divergent stage (a block's input of the first rollout forward) would say nothing about why. So,
like the input-ids gate of model dumps (`pairing.check_input_ids`), the inputs a trainer taps under
the tap contract's names (`capture.trainer_inputs`, docs/trainer-taps.md) are compared exactly, in every paired call, before
any stage is graded; the first difference stops the comparison with exit 3, naming the input, where
it differs, and the fix: feed both runs the same prompts / noise (`reference-trainer train
--inputs-from` takes them from a target's store).
"""

from __future__ import annotations

from ffdebug.arrays import first_difference
from ffdebug.capture.trainer_inputs import TRAINER_INPUTS
from ffdebug.errors import InputIdsMismatch

FIX = (
    "feed both runs the same prompts / noise (reference-trainer train CONFIG --inputs-from TARGET_STORE "
    "takes them from the target's dump)"
)
DERIVED_FIX = (
    "--inputs-from never takes an input the configuration fixes: make the two configurations agree there"
)


def check_trainer_inputs(pairs) -> None:
    """Raise InputIdsMismatch (exit 3) at the first input stage that differs between paired calls.

    An input the reference derived from its configuration (its tap's `derived_from`, e.g. the σ
    schedule) is named with the fields it was computed from: the two runs are configured differently
    there, and no feeding fixes that."""
    import numpy as np

    for spec in TRAINER_INPUTS:
        key, what = spec.key, spec.what
        for rg, tg in pairs:
            for sk in rg.order:
                if sk[0] != key or sk not in tg.records:
                    continue
                ref_rec = rg.records[sk]
                r, t = ref_rec.load(), tg.records[sk].load()
                derived = (ref_rec.extra or {}).get("derived_from")
                verb, fix = ("differ", _derived_fix(derived)) if derived else ("differs", FIX)
                where = f"{key} ({what}) {verb} at {_where(rg)}"
                if tuple(r.shape) != tuple(t.shape):
                    raise InputIdsMismatch(f"{where}: shape {list(r.shape)} vs {list(t.shape)}; {fix}")
                if r.dtype != t.dtype or not np.array_equal(r, t):
                    raise InputIdsMismatch(f"{where}, {_first(r, t)}; {fix}")


def _derived_fix(derived: str) -> str:
    return f"the reference computes them from {derived}; {DERIVED_FIX}"


def _where(group) -> str:
    tags = dict(group.tags)
    if group.phase is not None:
        tags["phase"] = group.phase
    return ", ".join(f"{k}={v}" for k, v in tags.items()) or f"call {group.call}"


def _first(r, t) -> str:
    """Where two same-shape tensors first differ, and their values there."""
    if r.dtype != t.dtype:
        return f"dtype {r.dtype} vs {t.dtype}"
    diff = first_difference(r, t)
    if diff is None:
        return "at a NaN"
    pos, rv, tv = diff
    return f"first at index {pos}: ref {rv:.6g} vs target {tv:.6g}"
