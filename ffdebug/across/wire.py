"""The serialised forms that cross between processes of a compare across nodes: a stage result
(every dataclass field, so the receiving side rebuilds the same object; not the JSON contract's
`to_json`, which drops and renames), a fold plan, and the record references of
`ffdebug.comparison.forked`. JSON only: nothing is pickled, nothing executes on receipt."""

from __future__ import annotations

import dataclasses

from ffdebug.results import StageResult, TensorMeta
from ffdebug.verdict import Severity

_SEVERITY_FIELDS = ("severity", "severity_rank0")
_TUPLE_FIELDS = ("call_dtypes",)


def stage_to_wire(e: StageResult) -> dict:
    out = {}
    for f in dataclasses.fields(StageResult):
        v = getattr(e, f.name)
        if f.name in _SEVERITY_FIELDS:
            v = v.value if v is not None else None
        elif isinstance(v, TensorMeta):
            v = {"dtype": v.dtype, "shape": v.shape}
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def stage_from_wire(d: dict) -> StageResult:
    names = {f.name for f in dataclasses.fields(StageResult)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(
            f"stage result with unknown fields {sorted(unknown)}: the processes run different ffdebug versions"
        )
    kw = dict(d)
    for name in _SEVERITY_FIELDS:
        if kw.get(name) is not None:
            kw[name] = Severity(kw[name])
    for name in ("ref", "target"):
        kw[name] = TensorMeta(**kw[name])
    for name in _TUPLE_FIELDS:
        if kw.get(name) is not None:
            kw[name] = tuple(kw[name])
    return StageResult(**kw)


def _plan_classes() -> dict:
    from ffdebug.io import ranks

    out = {}
    todo = [ranks.Plan]
    while todo:
        cls = todo.pop()
        out[cls.__name__] = cls
        todo.extend(cls.__subclasses__())
    return out


def plan_to_wire(plan) -> dict:
    from ffdebug.io.ranks import Plan

    def value(v):
        if isinstance(v, Plan):
            return plan_to_wire(v)
        if isinstance(v, (tuple, list)):
            return {"seq": [value(x) for x in v], "tuple": isinstance(v, tuple)}
        return v

    return {
        "plan": type(plan).__name__,
        "fields": {f.name: value(getattr(plan, f.name)) for f in dataclasses.fields(plan)},
    }


def plan_from_wire(d: dict):
    classes = _plan_classes()
    if d.get("plan") not in classes:
        raise ValueError(f"unknown fold plan {d.get('plan')!r}: the processes run different ffdebug versions")

    def value(v):
        if isinstance(v, dict) and "plan" in v:
            return plan_from_wire(v)
        if isinstance(v, dict) and "seq" in v:
            items = [value(x) for x in v["seq"]]
            return tuple(items) if v["tuple"] else items
        return v

    return classes[d["plan"]](**{k: value(v) for k, v in d["fields"].items()})


def refs_to_wire(refs: list[tuple]) -> list:
    """`forked.record_refs` output: indices stay, a fold is its plan and parts; a record that is
    neither (none today) is sent as null and stands as the unit's own pair on arrival."""
    from ffdebug.comparison.forked import FoldRef

    def one(x):
        if isinstance(x, int):
            return x
        if isinstance(x, FoldRef):
            return {"fold": plan_to_wire(x.plan), "parts": list(x.parts)}
        return None

    return [[one(x) for x in pair] for pair in refs]


def refs_from_wire(wire: list) -> list[tuple]:
    from ffdebug.comparison.forked import FoldRef

    def one(x, k):
        if x is None:
            return k  # the unit's own ref (0) / target (1)
        if isinstance(x, dict):
            return FoldRef(plan_from_wire(x["fold"]), tuple(x["parts"]))
        return x

    return [tuple(one(x, k) for k, x in enumerate(pair)) for pair in wire]
