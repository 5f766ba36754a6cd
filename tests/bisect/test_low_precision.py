"""A low-precision side against a reference in another dtype (docs/bisect.md "Judgement"): what
rounding amplified by the model does is precision, a scale of the signal is not; values below the
dtype's range, indices chosen from rounded scores, expert rows routed otherwise and differences a
branch output does not carry are not bugs.

The rules are checked against hand-derived values first; then the zoo architectures whose
precision cases each rule was written for (`ffdebug.selftest`) pass their bf16 / fp16 cases, and
and an error that is not a scale, past the diverge band, still fails a bf16 target."""

from __future__ import annotations

import math

import pytest
import torch

from ffdebug import verdict as V
from ffdebug.comparison.align import by_routed_tokens
from ffdebug.comparison.metrics import compare_tensors
from ffdebug.verdict import Severity


def _metrics(r, t):
    m = compare_tensors(r, t)
    return m.cos, m.rel, m.norm_ratio


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_scale_error_and_coherence_against_hand_derived_values():
    r = _randn(64, 32)
    cos, rel, nr = _metrics(r, 1.1 * r)  # q scaled by 1.1: all of the error is +0.1 of the signal
    assert V.scale_error(cos, nr) == pytest.approx(0.1, rel=1e-9)
    assert V.coherence(cos, nr, rel) == pytest.approx(1.0, rel=1e-9)
    heads = torch.ones(4, 8, dtype=torch.float64)
    t = heads.clone()
    t[2] = 0.0  # one head of four (equal norms) zeroed: e = -r_head, <e, r> = -|r|^2 / 4
    cos, rel, nr = _metrics(heads.reshape(-1), t.reshape(-1))
    assert V.scale_error(cos, nr) == pytest.approx(-0.25, rel=1e-9)
    # |e| = |r| / 2: coherence -1/2, below `COHERENT` (the bug band judges a head zeroed: rel 50%)
    assert V.coherence(cos, nr, rel) == pytest.approx(-0.5, rel=1e-9) and rel == pytest.approx(0.5)
    # each feature pair rotated by asin(0.1): |e| = 2 sin(theta / 2) |r|, <e, r> = (cos theta - 1) |r|^2
    theta = math.asin(0.1)
    a, b = r[:, 0::2], r[:, 1::2]
    rot = torch.stack([math.cos(theta) * a - 0.1 * b, 0.1 * a + math.cos(theta) * b], -1).reshape(r.shape)
    cos, rel, nr = _metrics(r, rot)
    assert V.coherence(cos, nr, rel) == pytest.approx(-math.sin(theta / 2), rel=1e-6)


def test_amplified_precision_applies_to_an_incoherent_error_of_a_low_precision_side_only():
    r = _randn(64, 32)
    noise = 0.2 * r.norm() / _randn(64, 32, seed=1).norm() * _randn(64, 32, seed=1)
    cos, rel, nr = _metrics(r, r + noise)  # rel 0.2: the diverge band, not a scale of r
    assert 0.19 < rel < 0.21 and abs(V.coherence(cos, nr, rel)) < 0.1
    assert V.amplified_precision(Severity.DIVERGE, cos, rel, nr, "float32", "bfloat16") is not None
    assert V.amplified_precision(Severity.DIVERGE, cos, rel, nr, "float16", "float32") is not None
    # one dtype on both sides: the bands judge it (bf16 against bf16, fp32 against fp32)
    assert V.amplified_precision(Severity.DIVERGE, cos, rel, nr, "bfloat16", "bfloat16") is None
    assert V.amplified_precision(Severity.DIVERGE, cos, rel, nr, "float32", "float32") is None
    # a scale of the signal of the same size: never precision
    cos, rel, nr = _metrics(r, 1.2 * r)
    assert V.amplified_precision(Severity.DIVERGE, cos, rel, nr, "float32", "bfloat16") is None
    # beyond the diverge band (rel > 30%): the bug band holds whatever the dtypes
    big = 0.4 / 0.2 * noise
    cos, rel, nr = _metrics(r, r + big)
    assert rel > 0.3 and V.amplified_precision(Severity.BUG, cos, rel, nr, "float32", "bfloat16") is None


def test_below_range_is_the_low_precision_dtypes_smallest_normal():
    assert V.below_range(1e-6, "float32", "float16") is not None  # fp16's smallest normal: 6.1e-5
    assert V.below_range(1e-4, "float32", "float16") is None
    assert V.below_range(1e-6, "float32", "bfloat16") is None  # bf16 has fp32's range
    assert V.below_range(1e-39, "float32", "bfloat16") is not None
    assert V.below_range(1e-6, "float16", "float16") is None  # both sides flush alike


def test_selection_caps_integer_stages_of_a_mixed_call_inside_layers_only():
    mixed = ("float32", "bfloat16")
    assert V.selection(Severity.BUG, 2, True, mixed) is not None
    assert V.selection(Severity.BUG, None, True, mixed) is None  # input ids and other top-level ids
    assert V.selection(Severity.BUG, 2, True, None) is None  # one dtype: ids that differ are a bug
    assert V.selection(Severity.BUG, 2, False, mixed) is None
    assert V.call_dtypes([("float32", "float32"), ("float32", "bfloat16")]) == ("float32", "bfloat16")
    assert V.call_dtypes([("float32", "float32"), ("int64", "int64")]) is None


def test_expert_rows_are_compared_by_the_token_each_holds():
    rows = _randn(6, 4)  # the branch input's token rows 0..5
    ref_tokens, tgt_tokens = [1, 3, 4], [4, 1, 5, 3]  # token 5 routed here on the target only
    r, t = rows[ref_tokens], rows[tgt_tokens]
    got = by_routed_tokens(r, t, ref_tokens, tgt_tokens)
    assert got is not None
    r2, t2, note = got
    assert torch.equal(r2, rows[[1, 3, 4]]) and torch.equal(t2, rows[[1, 3, 4]])
    assert "3 token(s)" in note and "target only: 5" in note
    assert by_routed_tokens(r, r.clone(), ref_tokens, ref_tokens) is None  # nothing to align
    assert by_routed_tokens(r, t[:2], ref_tokens, tgt_tokens) is None  # the list does not describe the rows


# The zoo's architectures whose bf16 / fp16 cases each rule was written for (2026-12-02 sweep): a
# T5 norm computed in fp32 (capture), conv nets whose tiny activations underflow fp16, grouped
# routing and sparse attention's top-k indices (selection), token routing that flips (expert rows
# by token, gathered rows), sharp attention contained by the branch output.
ZOO_CASES = [
    ("T5ForConditionalGeneration", "fp16"),
    ("MobileNetV2ForImageClassification", "fp16"),
    ("hy_v4", "fp16"),
    ("jetmoe", "bf16"),
    ("cpmant", "bf16"),
    ("NllbMoeForConditionalGeneration", "bf16"),
]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize(("spec", "case"), ZOO_CASES, ids=[f"{s}-{c}" for s, c in ZOO_CASES])
def test_zoo_precision_cases_the_rules_were_written_for_pass(spec, case):
    from ffdebug.selftest.cases import HOLDS, SelftestOptions, run_model

    report = run_model(spec, SelftestOptions(groups=("precision",)))
    assert report.built, report.error
    got = next(c for c in report.cases if c.name == case)
    assert got.status == HOLDS and got.exit_code == 0, got.got


def _rotate_pairs(module, sine: float) -> None:
    """The projection's output feature pairs (2i, 2i + 1) rotated by asin(sine), in its weights."""
    c = math.sqrt(1.0 - sine * sine)
    with torch.no_grad():
        for p in [module.weight] + ([module.bias] if module.bias is not None else []):
            a, b = p[0::2].clone(), p[1::2].clone()
            p[0::2], p[1::2] = c * a - sine * b, sine * a + c * b


@pytest.mark.integration
def test_an_error_that_is_not_a_scale_still_fails_a_bf16_target_beyond_the_diverge_band(tmp_path):
    """The guard of the amplified-precision rule: layer 1's v projection rotated by 30 degrees in a
    bf16 Qwen2 (v off by 2 sin 15 = 52%, not a scale of it) is found at layer 1."""
    import copy

    import ffdebug
    from ffdebug.selftest.models import build, resolve
    from ffdebug.selftest.shrink import Sizes

    model = build(resolve("qwen2"), Sizes(layers=4), 0)
    ids = torch.randint(3, 500, (2, 16), generator=torch.Generator().manual_seed(7))
    target = copy.deepcopy(model)
    _rotate_pairs(target.model.layers[1].self_attn.v_proj, 0.5)
    sides = {}
    for side, m in (("ref", model), ("bf16", target.to(torch.bfloat16))):
        with ffdebug.capture(m, dir=str(tmp_path), side=side, substages=True), torch.no_grad():
            m(input_ids=ids)
        sides[side] = str(tmp_path / side)
    r = ffdebug.bisect(sides["ref"], sides["bf16"])
    assert r.exit_code() == 1, r.conclusion
    assert r.first_divergence is not None and r.first_divergence.layer == 1
