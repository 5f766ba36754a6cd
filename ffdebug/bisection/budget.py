"""Per-layer error budget of a divergence: what each layer inherits, adds, and may add from
precision alone (docs/comparing.md "Comparing" and "--json" keys; the pattern over it: `bisection.pattern`).

For every layer L with a block input and output dumped on both sides (rel against the reference):

    rel_in(L)  = rel of L's hidden_in          (error the layer inherits; a decoder block's
                                                encoder_hidden_in too, the larger of the two)
    rel_out(L) = rel of L's hidden_out         (error it passes on)
    added(L)   = rel_out(L) - rel_in(L)        (error it adds: error out − error in)

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
inherited) replaces the estimate, before saturation and routing flips (a block fed the reference's
input is judged whatever came before it), and with every layer re-run the pattern is decided on the
blocks' own errors (`_attributed`).

Saturation: once a layer's output has decorrelated from the reference (cos <= 0.5, the scramble
band, or rel >= 50%), the error cannot grow much further and what later layers add says little
about them: `saturated_after` is that layer, and the layers after it do not introduce. They still
carry one piece of evidence: when the later layers of one class add error beyond precision on
average and no later layer of the other classes does, the class is still told apart.

"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ffdebug import verdict as V
from ffdebug.results import LayerRow, StageResult
from ffdebug.verdict import Severity

INHERIT_SHARE = 0.1  # a layer must add more than this share of the error it inherits
SATURATED_COS = 0.5  # a block output at or below this cos has decorrelated (the scramble band)
SATURATED_REL = 0.5  # or whose error is half its norm: later layers' own error is lost in it

LAYER_KEY = re.compile(r"^L(\d+)\.(hidden_in|hidden_out|encoder_hidden_in)$")  # a block's inputs and output


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
        m = LAYER_KEY.match(e.key)
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
