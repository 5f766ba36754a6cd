"""The pattern of a divergence over the layer budget (`bisection.budget`; docs/comparing.md "Comparing" and
"--json" keys).

Pattern, in this order:
  match        no layer introduces error;
  drift        every introducing layer stays within the precision budget: accumulated rounding
               of a less precise dtype, never a bug;
  layer_class  two or more layers beyond precision, all of one class and of comparable size (none
               adds `JUMP_RATIO` x every other), while the layers of the other classes stay
               within precision (or, past saturation, the class evidence above);
  jump         the first layer beyond precision after an exactly equal prefix in the same dtype
               (past layer 0), or one that adds at least `JUMP_RATIO` (4) x every other layer
               beyond precision (measured on the ports in tests/bisect/test_patterns.py: one-layer
               bugs add 7.6x to 1e6x the next layer; an error spread over many layers 1x-2x);
  layer_class  (again) the layers beyond precision, of comparable size, are all of one class;
  undetermined the layers beyond precision are of several classes and comparable in size, or the
               target, with layers of several classes, decorrelated at the first layer beyond
               precision (not after an exact prefix) before the evidence could tell a one-layer
               bug from a class's (one class only: `jump` at that layer): the reason names the
               layer after which it could not judge and the run that decides (attribution,
               `--model-ref` / `--model-target`, which re-runs each target block on the
               reference's input).

`Pattern.decided` is False where the budget's reading is an estimate that one layer and one class
both explain (docs/bisect.md "Patterns", "Decided or not"): undetermined; a jump with other layers
beyond precision or unjudged layers after it; a layer_class by comparable size whose later members
inherit error and no other class contrasts. Attribution decides those.

A localised pattern (jump, layer_class, undetermined) carries a bug *signal* when its focus layer
got an exactly equal input in the same dtype (nothing but that layer can explain the error),
when attribution found the error local to it, when a noise run was given and the layer adds more
than k x the noise run's error, or when the sides differ in dtype and the layer adds more than
the less precise dtype's budget.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from ffdebug.bisection.budget import layer_precision, saturated_after
from ffdebug.results import LayerRow, StageResult
from ffdebug.verdict import PatternName

JUMP_RATIO = 4.0  # one layer adds this many times more than any other introducing layer: a jump


@dataclass
class Pattern:
    name: PatternName
    focus: LayerRow | None  # the layer the pattern points at
    introducing: list[int]
    reason: str
    signal: str | None = None  # why the focus is a bug however small its error (see module doc)
    saturated_after: int | None = None  # the layer where the target decorrelated (later: not judged)
    decided: bool = True  # False: the evidence leaves one layer vs one class open; attribution decides


def _unjudged_after(rows: list[LayerRow], focus: LayerRow) -> bool:
    """A layer after `focus` that the budget could not judge (decorrelation, routing flip)."""
    return any(not r.judged for r in rows if r.layer > focus.layer)


_BLOCK_STAGE = re.compile(r"^L(\d{3})\.[a-z_]+$")  # a block stage (attn_out), not a sub-stage or `.1`


def _stage_jump(layer: int, by_key: dict[str, StageResult]) -> bool:
    """One block stage of `layer` errs `JUMP_RATIO` x the block stage before it (execution order):
    the demo's MoE output, 55% after its input's 2.8%. A healthy stage fed a wrong input amplifies
    it less as a rule (Jamba's MoE output 2.3x its input, a layer after a zeroed head); a selection
    that flips can amplify more (DeepSeek-V3.2's sparse attention 5.2x after an expert swap two
    layers up, read as the layer's own: docs/bisect.md "The zoo" lists it)."""
    before = None
    for key, e in by_key.items():
        m = _BLOCK_STAGE.match(key)
        if m is None or int(m.group(1)) != layer or e.rel is None:
            continue
        if before is not None and before > 0 and e.rel > JUMP_RATIO * before:
            return True
        before = e.rel
    return False


def _inherit(beyond: list[LayerRow], by_key: dict[str, StageResult]) -> bool:
    """A layer beyond precision after the first was fed an inexact input and no block stage of it
    jumps (`_stage_jump`): what it adds may be the inherited error amplified (a healthy layer after
    a one-layer bug adds 12-33% of it), so one layer and one class read alike by the budget."""
    return any(not r.exact_in and not _stage_jump(r.layer, by_key) for r in beyond[1:])


def _contrast_after(rows: list[LayerRow], first: LayerRow) -> bool:
    """A layer of another class after `first`, judged, fed an inexact input, that stays within
    precision: a healthy layer does not amplify the error, so the class-mates that do are the class."""
    return any(
        r.layer > first.layer
        and r.layer_class != first.layer_class
        and r.judged
        and not r.exact_in
        and not r.beyond_precision
        for r in rows
    )


def _also(intro: list[LayerRow], focus: LayerRow) -> str:
    rest = [str(r.layer) for r in intro if r is not focus]
    return f"; also introducing error: layer {', '.join(rest)}" if rest else ""


def _saturation(sat: int | None) -> str:
    if sat is None:
        return ""
    return f"; the target has decorrelated by layer {sat}, so later layers cannot be judged"


def _signal(focus: LayerRow, precision_signal: bool) -> str | None:
    if focus.exact_in:
        return "error appears from exactly equal inputs in the same dtype"
    if focus.local == "local":
        return "the target block re-run on the reference's input reproduces the error"
    if focus.noise_added is not None:
        return "the layer adds more error than the noise run allows"
    if precision_signal and focus.beyond_precision and focus.precision_budget is not None:
        scale = max(abs(focus.scale_out or 0.0), focus.scale_step or 0.0)
        if scale > focus.precision_budget:
            return (
                f"the layer scales the signal by {scale:.3g}, more than the less precise dtype allows "
                f"one block ({focus.precision_budget:.3g}); rounding adds no scale"
            )
        return "a stage of the layer is bug or worse by its bands, beyond what amplified precision reaches"
    return None


def _localised(
    name: PatternName,
    focus: LayerRow,
    intro: list[LayerRow],
    reason: str,
    sat: int | None,
    precision_signal: bool,
    decided: bool = True,
) -> Pattern:
    if not decided and DECIDING_RUN not in reason:
        reason += f"; not decided by the budget: {DECIDING_RUN}"
    return Pattern(
        name,
        focus,
        [r.layer for r in intro],
        reason + _saturation(sat),
        _signal(focus, precision_signal),
        sat,
        decided,
    )


def _added(r: LayerRow) -> float:
    return r.added or 0.0


def _jump_ratio(top: LayerRow, intro: list[LayerRow], size: Callable[[LayerRow], float] = _added) -> float:
    """How many times more `top` adds (`size`: what the budget says it adds, or attribution's own
    error) than the next introducing layer (inf when it is alone)."""
    others = [max(size(r), 0.0) for r in intro if r is not top]
    return size(top) / max(others) if others and max(others) > 0 else float("inf")


def _pct(x: float | None) -> str:
    return f"{100 * x:+.2g}%" if x is not None else "?"


def class_after_saturation(rows: list[LayerRow], sat: int | None, cls: str | None) -> str | None:
    """Past saturation, the evidence that still tells class `cls` apart (module doc): the later
    layers of `cls` add error beyond their precision budget on average and no later layer of the
    other classes does (they hold or shrink the error), with two or more later layers of `cls` and
    one of another class. Returns the sentence saying so, or None."""
    if sat is None:
        return None
    later = [r for r in rows if r.layer > sat and r.added is not None and r.precision_budget is not None]
    mine = [r for r in later if r.layer_class == cls]
    others = [r for r in later if r.layer_class != cls]
    if len(mine) < 2 or not others:
        return None
    mean = sum(r.added for r in mine) / len(mine)
    if mean <= max(r.precision_budget for r in mine) or any(r.added > r.precision_budget for r in others):
        return None
    adds = ", ".join(f"{r.layer} {_pct(r.added)}" for r in mine)
    rest = ", ".join(f"{r.layer} {_pct(r.added)}" for r in others)
    return f"past layer {sat} the {cls} layers still add error ({adds}) and the others do not ({rest})"


DECIDING_RUN = (
    "attribution decides: re-run each target block on the reference's input "
    "(bisect --model-ref ... --model-target ..., or ffdebug hunt)"
)


def decide(rows: list[LayerRow], by_key: dict[str, StageResult] | None = None) -> Pattern:
    """The pattern of the error budget, in the module doc's order (`by_key`: the call's stages by
    key, whose dtypes say whether a precision budget is a dtype's)."""
    attributed = bool(rows) and all(r.local is not None for r in rows)
    sat = None if attributed else saturated_after(rows)
    intro = [r for r in rows if r.introduces]
    if not intro:
        return Pattern(
            PatternName.MATCH, None, [], "no layer introduces error beyond noise", saturated_after=sat
        )
    beyond = [r for r in intro if r.beyond_precision]
    if not beyond:
        top = max(intro, key=lambda r: r.added or 0.0)
        budget = max((r.precision_budget or 0.0) for r in intro)
        why = (
            f"{len(intro)} layers add error within the precision of the dtypes (at most rel "
            f"{top.added:.3g}, at layer {top.layer}; one block may add {budget:.3g})"
        )
        if (top.added or 0.0) > budget:  # the low-precision side's amplified rounding (`_mixed_precision`)
            why = (
                f"{len(intro)} layers add error that is not a scale of the signal (at most rel "
                f"{top.added:.3g}, at layer {top.layer}, over the {budget:.3g} rounding alone adds to a "
                "block): the low-precision side's rounding amplified, which a reference in another "
                "dtype cannot tell from a bug; dump the reference in the target's dtype, or give a "
                "noise run, to judge finer"
            )
        return Pattern(
            PatternName.DRIFT, intro[0], [r.layer for r in intro], why + _saturation(sat), saturated_after=sat
        )
    if attributed:
        return _attributed(rows, beyond, by_key or {})
    return _localise(rows, beyond, sat, by_key or {})


def _attributed(rows: list[LayerRow], beyond: list[LayerRow], by_key: dict[str, StageResult]) -> Pattern:
    """Every layer re-run on the reference's input (attribution): the error each block shows there
    is its own (`local_rel`), whatever it inherited, saturation and routing flips included. One
    layer, or one adding `JUMP_RATIO` x every other: `jump`; else the layers erring by themselves, all
    of one class (or every layer, or the layers sharing a kind): `layer_class` at the first of them,
    where the bug first shows however small its error there; of several classes: `undetermined` (no
    one layer, no one class)."""

    def own(r: LayerRow) -> float:
        return r.local_rel or 0.0

    def done(name: PatternName, focus: LayerRow, why: str) -> Pattern:
        signal = _signal(focus, layer_precision(focus.layer, by_key).mixed)
        return Pattern(name, focus, [r.layer for r in beyond], why, signal)

    top = max(beyond, key=own)
    ratio = _jump_ratio(top, beyond, own)
    if ratio >= JUMP_RATIO:
        why = (
            "the only layer whose block, re-run on the reference's input, differs (attribution)"
            if len(beyond) == 1
            else f"its block, re-run on the reference's input, errs {ratio:.3g}x the next (attribution)"
        )
        return done(PatternName.JUMP, top, why + _also(beyond, top))
    big = [r for r in beyond if own(r) * JUMP_RATIO > own(top)]
    small = [str(r.layer) for r in beyond if r not in big]
    smaller = f"; smaller error of its own at layer {', '.join(small)}" if small else ""
    classes = {r.layer_class for r in beyond}
    if len(classes) == 1:
        cls = big[0].layer_class
        n_cls = sum(1 for r in rows if r.layer_class == cls)
        why = (
            f"{len(beyond)} of the {n_cls} {cls} layers err by themselves on the reference's input "
            f"(attribution, comparable sizes from layer {big[0].layer} on){smaller}"
        )
        return done(PatternName.LAYER_CLASS, beyond[0], why)
    own_layers = [r.layer for r in beyond]
    if len(beyond) == len(rows):
        why = (
            f"every layer errs by itself on the reference's input (attribution, comparable sizes from "
            f"layer {big[0].layer} on){smaller}: code every layer runs"
        )
        return done(PatternName.LAYER_CLASS, beyond[0], why)
    kind = _shared_kind({r.layer for r in beyond}, rows, by_key)
    if kind is not None:
        why = (
            f"the layers with {kind} ({', '.join(map(str, own_layers))}) err by themselves on the "
            f"reference's input and the others do not (attribution){smaller}"
        )
        return done(PatternName.LAYER_CLASS, beyond[0], why)
    names = ", ".join(sorted(str(c) for c in classes))
    why = (
        f"layers of several classes ({names}) err by themselves on the reference's input, by "
        f"comparable amounts from layer {big[0].layer} on (attribution){smaller}: no one layer and no "
        "one class"
    )
    return done(PatternName.UNDETERMINED, big[0], why)


ROLE_FAMILIES = ("attn", "mlp", "moe")  # role sub-stage families: `L001.moe.topk_weights.out` has moe


def _kinds(row: LayerRow, by_key: dict[str, StageResult]) -> set[str]:
    """What a layer is made of: the parts of its class label (`sliding_attention+moe`: a joined
    label names the attention and the MLP kind) and the role families of its sub-stages."""
    kinds = {k for k in (row.layer_class or "").split("+") if k}
    prefix = f"L{row.layer:03d}."
    for key in by_key:
        family = key[len(prefix) :].split(".", 1)[0] if key.startswith(prefix) else None
        if family in ROLE_FAMILIES and key.count(".") >= 2:
            kinds.add(f"{family} sub-stages")
    return kinds


def _shared_kind(own: set[int], rows: list[LayerRow], by_key: dict[str, StageResult]) -> str | None:
    """A kind every layer in `own` has and no other layer has (a top-k bug in the MoE layers of a
    model whose classes are its attention kinds), else None."""
    kinds = {r.layer: _kinds(r, by_key) for r in rows}
    shared = set.intersection(*(kinds[layer] for layer in own))
    for layer, k in kinds.items():
        if layer not in own:
            shared -= k
    return min(shared) if shared else None


def _localise(
    rows: list[LayerRow], beyond: list[LayerRow], sat: int | None, by_key: dict[str, StageResult]
) -> Pattern:
    first = beyond[0]

    def precision_signal(focus: LayerRow) -> bool:
        return layer_precision(focus.layer, by_key).mixed

    judged = [r for r in rows if sat is None or r.layer <= sat]
    classes = {r.layer_class for r in judged}
    beyond_classes = {r.layer_class for r in beyond}

    def done(name: PatternName, focus: LayerRow, why: str, decided: bool = True) -> Pattern:
        return _localised(name, focus, beyond, why, sat, precision_signal(focus), decided)

    top = max(beyond, key=lambda r: r.added or 0.0)
    ratio = _jump_ratio(top, beyond)
    if len(beyond) >= 2 and len(classes) >= 2 and len(beyond_classes) == 1 and ratio < JUMP_RATIO:
        n_cls = sum(1 for r in judged if r.layer_class == first.layer_class)
        why = (
            f"{len(beyond)} of the {n_cls} {first.layer_class} layers add error beyond precision "
            "while the other classes stay within it"
        )
        return done(
            PatternName.LAYER_CLASS, first, why, _contrast_after(rows, first) or not _inherit(beyond, by_key)
        )
    if first.exact_in and first is not rows[0]:
        why = "the first layer to show any error, after exactly equal layers"
        decided = len(beyond) == 1 and not _unjudged_after(rows, first)
        return done(PatternName.JUMP, first, why + _also(beyond, first), decided)
    if len(beyond_classes) == 1:
        later = class_after_saturation(rows, sat, first.layer_class)
        if later is not None:
            why = f"the {first.layer_class} layers introduce error before the target decorrelates; {later}"
            past = [
                r.layer
                for r in rows
                if sat is not None and r.layer > sat and r.layer_class == first.layer_class
            ]
            intro = [r.layer for r in beyond] + past
            return Pattern(
                PatternName.LAYER_CLASS, first, intro, why, _signal(first, precision_signal(first)), sat
            )
    several_classes = len({r.layer_class for r in rows}) >= 2
    if len(beyond) == 1 and sat == top.layer and several_classes and any(r.layer > sat for r in rows):
        why = (
            f"layer {top.layer} introduces error and the target decorrelates there (rel {_pct(top.rel_out)}): "
            f"whether the later layers add error of their own cannot be judged past layer {sat}; {DECIDING_RUN}"
        )
        return Pattern(
            PatternName.UNDETERMINED, top, [top.layer], why, _signal(top, precision_signal(top)), sat, False
        )
    if ratio >= JUMP_RATIO:
        if len(beyond) == 1:
            alone = all(r.beyond_precision for r in rows if r.introduces)
            which = "introduces error" if alone else "is beyond precision"
            why = f"the only layer that {which}" if sat is None else f"the first layer that {which}"
        else:
            why = f"adds {ratio:.3g}x the next"
        return done(PatternName.JUMP, top, why + _also(beyond, top), not _unjudged_after(rows, top))
    big = [r for r in beyond if (r.added or 0.0) * JUMP_RATIO > (top.added or 0.0)]
    small = [str(r.layer) for r in beyond if r not in big]
    smaller = f"; smaller error added by layer {', '.join(small)}" if small else ""
    if len(beyond_classes) == 1:
        n_cls = sum(1 for r in judged if r.layer_class == first.layer_class)
        why = (
            f"{len(beyond)} of the {n_cls} {first.layer_class} layers add comparable error beyond "
            f"precision from layer {big[0].layer} on{smaller}"
        )
        return done(PatternName.LAYER_CLASS, big[0], why, not _inherit(beyond, by_key))
    names = ", ".join(sorted(str(c) for c in beyond_classes))
    after = f"layer {sat}" if sat is not None else f"layer {big[-1].layer}"
    why = (
        f"layers of several classes ({names}) add comparable error beyond precision from layer "
        f"{big[0].layer} on{smaller}: the budget cannot judge past {after}; {DECIDING_RUN}"
    )
    return done(PatternName.UNDETERMINED, big[0], why, False)
