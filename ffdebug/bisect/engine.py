"""`bisect(ref, target)`: the first layer that introduces error, per layer class, the pattern, and
the sub-stage inside the first bad layer (dump-bisect phases 4 and 5).

Pipeline:
  1. compare the two sides (input-ids gate, call pairing with warm-up set aside, ranks folded,
     float64 metrics, bands, noise calibration) — `ffdebug.compare.engine.compare`;
  2. multi-rank target stages that disagree: try partial sums / shard concatenation (`shards`);
  3. per paired call, the layer error budget and the pattern (`pattern`); optionally re-run the
     target blocks on the reference's inputs to tell local from inherited error (`attribution`);
  4. inside the focus layer, the first block-level stage and the first sub-stage whose own step
     loses accuracy (`substage`);
  5. the result: DESIGN §5's stable JSON keys plus extras, and one sentence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ffdebug.bisect import pattern as pat
from ffdebug.bisect import shards
from ffdebug.bisect.substage import first_lossy
from ffdebug.compare.severity import RANK, at_least, worst
from ffdebug.models.blocks import declared_class, parse_layer_class_spec


@dataclass
class BisectResult:
    """Where the target first parts from the reference. Truthy when nothing is at/above `fail_on`."""

    verdict: str
    pattern: str
    first_divergence: dict | None
    per_class: list[dict]
    sub_stage: dict | None
    layers: list[dict]
    stages: list[dict]
    ref_path: str
    target_path: str
    fail_on: str = "diverge"
    call: dict = field(default_factory=dict)
    calls: list[dict] = field(default_factory=list)
    reason: str = ""
    signal: str | None = None
    judgement: str | None = None  # the verdict, raised to `bug` when `signal` is set; decides the exit code
    shards: list[dict] = field(default_factory=list)
    attribution: list[dict] | None = None
    warmup_skipped: int = 0
    notes: list[str] = field(default_factory=list)

    def failed(self, fail_on: str | None = None) -> bool:
        return at_least(self.judgement or self.verdict, fail_on or self.fail_on)

    def __bool__(self) -> bool:
        return not self.failed()

    @property
    def conclusion(self) -> str:
        from ffdebug.report.bisect_text import bisect_sentence

        return bisect_sentence(self)

    def to_json(self) -> dict:
        return {
            "verdict": self.verdict,
            "first_divergence": self.first_divergence,
            "pattern": self.pattern,
            "per_class": self.per_class,
            "sub_stage": self.sub_stage,
            "reason": self.reason,
            "signal": self.signal,
            "judgement": self.judgement or self.verdict,
            "layers": self.layers,
            "call": self.call,
            "calls": self.calls,
            "shards": self.shards,
            "attribution": self.attribution,
            "warmup_skipped": self.warmup_skipped,
            "stages": self.stages,
            "ref": self.ref_path,
            "target": self.target_path,
            "notes": self.notes,
            "fail_on": self.fail_on,
            "passed": not self.failed(),
            "conclusion": self.conclusion,
        }


def _relabel(stages: list[dict], spec: str | None) -> None:
    if not spec:
        return
    parsed = parse_layer_class_spec(spec)
    for e in stages:
        if e.get("layer") is not None:
            e["layer_class"] = declared_class(parsed, e["layer"]) or e.get("layer_class")


def _explain_shards(result, notes: list[str]) -> list[dict]:
    """Multi-rank target stages: the reading that matches; re-grade those explained."""
    out = []
    for e, (r, t) in zip(result.stages, result.records):
        info = shards.explain_stage(e, r, t)
        if info is None:
            continue
        out.append(info)
        if not info["declared"] and info["matches"]:
            e["severity_rank0"] = e["severity"]
            e.update(severity="ok", cos=info["cos"], rel=info["rel"], finding="shard_reading")
            e["notes"].append(f"target ranks match as the {info['explained_by']}; declare it in the dump")
    if any(i["matches"] and not i["declared"] for i in out):
        notes.append(
            "some target stages are per-rank pieces of the reference's tensor (see shards); tag them "
            "with reduction='partial' or shard={dim,index,count} so they are folded automatically"
        )
    return out


def _entry(e: dict | None) -> dict | None:
    if e is None:
        return None
    return {k: e.get(k) for k in ("layer", "layer_class", "stage", "key", "severity", "cos", "rel")}


EXACT_PREFIX_SIGNAL = "error appears after exactly equal stages in the same dtype"


def _folded_from_ranks(e: dict) -> bool:
    """A stage whose tensor ffdebug assembled from per-rank dumps (declared and folded by compare,
    or explained by a shard reading here)."""
    return bool(e.get("unsharded_ref") or e.get("unsharded_target") or e.get("finding") == "shard_reading")


def break_in_exact_prefix(stages: list[dict]) -> dict | None:
    """The first stage (execution order) that is not exactly equal while every earlier one is, in
    the same dtype on both sides and outside the noise run's reach; None when there is no such
    stage. Nothing upstream differs, so this stage's own computation does: a bug signal however
    small its error (DESIGN §4)."""
    for e in stages:
        if pat.is_exact(e):
            continue
        if _folded_from_ranks(e):
            # ffdebug itself summed or joined per-rank pieces for this stage: its bits are not the
            # engine's, so an ok-band difference here ends the exact prefix without a signal.
            return None if e["severity"] == "ok" else e
        same_dtype = e.get("dtype_ref") == e.get("dtype_target")
        return e if same_dtype and e.get("rel") is not None and not pat.within_noise(e) else None
    return None


def _in_layer(stages: list[dict], layer) -> list[dict]:
    return [e for e in stages if layer is not None and e.get("layer") == layer]


def _analyse_call(stages: list[dict], attribution: list[dict] | None) -> dict:
    rows = pat.layer_rows(stages)
    by_key = {e["key"]: e for e in stages}
    for a in attribution or []:
        row = next((r for r in rows if r.layer == a["layer"]), None)
        if row is not None:
            row.local = a["verdict"]
    pat.mark_introducing(rows, by_key)
    p = pat.decide(rows)
    signal = p.signal
    if p.focus is not None and p.name != "drift":
        in_layer = _in_layer(stages, p.focus.layer)
        first = first_lossy(in_layer, block_only=True)[0] or by_key.get(f"L{p.focus.layer:03d}.hidden_out")
    else:  # no single layer to blame: the first stage outside the ok band
        first = next((e for e in stages if e["severity"] != "ok"), None)
        if p.name == "match" and first is None:
            first = break_in_exact_prefix(stages)
            signal = EXACT_PREFIX_SIGNAL if first is not None else None
    sub, why_sub = first_lossy(_in_layer(stages, (first or {}).get("layer")))
    return {"rows": rows, "pattern": p, "first": first, "sub": sub, "why_sub": why_sub, "signal": signal}


def _per_class(rows: list[pat.LayerRow], p: pat.Pattern) -> list[dict]:
    """Per layer class: its layers, the first bad layer, the layers introducing error.

    `first_bad_layer` is the first layer of the class that the pattern blames when it localises
    the error (jump: the focus; layer_class: the introducing layers), so a class that merely
    carries inherited error has none; for drift and match it is the first layer whose block output
    is outside the ok band. `first_over_threshold` is always the latter."""
    out: dict[str, dict] = {}
    blamed = {p.focus.layer} if p.name == "jump" else set(p.introducing) if p.name == "layer_class" else None
    for r in rows:
        cls = r.layer_class or "?"
        c = out.setdefault(
            cls,
            {
                "layer_class": cls,
                "layers": [],
                "first_bad_layer": None,
                "first_over_threshold": None,
                "introducing": [],
                "max_added": None,
            },
        )
        c["layers"].append(r.layer)
        if r.introduces:
            c["introducing"].append(r.layer)
        if r.added is not None:
            c["max_added"] = r.added if c["max_added"] is None else max(c["max_added"], r.added)
        if r.severity != "ok" and c["first_over_threshold"] is None:
            c["first_over_threshold"] = r.layer
        bad = r.severity != "ok" if blamed is None else r.layer in blamed
        if bad and c["first_bad_layer"] is None:
            c["first_bad_layer"] = r.layer
    return list(out.values())


def bisect(
    ref,
    target,
    *,
    layers=None,
    stages=(),
    step: dict | None = None,
    rank: int | None = None,
    thresholds=(),
    noise=None,
    fail_on: str = "diverge",
    layer_class: str | None = None,
    model_ref: str | None = None,
    model_target: str | None = None,
):
    """Localise the first divergence of `target` from `ref` (paths or opened stores).

    Raises InputIdsMismatch (exit 3) when the sides were fed different input ids, FFDebugError
    (exit 2) on unreadable input or a bad option.
    """
    from ffdebug.compare.engine import compare
    from ffdebug.errors import FFDebugError

    if model_ref and not model_target:
        raise FFDebugError("--model-ref needs --model-target too (the block to re-run is the target's)")
    result = compare(
        ref,
        target,
        layers=layers,
        stages=tuple(stages),
        step=step,
        rank=rank,
        thresholds=tuple(thresholds),
        noise=noise,
        fail_on=fail_on,
    )
    notes = list(result.notes)
    _relabel(result.stages, layer_class)
    shard_info = _explain_shards(result, notes)

    # one analysis per paired call; the first call that is not a clean match is the one reported
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(result.stages):
        groups.setdefault((tuple(sorted((e.get("step") or {}).items())), e.get("call")), []).append(i)
    analyses = []
    for (tags, call), idx in groups.items():
        st = [result.stages[i] for i in idx]
        analyses.append(((tags, call), idx, st, _analyse_call(st, None)))
    if not analyses:
        raise FFDebugError(f"{result.ref_path} and {result.target_path}: no stage appears on both sides")
    chosen = next(
        (a for a in analyses if a[3]["pattern"].name != "match" or a[3]["first"] is not None), analyses[0]
    )
    (tags, call), idx, st, analysis = chosen
    attribution = None
    if model_target:
        from ffdebug.bisect.attribution import attribute

        attribution = attribute(model_ref, model_target, [result.records[i] for i in idx], st)
        analysis = _analyse_call(st, attribution)

    p = analysis["pattern"]
    verdict = worst(*(e["severity"] for e in result.stages)) if result.stages else "ok"
    first, sub, signal = analysis["first"], analysis["sub"], analysis["signal"]
    sub_out = None
    if sub is not None:
        sub_out = {k: sub.get(k) for k in ("stage", "key", "severity", "cos", "rel")}
        sub_out["why"] = analysis["why_sub"]
    calls = [
        {
            "call": c,
            "step": dict(t),
            "pattern": a["pattern"].name,
            "verdict": worst(*(x["severity"] for x in s)),
        }
        for (t, c), _i, s, a in analyses
    ]
    if len(analyses) > 1:
        notes.append(f"{len(analyses)} paired calls; reporting call {call} {dict(tags) or ''}".rstrip())
    return BisectResult(
        verdict=verdict,
        pattern=p.name,
        first_divergence=_entry(first),
        per_class=_per_class(analysis["rows"], p),
        sub_stage=sub_out,
        layers=[r.to_json() for r in analysis["rows"]],
        stages=st,
        ref_path=result.ref_path,
        target_path=result.target_path,
        fail_on=fail_on,
        call={"call": call, "step": dict(tags)},
        calls=calls,
        reason=p.reason,
        signal=signal,
        judgement=worst(verdict, "bug") if signal else verdict,
        shards=shard_info,
        attribution=attribution,
        warmup_skipped=result.warmup_skipped,
        notes=notes,
    )


__all__ = ["BisectResult", "bisect", "RANK"]
