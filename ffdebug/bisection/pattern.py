"""Per-layer error budget and the pattern of a divergence (README "Comparing" and "--json" keys).

For every layer L with a block input and output dumped on both sides (rel against the reference):

    rel_in(L)  = rel of L's hidden_in          (error the layer inherits)
    rel_out(L) = rel of L's hidden_out         (error it passes on)
    added(L)   = rel_out(L) - rel_in(L)        (error it adds; README: error out − error in)

A layer *introduces* error when `added` is beyond noise: above k x the noise run's added error
for that layer (k = 2 for fp32, 3 for bf16/fp16) when a noise run is given, else above a rounding
estimate for the dtype (`ROUNDING_EPS` x the machine epsilon of the dtype both sides run in: 9.5e-7
for fp32, 6.3e-2 for bf16; of the more precise side when the dtypes differ, so a bf16 target of an
fp32 reference, whose layers each add ~1e-3, is the `drift` of a dtype difference), and in both cases above `INHERIT_SHARE` (10%) of what the layer inherits
(a healthy layer fed a wrong input passes the error on amplified a little: the layer after a
one-layer bug added 12-14% of what it inherited on the cases we measured, a layer with its own bug
17% and more; the jump ratio, not this share, tells the two apart). When attribution re-ran the layers on the reference's inputs, its verdict (local /
inherited) replaces this estimate.

Saturation: once a layer's output has decorrelated from the reference (cos <= 0.5, the scramble
band, or rel >= 50%), the error cannot grow much further and what later layers add says nothing about them:
`saturated_after` is that layer, and the layers after it are not judged (never "the only layer").

Pattern, over the judged layers, in this order:
  match       no layer introduces error;
  layer_class two or more layers introduce error, all of one class, while the layers of the other
              classes stay at noise (needs two classes or more);
  jump        the first to show any error after an exactly equal prefix in the same dtype (past
              layer 0), or one layer that adds at least `JUMP_RATIO` (4) x every other introducing
              layer (measured on the ports in tests/bisect/test_patterns.py: one-layer bugs add 7.6x
              to 1e6x the next layer; an error spread over many layers 1x-2x);
  drift       otherwise, over the layers that add comparable error (within `JUMP_RATIO` of the
              largest); layers that add less are named, not blamed.

A localised pattern (jump, layer_class) carries a bug *signal* when its focus layer got an exactly
equal input in the same dtype (nothing but that layer can explain the error, however small), when
attribution found the error local to it, or when a noise run was given and the layer adds more than
k x the noise run's error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ffdebug import verdict as V
from ffdebug.results import LayerRow, StageResult
from ffdebug.verdict import PatternName

INHERIT_SHARE = 0.1  # a layer must add more than this share of the error it inherits
JUMP_RATIO = 4.0  # one layer adds this many times more than any other introducing layer: a jump
ROUNDING_EPS = 8.0  # without a noise run, a layer must add more than this many machine epsilons
SATURATED_COS = 0.5  # a block output at or below this cos has decorrelated (the scramble band)
SATURATED_REL = 0.5  # or whose error is half its norm: later layers' own error is lost in it

_LAYER_KEY = re.compile(r"^L(\d+)\.(hidden_in|hidden_out)$")


def noise_factor(stage: StageResult) -> float:
    """The noise rule's k for one stage (see `ffdebug.verdict.noise_factor`)."""
    return V.noise_factor(stage.dtype_ref, stage.dtype_target)


def within_noise(e: StageResult) -> bool:
    """The stage's error is no more than k x the noise run's at the same stage."""
    return V.within_noise(e.rel, e.noise_rel, noise_factor(e))


def is_exact(e: StageResult | None) -> bool:
    """Bit-equal and of the same dtype on both sides."""
    return e is not None and e.exact


def layer_rows(stages: list[StageResult]) -> list[LayerRow]:
    """Layer error budgets from the stages of one paired call (execution order)."""
    ins: dict[int, StageResult] = {}
    outs: dict[int, StageResult] = {}
    for e in stages:
        m = _LAYER_KEY.match(e.key)
        if not m or (e.invocation or 0) != 0:
            continue
        target = ins if m.group(2) == "hidden_in" else outs
        target.setdefault(int(m.group(1)), e)
    rows: list[LayerRow] = []
    prev_out: StageResult | None = next((e for e in stages if e.key == "embed.out"), None)
    for layer in sorted(set(ins) | set(outs)):
        e_in, e_out = ins.get(layer, prev_out), outs.get(layer)
        cls = (e_out or e_in).layer_class if (e_out or e_in) is not None else None
        row = LayerRow(layer=layer, layer_class=cls)
        if e_in is not None:
            row.rel_in, row.cos_in, row.exact_in = e_in.rel, e_in.cos, is_exact(e_in)
        elif not rows:
            row.rel_in, row.cos_in = 0.0, 1.0
            row.notes.append("no block input dumped: assumed error-free (not evidence of an exact input)")
        if e_out is not None:
            row.rel_out, row.cos_out = e_out.rel, e_out.cos
            row.severity, row.exact_out = e_out.severity, is_exact(e_out)
            if e_out.noise_rel is not None:
                row.noise_rel_out = e_out.noise_rel
                n_in = (e_in.noise_rel if e_in is not None else None) or 0.0
                row.noise_added = e_out.noise_rel - n_in
        if row.rel_in is not None and row.rel_out is not None:
            row.added = row.rel_out - row.rel_in
        rows.append(row)
        prev_out = e_out
    return rows


def rounding_floor(stage: StageResult | None) -> float:
    """The rounding estimate without a noise run: ROUNDING_EPS x the machine epsilon of the dtype
    both sides run in (of the more precise one when they differ: a dtype difference is itself the
    error `drift` describes, not noise to hide); fp32 when unknown."""
    import torch

    eps = [
        torch.finfo(dtype).eps
        for d in ((stage.dtype_ref, stage.dtype_target) if stage is not None else ())
        if d and isinstance(dtype := getattr(torch, d, None), torch.dtype) and dtype.is_floating_point
    ]
    return ROUNDING_EPS * (min(eps) if eps else torch.finfo(torch.float32).eps)


def saturated_after(rows: list[LayerRow]) -> int | None:
    """The first layer whose block output has decorrelated from the reference (cos <= 0.5 or
    rel >= 50%)."""
    for r in rows:
        if (r.cos_out is not None and r.cos_out <= SATURATED_COS) or (
            r.rel_out is not None and r.rel_out >= SATURATED_REL
        ):
            return r.layer
    return None


def mark_introducing(rows: list[LayerRow], stages_by_key: dict[str, StageResult]) -> None:
    """Set `row.introduces` from attribution where it ran, else from the error budget; layers after
    saturation are not judged (they never introduce)."""
    sat = saturated_after(rows)
    for row in rows:
        if sat is not None and row.layer > sat:
            row.introduces = False
            row.notes.append(f"not judged: the target decorrelated at layer {sat}")
            continue
        if row.local is not None:
            row.introduces = row.local == "local"
            continue
        if row.added is None:
            row.introduces = not V.is_ok(row.severity)
            continue
        row.introduces = row.added > max(noise_floor(row, stages_by_key), INHERIT_SHARE * (row.rel_in or 0.0))


def noise_floor(row: LayerRow, stages_by_key: dict[str, StageResult]) -> float:
    """k x the error the noise run adds at this layer; without a noise run, the rounding estimate.

    Judged on the error *added*, not on the error carried: a layer that adds 10x the noise is
    introducing error even while its output, carrying less inherited error than k x the noise
    run's, still reads "within noise"."""
    out = stages_by_key.get(f"L{row.layer:03d}.hidden_out")
    if row.noise_added is None:
        return rounding_floor(out)
    k = noise_factor(out) if out is not None else V.noise_factor()
    return k * max(row.noise_added, 0.0)


@dataclass
class Pattern:
    name: PatternName
    focus: LayerRow | None  # the layer the pattern points at
    introducing: list[int]
    reason: str
    signal: str | None = None  # why the focus is a bug however small its error (see module doc)
    saturated_after: int | None = None  # the layer where the target decorrelated (later: not judged)


def _also(intro: list[LayerRow], focus: LayerRow) -> str:
    rest = [str(r.layer) for r in intro if r is not focus]
    return f"; also introducing error: layer {', '.join(rest)}" if rest else ""


def _saturation(sat: int | None) -> str:
    if sat is None:
        return ""
    return f"; the target has decorrelated by layer {sat}, so later layers cannot be judged"


def _signal(focus: LayerRow) -> str | None:
    if focus.exact_in:
        return "error appears from exactly equal inputs in the same dtype"
    if focus.local == "local":
        return "the target block re-run on the reference's input reproduces the error"
    if focus.noise_added is not None:
        return "the layer adds more error than the noise run allows"
    return None


def _localised(
    name: PatternName, focus: LayerRow, intro: list[LayerRow], reason: str, sat: int | None
) -> Pattern:
    return Pattern(name, focus, [r.layer for r in intro], reason + _saturation(sat), _signal(focus), sat)


def _jump_ratio(top: LayerRow, intro: list[LayerRow]) -> float:
    """How many times more `top` adds than the next introducing layer (inf when it is alone)."""
    others = [max(r.added or 0.0, 0.0) for r in intro if r is not top]
    return (top.added or 0.0) / max(others) if others and max(others) > 0 else float("inf")


def decide(rows: list[LayerRow]) -> Pattern:
    """The pattern of the error budget, in README order: match, layer_class, jump, drift."""
    sat = saturated_after(rows)
    intro = [r for r in rows if r.introduces]
    if not intro:
        return Pattern(
            PatternName.MATCH, None, [], "no layer introduces error beyond noise", saturated_after=sat
        )
    first = intro[0]
    judged = [r for r in rows if sat is None or r.layer <= sat]
    classes = {r.layer_class for r in judged}
    if len(intro) >= 2 and len(classes) >= 2 and len({r.layer_class for r in intro}) == 1:
        n_cls = sum(1 for r in judged if r.layer_class == first.layer_class)
        why = f"{len(intro)} of the {n_cls} {first.layer_class} layers introduce error while the other classes stay at noise"
        return _localised(PatternName.LAYER_CLASS, first, intro, why, sat)
    if first.exact_in and first is not rows[0]:
        why = "the first layer to show any error, after exactly equal layers"
        return _localised(PatternName.JUMP, first, intro, why + _also(intro, first), sat)
    top = max(intro, key=lambda r: r.added or 0.0)
    ratio = _jump_ratio(top, intro)
    if ratio >= JUMP_RATIO:
        if len(intro) == 1:
            why = (
                "the only layer that introduces error"
                if sat is None
                else "the first layer that introduces error"
            )
        else:
            why = f"adds {ratio:.3g}x the next"
        return _localised(PatternName.JUMP, top, intro, why + _also(intro, top), sat)
    big = [r for r in intro if (r.added or 0.0) * JUMP_RATIO > (top.added or 0.0)]
    small = [str(r.layer) for r in intro if r not in big]
    why = f"{len(big)} layers add comparable error from layer {big[0].layer} on"
    if small:
        why += f"; smaller error added by layer {', '.join(small)}"
    return Pattern(
        PatternName.DRIFT, big[0], [r.layer for r in intro], why + _saturation(sat), saturated_after=sat
    )
