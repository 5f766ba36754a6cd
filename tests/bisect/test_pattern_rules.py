"""The pattern's rules on hand-made layer budgets (no model): a layer that dominates its class is a
jump, not the class's pattern; a decoder block inherits the error of its encoder input.

Numbers are chosen against the documented constants (`pattern.JUMP_RATIO` = 4, `INHERIT_SHARE` =
10%), not read back from the code: a class-mate adding a tenth of the first layer's error is
inherited-looking, one adding half of it is a class of its own."""

from __future__ import annotations

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
    (row,) = pat.layer_rows(stages)
    assert not row.exact_in
    assert row.rel_in == 0.20 and abs(row.added - (0.15 - 0.20)) < 1e-12
    assert any("encoder input" in n for n in row.notes)


def test_an_exact_encoder_input_leaves_the_decoder_stream_in_charge():
    stages = [
        _stage("L004.hidden_in", 0.0),
        _stage("L004.encoder_hidden_in", 0.0),
        _stage("L004.hidden_out", 0.1),
    ]
    (row,) = pat.layer_rows(stages)
    assert row.exact_in and row.rel_in == 0.0 and row.added == 0.1
