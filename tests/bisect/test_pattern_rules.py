"""The pattern's rules on hand-made layer budgets (no model): a layer that dominates its class is a
jump, not the class's pattern; a decoder block inherits the error of its encoder input; the budget
says when it cannot tell one layer from one class (`decided`), and attribution's own errors decide.

Numbers are chosen against the documented constants (`pattern.JUMP_RATIO` = 4, `INHERIT_SHARE` =
10%), not read back from the code: a class-mate adding a tenth of the first layer's error is
inherited-looking, one adding half of it is a class of its own."""

from __future__ import annotations

from ffdebug.bisection import budget
from ffdebug.bisection import pattern as pat
from ffdebug.results import LayerRow, StageResult
from ffdebug.results.stages import TensorMeta
from ffdebug.verdict import PatternName, Severity


def _rows(added: list[float], classes: list[str]) -> list[LayerRow]:
    """Layers in fp32 whose block outputs carry the running sum of `added`; layer 0's input exact."""
    rows, carried = [], 0.0
    for layer, (a, cls) in enumerate(zip(added, classes, strict=True)):
        row = LayerRow(layer, cls, rel_in=carried, rel_out=carried + a, added=a, exact_in=carried == 0.0)
        row.introduces = row.beyond_precision = a > max(1e-6, 0.1 * carried)
        row.precision_budget = 16 * 2.0**-23
        rows.append(row)
        carried += a
    return rows


def test_a_layer_adding_ten_times_its_class_mate_is_a_jump_not_the_class():
    # layer 1 (class a) after an exact layer 0: 30%; its class-mate layer 3 adds 3% on 31% inherited
    rows = _rows([0.0, 0.30, 0.002, 0.031], ["b", "a", "b", "a"])
    p = pat.decide(rows)
    assert (p.name, p.focus.layer) == (PatternName.JUMP, 1), p.reason


def test_class_mates_adding_comparable_error_are_the_class():
    rows = _rows([0.0, 0.30, 0.002, 0.15], ["b", "a", "b", "a"])
    p = pat.decide(rows)
    assert (p.name, p.focus.layer) == (PatternName.LAYER_CLASS, 1), p.reason


def _stage(key: str, rel: float) -> StageResult:
    meta = TensorMeta("float32", [2, 8, 16])
    e = StageResult(key, int(key[1:4]), "decoder", key, "out", 0, 0, 0, {}, None, meta, meta)
    e.rel, e.cos = rel, 1.0 - rel**2 / 2
    e.bit_equal = 1.0 if rel == 0.0 else 0.0
    e.severity = Severity.OK if rel < 0.01 else Severity.DIVERGE
    return e


def test_a_decoder_block_inherits_the_error_of_its_encoder_input():
    """The decoder's own stream enters exact, the encoder's output it reads through cross-attention
    carries 20%: the block's inherited error is the larger, so its input is not exact and the 15%
    its output carries is less than it inherited (it introduces nothing)."""
    stages = [
        _stage("L004.hidden_in", 0.0),
        _stage("L004.encoder_hidden_in", 0.20),
        _stage("L004.hidden_out", 0.15),
    ]
    (row,) = budget.layer_rows(stages)
    assert not row.exact_in
    assert row.rel_in == 0.20 and abs(row.added - (0.15 - 0.20)) < 1e-12
    assert any("encoder input" in n for n in row.notes)


def test_an_exact_encoder_input_leaves_the_decoder_stream_in_charge():
    stages = [
        _stage("L004.hidden_in", 0.0),
        _stage("L004.encoder_hidden_in", 0.0),
        _stage("L004.hidden_out", 0.1),
    ]
    (row,) = budget.layer_rows(stages)
    assert row.exact_in and row.rel_in == 0.0 and row.added == 0.1


def test_comparable_class_mates_with_no_other_class_to_contrast_are_not_decided():
    """Every layer of one class; layer 0 adds 30%, the later ones 10-12% each on what they inherit:
    a class-wide bug, or a one-layer bug that a healthy layer amplifies (12-33% of it on the zoo)?
    `layer_class` by size, but not decided; the reason names the deciding run."""
    rows = _rows([0.30, 0.10, 0.12, 0.11], ["a"] * 4)
    p = pat.decide(rows)
    assert p.name is PatternName.LAYER_CLASS and not p.decided
    assert pat.DECIDING_RUN in p.reason


def test_a_class_told_apart_by_its_contrast_is_decided():
    rows = _rows([0.0, 0.30, 0.002, 0.15], ["b", "a", "b", "a"])
    assert pat.decide(rows).decided


def _attributed(local: list[float], classes: list[str], rel_out: list[float]) -> list[LayerRow]:
    """Rows as attribution leaves them: each block's own error re-run on the reference's input
    (`local_rel`), the dumped outputs `rel_out` (saturated from 50%)."""
    rows, carried = [], 0.0
    for layer, (own, cls, out) in enumerate(zip(local, classes, rel_out, strict=True)):
        row = LayerRow(layer, cls, rel_in=carried, rel_out=out, added=out - carried, cos_out=1 - out)
        row.local, row.local_rel = ("local" if own > 0 else "clean"), own
        rows.append(row)
        carried = out
    budget.mark_introducing(rows, {})
    return rows


def test_attribution_judges_past_saturation_one_layer_is_a_jump():
    """Layer 1 decorrelates the target (rel 80%); by the budget nothing after it is judged. Re-run on
    the reference's input, only layer 1 errs: a jump there, decided."""
    rows = _attributed([0.0, 0.6, 0.0, 0.0], ["a", "a", "b", "a"], [0.0, 0.8, 0.85, 0.9])
    p = pat.decide(rows)
    assert (p.name, p.focus.layer, p.decided, p.saturated_after) == (PatternName.JUMP, 1, True, None)
    assert all(r.judged for r in rows)


def test_attribution_finds_the_class_the_saturation_hid():
    """The same dumps, but layers 1 and 3 (class a) err by themselves by comparable amounts and the
    b layer does not: the class, from layer 1."""
    rows = _attributed([0.0, 0.6, 0.0, 0.4], ["b", "a", "b", "a"], [0.0, 0.8, 0.85, 0.9])
    p = pat.decide(rows)
    assert (p.name, p.focus.layer, p.introducing) == (PatternName.LAYER_CLASS, 1, [1, 3]), p.reason
    assert p.signal is not None and "re-run on the reference's input" in p.signal


def test_attribution_over_several_classes_is_undetermined_but_decided():
    rows = _attributed([0.0, 0.6, 0.5, 0.4], ["b", "a", "b", "a"], [0.0, 0.8, 0.85, 0.9])
    p = pat.decide(rows)
    assert p.name is PatternName.UNDETERMINED and p.decided and pat.DECIDING_RUN not in p.reason


def test_attribution_over_the_moe_layers_of_a_model_classed_by_attention_is_their_class():
    """Classes joined from two kinds (`sliding_attention+moe`): a top-k bug errs in the MoE layers of
    both attention kinds and in no dense layer; the kind they share and no other layer has is the
    class. Every layer erring is code every layer runs: one class too."""
    labels = [
        "full_attention+dense",
        "sliding_attention+moe",
        "full_attention+moe",
        "sliding_attention+dense",
    ]
    rows = _attributed([0.0, 0.3, 0.25, 0.0], labels, [0.0, 0.6, 0.7, 0.7])
    p = pat.decide(rows)
    assert (p.name, p.focus.layer, p.introducing) == (PatternName.LAYER_CLASS, 1, [1, 2]), p.reason
    assert "layers with moe" in p.reason
    every = pat.decide(_attributed([0.2, 0.3, 0.25, 0.2], labels, [0.2, 0.6, 0.7, 0.7]))
    assert (every.name, every.focus.layer) == (PatternName.LAYER_CLASS, 0) and "every layer" in every.reason
    # an attention kind across MLP kinds is the same rule; a set no kind covers stays undetermined
    sliding = pat.decide(_attributed([0.0, 0.3, 0.0, 0.25], labels, [0.0, 0.6, 0.7, 0.7]))
    assert sliding.name is PatternName.LAYER_CLASS and "sliding_attention" in sliding.reason
    neither = pat.decide(_attributed([0.2, 0.3, 0.0, 0.0], labels, [0.2, 0.6, 0.7, 0.7]))
    assert neither.name is PatternName.UNDETERMINED
