"""Contained differences: inside a layer of a low-precision side against another dtype, a
sub-stage that differs while the branch output it feeds agrees.

A mixture-of-experts layer that dispatches tokens by capacity or by score order gathers its
experts' rows in an order that near-tied scores decide: a bf16 side may hold another token's row
at the same position while the combined output is the same (NLLB-MoE in the zoo: an expert's input
52% off, the layer's `ffn_out` within 0.9%). What the branch gathers and scatters internally is
not compared row by row then; its effect is judged where it lands. So, per paired call in
execution order, a sub-stage (not a block-level stage, `models.blocks.BLOCK_STAGES`) outside the
ok band, in a call where a low-precision side meets another dtype, whose next block-level stage in
the same layer is ok, or below diverge and adding no more over the layer's input than one block
may add in that dtype (4 eps: cpmant's bf16 attention context is 33% off from sharp attention,
its `attn_out` 0.55 eps over the layer's input), is at most `drift`, with a note naming that
stage.

Only there: with one dtype on both sides a sub-stage that differs while the block output does not
is evidence of a computation of its own (a q projection scaled where a q norm after it cancels the
scale; `bisection.engine._inside_an_exact_layer`), and a scale of the signal that precision never
makes is still found by the layer budget (`bisection.pattern`, `scale_step`).
"""

from __future__ import annotations

from ffdebug import verdict as V
from ffdebug.models.blocks import is_block_stage
from ffdebug.results import StageResult


def explain(stages: list[StageResult]) -> None:
    """Cap the contained sub-stages of every call (module doc), in place."""
    calls: dict[tuple, list[StageResult]] = {}
    for e in stages:
        call = (tuple(sorted((str(k), str(v)) for k, v in e.step.items())), e.phase, e.call, e.rank)
        calls.setdefault(call, []).append(e)
    for members in calls.values():
        for i, e in enumerate(members):
            if e.ok or e.layer is None or is_block_stage(e.stage) or e.stage == "hidden_in":
                continue
            if e.finding not in (None, "shape_mismatch") or not V.mixed_low(*e.judged_dtypes):
                continue
            fed = next((x for x in members[i + 1 :] if x.layer == e.layer and is_block_stage(x.stage)), None)
            entered = next((x for x in members if x.layer == e.layer and x.stage == "hidden_in"), None)
            if fed is None or not _within_precision(fed, entered):
                continue
            e.severity = V.Severity.DRIFT
            e.notes.append(
                f"contained: {fed.key}, the branch output it feeds, is within precision (rel "
                f"{fed.rel:.3g}); what differs here (sharp attention, rows gathered in another order, "
                "a selection) does not reach the layer's output beyond what rounding does"
            )


def _within_precision(fed: StageResult, entered: StageResult | None) -> bool:
    """The block-level stage agrees, or is below diverge and adds no more over the layer's input
    than one block may add in the less precise dtype (`PRECISION_ULPS` x its epsilon)."""
    if fed.ok:
        return True
    if fed.rel is None or entered is None or entered.rel is None or fed.severity.at_least(V.Severity.DIVERGE):
        return False
    return fed.rel - entered.rel <= V.PRECISION_ULPS * V.coarse_eps(*fed.judged_dtypes)
