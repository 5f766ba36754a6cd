"""Per-layer error budget and the pattern of a divergence (README "Comparing" and "--json" keys).

For every layer L with a block input and output dumped on both sides (rel against the reference):

    rel_in(L)  = rel of L's hidden_in          (error the layer inherits; a decoder block's
                                                encoder_hidden_in too, the larger of the two)
    rel_out(L) = rel of L's hidden_out         (error it passes on)
    added(L)   = rel_out(L) - rel_in(L)        (error it adds; README: error out − error in)

Two allowances decide what a layer's `added` means (eps: the machine epsilon of a dtype,
`verdict.MACHINE_EPS`; calibrated on the zoo, docs/bisect.md "Calibration"):

- the *rounding floor*: `ROUNDING_ULPS` (16) x eps of the more precise dtype, or, when both sides
  run in one low-precision dtype, `PRECISION_ULPS` (4) x its eps. A layer *introduces* error when
  it adds more than the floor and more than `INHERIT_SHARE` (10%) of what it inherits (a healthy
  layer fed a wrong input passes the error on amplified a little: 12-14% on the cases we measured,
  a layer with its own bug 17% and more; the jump ratio, not this share, tells the two apart);
- the *precision budget*: what one block may add from precision alone, `PRECISION_ULPS` x eps of
  the less precise dtype when the sides differ in dtype (the zoo's bf16 and fp16 sides add at most
  1.1 eps per block), else the floor. A layer that introduces more than the budget (and more than
  10% of what it inherits) is *beyond precision*; with a dtype's budget, so is a layer one of whose
  stages adds more than the budget over its own input (`substage.largest_step`: a q projection
  scaled by 1.1 moves q by 10% and the block's output by 0.02%).

With a noise run, both are k x the error the noise run adds at that layer (k = 2 for fp32, 3 for
bf16/fp16), never below the rounding floor (a noise run bit-identical to the reference gives no
scale: the exact-prefix rule decides there). When attribution re-ran the layers on the reference's inputs, its verdict (local /
inherited) replaces the estimate.

Saturation: once a layer's output has decorrelated from the reference (cos <= 0.5, the scramble
band, or rel >= 50%), the error cannot grow much further and what later layers add says little
about them: `saturated_after` is that layer, and the layers after it do not introduce. They still
carry one piece of evidence: when the later layers of one class add error beyond precision on
average and no later layer of the other classes does, the class is still told apart.

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

A localised pattern (jump, layer_class, undetermined) carries a bug *signal* when its focus layer
got an exactly equal input in the same dtype (nothing but that layer can explain the error),
when attribution found the error local to it, when a noise run was given and the layer adds more
than k x the noise run's error, or when the sides differ in dtype and the layer adds more than
the less precise dtype's budget.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ffdebug import verdict as V
from ffdebug.results import LayerRow, StageResult
from ffdebug.verdict import PatternName, Severity

INHERIT_SHARE = 0.1  # a layer must add more than this share of the error it inherits
JUMP_RATIO = 4.0  # one layer adds this many times more than any other introducing layer: a jump
SATURATED_COS = 0.5  # a block output at or below this cos has decorrelated (the scramble band)
SATURATED_REL = 0.5  # or whose error is half its norm: later layers' own error is lost in it

_LAYER_KEY = re.compile(r"^L(\d+)\.(hidden_in|hidden_out|encoder_hidden_in)$")


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
    encs: dict[int, StageResult] = {}  # a decoder block's other input: the encoder's output
    for e in stages:
        m = _LAYER_KEY.match(e.key)
        if not m or (e.invocation or 0) != 0:
            continue
        target = {"hidden_in": ins, "hidden_out": outs, "encoder_hidden_in": encs}[m.group(2)]
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
        enc = encs.get(layer)
        if enc is not None and not is_exact(enc) and row.rel_in is not None:
            row.exact_in = False  # what it inherits through cross-attention is its input too
            if enc.rel > row.rel_in:
                row.rel_in, row.cos_in = enc.rel, min(enc.cos, row.cos_in if row.cos_in is not None else 1.0)
                row.notes.append(f"inherits rel {enc.rel:.3g} through its encoder input (encoder_hidden_in)")
        if e_out is not None:
            row.rel_out, row.cos_out = e_out.rel, e_out.cos
            row.severity, row.exact_out = e_out.severity, is_exact(e_out)
            if e_out.noise_rel is not None:
                row.noise_rel_out = e_out.noise_rel
                n_in = (e_in.noise_rel if e_in is not None else None) or 0.0
                row.noise_added = e_out.noise_rel - n_in
        if row.rel_in is not None and row.rel_out is not None:
            row.added = row.rel_out - row.rel_in
        row.scale_out = _scale_added(e_in, e_out)
        rows.append(row)
        prev_out = e_out
    return rows


def _scale_added(e_in: StageResult | None, e_out: StageResult | None) -> float:
    """The scale of the signal a block adds to its output (`verdict.scale_error` out - in) when the
    output's error is mostly that scale (`verdict.coherence` >= `COHERENT`), else 0."""
    if e_out is None:
        return 0.0
    coh = V.coherence(e_out.cos, e_out.norm_ratio, e_out.rel)
    if coh is None or abs(coh) < V.COHERENT:
        return 0.0
    before = V.scale_error(e_in.cos, e_in.norm_ratio) if e_in is not None else None
    return V.scale_error(e_out.cos, e_out.norm_ratio) - (before or 0.0)


@dataclass(frozen=True)
class Precision:
    """The dtypes the stages of one layer run in on the two sides: what rounding alone may do there."""

    pairs: frozenset

    @classmethod
    def of(cls, stages) -> Precision:
        return cls(frozenset((e.dtype_ref, e.dtype_target) for e in stages if e is not None))

    @property
    def dtypes(self) -> tuple:
        return tuple(d for pair in self.pairs for d in pair)

    @property
    def mixed(self) -> bool:
        """A low-precision side meets another dtype somewhere in the layer (a bf16 model against an
        fp32 one, whatever dtype its residual stream keeps)."""
        return any(a != b and (a in V.LOW_PRECISION or b in V.LOW_PRECISION) for a, b in self.pairs)

    def floor(self) -> float:
        """What a block adds by rounding alone, without a noise run: `ROUNDING_ULPS` x the epsilon
        of the most precise dtype (a dtype difference is itself the error `drift` describes, not
        noise to hide), or `PRECISION_ULPS` x the epsilon of the one low-precision dtype both sides
        run in."""
        low = any(d in V.LOW_PRECISION for d in self.dtypes)
        if low and not self.mixed:
            return V.PRECISION_ULPS * V.coarse_eps(*self.dtypes)
        return V.ROUNDING_ULPS * V.precise_eps(*self.dtypes)

    def budget(self) -> float:
        """What a block may add from precision alone: `PRECISION_ULPS` x the epsilon of the least
        precise dtype when a low-precision side meets another dtype, else the rounding floor."""
        if self.mixed:
            return max(self.floor(), V.PRECISION_ULPS * V.coarse_eps(*self.dtypes))
        return self.floor()


def layer_precision(layer: int, stages_by_key: dict[str, StageResult]) -> Precision:
    return Precision.of(e for e in stages_by_key.values() if e.layer == layer)


def saturated_after(rows: list[LayerRow]) -> int | None:
    """The first layer whose block output has decorrelated from the reference (cos <= 0.5 or
    rel >= 50%)."""
    for r in rows:
        if (r.cos_out is not None and r.cos_out <= SATURATED_COS) or (
            r.rel_out is not None and r.rel_out >= SATURATED_REL
        ):
            return r.layer
    return None


def flipped_after(stages_by_key: dict[str, StageResult]) -> int | None:
    """The first layer where tokens took another expert on the two sides (`comparison.routing`)."""
    return min(
        (e.layer for e in stages_by_key.values() if e.flipped_tokens is not None and e.layer is not None),
        default=None,
    )


def mark_introducing(rows: list[LayerRow], stages_by_key: dict[str, StageResult]) -> None:
    """Set `row.introduces` and `row.beyond_precision` from attribution where it ran, else from
    the error budget; layers after saturation do not introduce (they are not judged one by one)."""
    sat = saturated_after(rows)
    flip = flipped_after(stages_by_key)
    for row in rows:
        out = stages_by_key.get(f"L{row.layer:03d}.hidden_out")
        prec = layer_precision(row.layer, stages_by_key)
        if row.local is not None:  # re-run on the reference's input: judged whatever came before
            row.introduces = row.beyond_precision = row.local == "local"
            continue
        row.judged = False  # until past the rules that leave it unjudged
        if flip is not None and row.layer > flip:
            row.introduces = False
            row.notes.append(
                f"not judged: token rows that took another expert at layer {flip} (routing flip) reach "
                "the other tokens through attention, so what this layer adds is not its own"
            )
            continue
        if sat is not None and row.layer > sat:
            row.introduces = False
            row.notes.append(f"not judged: the target decorrelated at layer {sat}")
            if row.added is not None:
                row.precision_budget = _scaled(row, out, prec.budget(), prec.floor())
            continue
        row.judged = True
        limited = [e for e in stages_by_key.values() if e.layer == row.layer and e.range_limited]
        if limited:  # judged as precision: what a range-limited stage shows is the dtype's range
            row.introduces = row.beyond_precision = False
            row.notes.append(
                f"not judged: {limited[0].key} is below the range of the low-precision dtype (underflow)"
            )
            continue
        if row.added is None:
            row.introduces = row.beyond_precision = not V.is_ok(row.severity)
            continue
        inherited = INHERIT_SHARE * (row.rel_in or 0.0)
        row.precision_budget = _scaled(row, out, prec.budget(), prec.floor())
        row.introduces = row.added > max(_scaled(row, out, prec.floor(), prec.floor()), inherited)
        row.beyond_precision = row.introduces and row.added > max(row.precision_budget, inherited)
        if prec.mixed and row.noise_added is None:
            worst = V.worst(*(e.severity for e in stages_by_key.values() if e.layer == row.layer))
            _mixed_precision(row, worst)


def _mixed_precision(row: LayerRow, worst: Severity) -> None:
    """A low-precision side against another dtype, without a noise run: rounding amplified by the
    model (near-tied routing, sharp attention, cancelling sums) adds error of any size below the
    bug band that is not a scale of the signal, so the size of what a layer adds is no evidence
    (`verdict.amplified_precision`). What precision never adds is a scale of the signal: the layer
    is beyond precision when the block's output, or one stage's own step, gains a scale above the
    budget (`substage.largest_scale_step`: q scaled by 1.1 adds 0.1 at q while the block's output
    moves 0.02%), or when one of its stages (`worst`: the worst grade among them, after the rules
    for amplified precision, range, selection and containment) is at `bug` or worse: outside what
    amplification reaches."""
    budget = row.precision_budget or 0.0
    row.beyond_precision = worst.at_least(Severity.BUG)
    row.introduces = row.introduces or row.beyond_precision
    if abs(row.scale_out or 0.0) > budget:
        row.introduces = row.beyond_precision = True
        row.notes.append(
            f"the block scales its output by {row.scale_out:+.3g} of the signal, more than one block "
            f"may add in the less precise dtype ({budget:.3g})"
        )
    elif (row.scale_step or 0.0) > budget:
        row.introduces = row.beyond_precision = True  # one stage's own step is beyond precision
        row.notes.append(
            f"{row.scale_step_key}'s own step scales the signal by {row.scale_step:.3g}, more than one "
            f"block may add in the less precise dtype ({budget:.3g})"
        )


def _scaled(row: LayerRow, out: StageResult | None, without_noise: float, floor: float) -> float:
    """k x the error the noise run adds at this layer, never below the rounding floor (a noise
    run bit-identical to the reference gives no scale); without a noise run, `without_noise`.

    Judged on the error *added*, not on the error carried: a layer that adds 10x the noise is
    introducing error even while its output, carrying less inherited error than k x the noise
    run's, still reads "within noise"."""
    if row.noise_added is None:
        return without_noise
    k = noise_factor(out) if out is not None else V.noise_factor()
    return max(k * max(row.noise_added, 0.0), floor)


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


def _inherit(beyond: list[LayerRow]) -> bool:
    """A layer beyond precision after the first was fed an inexact input: what it adds may be the
    inherited error amplified (a healthy layer after a one-layer bug adds 12-33% of it), so one
    layer and one class read alike by the budget."""
    return any(not r.exact_in for r in beyond[1:])


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


def _jump_ratio(top: LayerRow, intro: list[LayerRow]) -> float:
    """How many times more `top` adds than the next introducing layer (inf when it is alone)."""
    others = [max(r.added or 0.0, 0.0) for r in intro if r is not top]
    return (top.added or 0.0) / max(others) if others and max(others) > 0 else float("inf")


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
    layer, or one adding `JUMP_RATIO` x every other: `jump`; layers of comparable own error, all of
    one class: `layer_class`; of several classes: `undetermined` (no one layer, no one class)."""

    def own(r: LayerRow) -> float:
        return r.local_rel or 0.0

    def done(name: PatternName, focus: LayerRow, why: str) -> Pattern:
        signal = _signal(focus, layer_precision(focus.layer, by_key).mixed)
        return Pattern(name, focus, [r.layer for r in beyond], why, signal)

    top = max(beyond, key=own)
    others = [own(r) for r in beyond if r is not top]
    ratio = own(top) / max(others) if others and max(others) > 0 else float("inf")
    if ratio >= JUMP_RATIO:
        why = (
            "the only layer whose block, re-run on the reference's input, differs (attribution)"
            if not others
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
        return done(PatternName.LAYER_CLASS, big[0], why)
    names = ", ".join(sorted(str(c) for c in classes))
    why = (
        f"layers of several classes ({names}) err by themselves on the reference's input, by "
        f"comparable amounts from layer {big[0].layer} on (attribution){smaller}: no one layer and no "
        "one class"
    )
    return done(PatternName.UNDETERMINED, big[0], why)


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
        return done(PatternName.LAYER_CLASS, first, why)
    if first.exact_in and first is not rows[0]:
        why = "the first layer to show any error, after exactly equal layers"
        decided = len(beyond) == 1 and not _unjudged_after(rows, first)
        return done(PatternName.JUMP, first, why + _also(beyond, first), decided)
    if len(beyond_classes) == 1:
        later = class_after_saturation(rows, sat, first.layer_class)
        if later is not None:
            why = f"the {first.layer_class} layers introduce error before the target decorrelates; {later}"
            return Pattern(
                PatternName.LAYER_CLASS,
                first,
                [r.layer for r in beyond]
                + [
                    r.layer
                    for r in rows
                    if sat is not None and r.layer > sat and r.layer_class == first.layer_class
                ],
                why,
                _signal(first, precision_signal(first)),
                sat,
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
        return done(PatternName.LAYER_CLASS, big[0], why, not _inherit(beyond))
    names = ", ".join(sorted(str(c) for c in beyond_classes))
    after = f"layer {sat}" if sat is not None else f"layer {big[-1].layer}"
    why = (
        f"layers of several classes ({names}) add comparable error beyond precision from layer "
        f"{big[0].layer} on{smaller}: the budget cannot judge past {after}; {DECIDING_RUN}"
    )
    return done(PatternName.UNDETERMINED, big[0], why, False)
