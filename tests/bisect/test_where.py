"""Where inside the tensor: per-head and per-token error, the max-error coordinate by axis name."""

from __future__ import annotations

import pytest
import torch

import ffdebug
from ffdebug.comparison.where import breakdown


def test_per_head_per_token_and_named_coordinate_hand_built():
    """[batch 2, token 5, head 3, dim 4]: head 1 off by 10% from token 3 on, one element there
    off most. Expected per head: 0, ‖0.1 r[:, 3:, 1]‖ / ‖r[:, :, 1]‖, 0."""
    r = torch.randn(2, 5, 3, 4, generator=torch.Generator().manual_seed(0))
    t = r.clone()
    t[:, 3:, 1] *= 1.1
    t[1, 4, 1, 2] += 5.0
    w = breakdown("L000.attn.context.out", r, t)
    d = t.double() - r.double()
    expect = float(d[:, :, 1].norm() / r[:, :, 1].double().norm())
    assert w.per_head_rel[0] == 0.0 and w.per_head_rel[2] == 0.0
    assert w.per_head_rel[1] == pytest.approx(expect, rel=1e-12)
    assert w.per_token_rel[:3] == [0.0, 0.0, 0.0] and w.rise_from == 3
    assert breakdown("L000.attn_out", r.reshape(2, 5, 12), t.reshape(2, 5, 12)).per_head_rel is None
    assert breakdown("final.logits", r, t) is None  # not a layer stage: layout unknown


def test_compare_names_the_max_error_coordinate_and_the_token_rise(tmp_path):
    """A Qwen2 sliding-window layer attending over 8 tokens instead of 4: tokens 0-3 see the same
    context on both sides (exactly equal), token 4 is the first whose window differs."""
    from helpers.bisect.bisect_models import dump, input_ids, qwen2_sliding, wrong_sliding_window

    ref = qwen2_sliding(num_layers=2)
    ids = input_ids()
    dump(ref, tmp_path, "ref", ids)
    dump(wrong_sliding_window(ref), tmp_path, "target", ids)
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    attn = next(s for s in res.stages if s.key == "L000.attn_out")
    assert attn.per_token_rel[:4] == [0.0, 0.0, 0.0, 0.0] and attn.rise_from == 4
    assert "error rises from token 4" in attn.notes
    assert set(attn.max_abs_where) == {"batch", "token", "channel"} and attn.max_abs_where["token"] >= 4
    assert list(attn.max_abs_where.values()) == attn.max_abs_at
    assert attn.to_json()["per_token_rel"] == attn.per_token_rel


def test_a_gqa_head_grouping_bug_shows_which_heads_are_wrong(tmp_path):
    """4 query heads over 2 kv heads: grouped (k0, k0, k1, k1) on HF, tiled (k0, k1, k0, k1) in the
    buggy port, so heads 0 and 3 get their own kv head and heads 1 and 2 the other one."""
    from helpers.llama_ports import gqa_ungrouped, hf_for_ports, make_port

    hf = hf_for_ports(num_layers=1)
    ids = torch.randint(3, 1000, (2, 16), generator=torch.Generator().manual_seed(7))
    for side, m in (("ref", hf), ("target", gqa_ungrouped(make_port(hf)))):
        with ffdebug.capture(m, dir=tmp_path, side=side, substages=True), torch.no_grad():
            m(input_ids=ids)
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    by_key = {s.key: s for s in res.stages}
    assert all(by_key[f"L000.attn.{p}.out"].ok for p in "qkv")  # the projections are right
    ctx = by_key["L000.attn.context.out"]
    heads = ctx.per_head_rel
    assert heads[0] == 0.0 and heads[3] == 0.0 and min(heads[1], heads[2]) > 0.1
    assert "error in head(s) 1, 2 (rel per head: see per_head_rel)" in ctx.notes
    assert ctx.max_abs_where["head"] == 1


@pytest.mark.parametrize(
    "shape",
    [(2, 40, 3000), (1, 3, 70_000), (1, 40, 4, 2048)],
    ids=["rows-straddle-blocks", "rows-longer-than-a-chunk", "heads"],
)
def test_streamed_breakdown_matches_whole_tensor_float64(shape):
    """The row-block streaming (`where.row_sums`) against the per-token / per-head sums taken on
    whole float64 copies: 80 rows of 3000 (four blocks of 21 rows, the last one short), rows of
    70,000 (longer than a 64 Ki chunk: each summed in two pieces), and a 4-D attention stage
    (160 head rows of 2048, five blocks of 32)."""
    g = torch.Generator().manual_seed(1)
    r = torch.randn(shape, generator=g)
    t = r + 1e-3 * torch.randn(shape, generator=g) * torch.arange(shape[1]).view(
        1, -1, *[1] * (len(shape) - 2)
    )
    key = "L002.attn.q_rot" if len(shape) == 4 else "L002.mlp_out"
    w = breakdown(key, r, t)
    d2, r2 = (t.double() - r.double()).pow(2), r.double().pow(2)
    others = [i for i in range(len(shape)) if i != 1]
    expect_token = (d2.sum(others) / r2.sum(others)).sqrt().tolist()
    assert w.per_token_rel[0] == 0.0  # token 0 is scaled by 0: equal on both sides
    assert w.per_token_rel == pytest.approx(expect_token, rel=1e-12, abs=0)
    if len(shape) == 4:
        expect_head = (d2.sum((0, 1, 3)) / r2.sum((0, 1, 3))).sqrt().tolist()
        assert w.per_head_rel == pytest.approx(expect_head, rel=1e-12)
    assert w.rise_from == 1  # token 0 exact, token 1 the first with an error (then linear growth)


def test_breakdown_of_non_finite_or_overflowing_squares_is_none():
    """NaN / Inf in either side, or squares past float64's range, leave the stage unbroken."""
    r = torch.randn(1, 4, 8, dtype=torch.float64)
    t = r.clone()
    t[0, 2, 3] = float("nan")
    assert breakdown("L000.mlp_out", r, t) is None
    t = r.clone()
    t[0, 1, 1] = 1e200  # (t - r)² overflows float64
    assert breakdown("L000.mlp_out", r, t) is None
    t = r.clone()
    t[0, 3, 0] += 1.0
    assert breakdown("L000.mlp_out", r, t).per_token_rel[:3] == [0.0, 0.0, 0.0]


def test_token_runs_name_the_wrong_tokens_of_each_sequence_in_the_references_coordinates():
    from ffdebug.comparison.token_runs import sentence
    from ffdebug.comparison.where import token_runs

    ref = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(0))
    tgt = ref.clone()
    tgt[1, 2:5] *= 1.5  # sequence 1, tokens 2-4 wrong
    tgt[0, 0] += 1e-4 * ref[0, 0]  # sequence 0, token 0 within 1%
    runs, left = token_runs("L000.attn_out", ref, tgt)
    assert left == 0 and runs == [
        {"sequence": 0, "tokens": [0, 0], "state": "within"},
        {"sequence": 0, "tokens": [1, 5], "state": "exact"},
        {"sequence": 1, "tokens": [0, 1], "state": "exact"},
        {"sequence": 1, "tokens": [2, 4], "state": "wrong"},
        {"sequence": 1, "tokens": [5, 5], "state": "exact"},
    ]
    assert sentence(runs) == "sequence 1, tokens 2-4 wrong; sequence 0 within 1%"
    # packed rows: (sequence, position) of each row in the padded reference
    coords = torch.tensor([[0, 0], [0, 1], [1, 0], [1, 1], [1, 2]])
    packed_ref = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    packed_tgt = packed_ref.clone()
    packed_tgt[2:] *= -1
    runs, _ = token_runs("L001.ffn_out", packed_ref.numpy(), packed_tgt.numpy(), coords.numpy())
    assert sentence(runs) == "sequence 1, tokens 0-2 wrong; sequence 0 exact"
    assert token_runs("final.logits", ref, tgt) is None  # layer stages only
    every = tgt.clone() * 2
    assert sentence(token_runs("L000.attn_out", ref, every)[0]) is None  # all wrong: the numbers say it
