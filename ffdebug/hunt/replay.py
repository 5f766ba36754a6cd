"""`ffdebug replay`: offline kernel isolation on one dumped stage (docs/hunt.md "Hunt: from symptom to
root cause").

The stage's inputs are its `.in` records (`KEY.in`, then `KEY.in.1`, … in recorded order; a block
stage `L003` takes `L003.hidden_in`). Each function runs on each side's inputs:

|                 | ref inputs   | target inputs |
|-----------------|--------------|---------------|
| ref function    | baseline     | input effect  |
| target function | kernel effect| the target    |

Every run is compared with the baseline. The target function away from the baseline on the
reference's own inputs (outside the ok band) is a `kernel` difference; the functions agreeing on
each input while the target's inputs move the result is an `input` difference; neither is `none`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ffdebug import verdict as V
from ffdebug.errors import FFDebugError
from ffdebug.verdict import Severity

VERDICTS = ("kernel", "input", "none")


@dataclass(frozen=True)
class ReplayRun:
    function: str  # ref | target
    inputs: str  # ref | target
    cos: float | None
    rel: float | None
    bit_equal: float | None
    severity: Severity

    def to_json(self) -> dict:
        return {
            "function": self.function,
            "inputs": self.inputs,
            "cos": self.cos,
            "rel": self.rel,
            "bit_equal": self.bit_equal,
            "severity": self.severity.value,
        }


@dataclass
class ReplayResult:
    stage: str
    inputs: list[str]  # the record keys fed to the functions, in order
    runs: list[ReplayRun]
    verdict: str
    reason: str
    notes: list[str] = field(default_factory=list)

    def run(self, function: str, inputs: str) -> ReplayRun:
        return next(r for r in self.runs if (r.function, r.inputs) == (function, inputs))

    def to_json(self) -> dict:
        return {
            "stage": self.stage,
            "inputs": self.inputs,
            "runs": [r.to_json() for r in self.runs],
            "verdict": self.verdict,
            "reason": self.reason,
            "notes": self.notes,
        }


def stage_inputs(records, stage: str) -> list:
    """The input records of `stage` in recorded order (first call, first invocation)."""
    if re.fullmatch(r"L\d+", stage):
        names = [f"{stage}.hidden_in"]
        pattern = None
    else:
        names = []
        pattern = re.compile(re.escape(f"{stage}.in") + r"(\.\d+)?$")
    out = []
    for rec in sorted(records, key=lambda r: r.seq):
        if (rec.key in names or (pattern and pattern.match(rec.key))) and not (rec.call or rec.invocation):
            if rec.key not in {r.key for r in out}:
                out.append(rec)
    return out


def _side(directory: str, side: str):
    from ffdebug.store.reader import open_side

    path = os.path.join(directory, side)
    if not os.path.isdir(path):
        raise FFDebugError(f"{directory}: no side {side!r}; replay needs DIR/ref and DIR/target")
    return open_side(path)


def _load_inputs(store, stage: str) -> tuple[list, list[str]]:
    recs = stage_inputs(store.records, stage)
    if not recs:
        raise FFDebugError(
            f"{store.path}: no input record for stage {stage!r} (expected {stage}.in or, for a block, "
            f"{stage}.hidden_in); dump it in full with its sub-stage class in FFDEBUG_FWD_DUMP_BLOCK_CLASS"
        )
    missing = [r.key for r in recs if not r.has_payload]
    if missing:
        raise FFDebugError(f"{store.path}: {missing[0]} was dumped without its tensor; dump it in full mode")
    from ffdebug.arrays import to_torch

    return [to_torch(r.load()) for r in recs], [r.key for r in recs]


def _call(fn, inputs: list, kwargs: dict, name: str):
    import torch

    with torch.no_grad():
        out = fn(*[x.clone() for x in inputs], **kwargs)
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(first, torch.Tensor):
        raise FFDebugError(
            f"{name}: must return a tensor or a tuple starting with one, not {type(out).__name__}"
        )
    return first


def _graded(function: str, inputs: str, baseline, out) -> ReplayRun:
    from ffdebug.comparison.metrics import compare_tensors

    m = compare_tensors(baseline, out)
    severity = V.shape_mismatch() if m.shape_mismatch else V.classify(m.cos, m.rel)
    return ReplayRun(function, inputs, m.cos, m.rel, m.bit_equal, severity)


def replay(
    directory: str, stage: str, ref_fn: str, target_fn: str, kwargs: dict | None = None
) -> ReplayResult:
    """Run both functions on both sides' dumped inputs of `stage` and say kernel or input."""
    from ffdebug._entry import resolve_entry

    fns = {"ref": resolve_entry(ref_fn), "target": resolve_entry(target_fn)}
    names = {"ref": f"--ref-fn {ref_fn}", "target": f"--target-fn {target_fn}"}
    ins = {}
    keys = []
    for side in ("ref", "target"):
        ins[side], keys = _load_inputs(_side(directory, side), stage)
    if len(ins["ref"]) != len(ins["target"]):
        raise FFDebugError(f"{stage}: the sides recorded {len(ins['ref'])} and {len(ins['target'])} inputs")
    baseline = _call(fns["ref"], ins["ref"], kwargs or {}, names["ref"])
    runs = [
        _graded(f, i, baseline, _call(fns[f], ins[i], kwargs or {}, names[f]))
        for f in ("ref", "target")
        for i in ("ref", "target")
    ]
    result = ReplayResult(stage=stage, inputs=keys, runs=runs, verdict="none", reason="")
    kernel = result.run("target", "ref")
    moved = result.run("ref", "target")
    if kernel.severity is not Severity.OK:
        result.verdict = "kernel"
        result.reason = (
            f"on the reference's own inputs the target function is {kernel.severity.value} "
            f"(rel {_pct(kernel.rel)}): the computation differs"
        )
    elif moved.severity is not Severity.OK:
        result.verdict = "input"
        result.reason = (
            f"both functions agree on the same inputs, and the target's inputs move the reference function's "
            f"result to {moved.severity.value} (rel {_pct(moved.rel)}): the error arrives with the input"
        )
    else:
        result.reason = "every run is inside the ok band of the baseline: this stage reproduces on both sides"
    return result


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.3g}%"
