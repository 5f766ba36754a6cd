"""Bisect against real HF models from tiny configs, weights shared between reference and target."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import TESTS
from helpers.bisect.bisect_models import (
    DS_CLASSES,
    ROPE_BAD_LAYER,
    deepseek,
    deepseek_missing_routed_scaling,
    dump,
    input_ids,
    llama,
    llama_wrong_rope,
)

import ffdebug

STABLE_KEYS = {"verdict", "first_divergence", "pattern", "per_class", "sub_stage"}


@pytest.fixture(scope="module")
def ds_dump(tmp_path_factory):
    """DeepSeek-V3-style: layers 0-1 dense, 2-4 MoE; the target's routers skip routed_scaling_factor."""
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("ds")
    ref = deepseek()
    ids = input_ids(vocab=256)
    dump(ref, d, "ref", ids, DS_CLASSES)
    dump(deepseek_missing_routed_scaling(ref), d, "target", ids, DS_CLASSES)
    return str(d)


@pytest.fixture(scope="module")
def llama_dumps(tmp_path_factory):
    """Llama-style reference; targets: wrong rotary base in one layer, and the whole model in bf16."""
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("llama")
    ref = llama()
    ids = input_ids()
    dump(ref, d, "ref", ids)
    dump(llama_wrong_rope(ref), d, "rope", ids)
    dump(llama().to(torch.bfloat16), d, "bf16", ids)
    dump(llama().to(torch.bfloat16), d, "noise_bf16", ids)  # the reference in the target's dtype
    return str(d)


@pytest.mark.integration
def test_missing_routed_scaling_is_a_layer_class_pattern_at_the_first_moe_layer(ds_dump):
    r = ffdebug.bisect(f"{ds_dump}/ref", f"{ds_dump}/target")
    fd = r.first_divergence
    assert (fd.layer, fd.layer_class, fd.stage) == (2, "moe", "ffn_out")
    assert r.pattern == "layer_class"
    # the router's top-k weights (scaled after the last, expert-level top-k; the group-level one
    # before it is not the routing), not the experts' output that reads them
    assert r.sub_stage.stage == "moe.topk_weights.out"
    classes = {c.layer_class: c for c in r.per_class}
    assert classes["dense"].layers == [0, 1] and classes["dense"].first_bad_layer is None
    assert classes["moe"].layers == [2, 3, 4] and classes["moe"].first_bad_layer == 2
    assert r.verdict == "bug" and r.failed()
    data = r.to_json()
    assert STABLE_KEYS <= set(data)
    assert set(data["first_divergence"]) == {"layer", "layer_class", "stage", "key", "severity", "cos", "rel"}
    assert {"layer_class", "layers", "first_bad_layer"} <= set(data["per_class"][0])
    assert {"stage", "severity", "cos", "rel"} <= set(data["sub_stage"])
    assert "layer 2 (moe), ffn_out" in r.conclusion and "layer_class" in r.conclusion
    assert r.conclusion.endswith("FAILED")


def test_declared_layer_classes_relabel_the_layers(ds_dump):
    r = ffdebug.bisect(f"{ds_dump}/ref", f"{ds_dump}/target", layer_class="hash:0-1,routed:2-")
    assert r.first_divergence.layer_class == "routed"
    assert r.pattern == "layer_class"
    assert [c.layer_class for c in r.per_class] == ["hash", "routed"]


@pytest.mark.integration
def test_wrong_rotary_base_in_one_layer_is_a_jump_with_attention_sub_stage(llama_dumps):
    r = ffdebug.bisect(f"{llama_dumps}/ref", f"{llama_dumps}/rope")
    assert r.pattern == "jump"
    assert r.first_divergence.layer == ROPE_BAD_LAYER
    assert r.first_divergence.stage == "attn_out"
    assert r.sub_stage.stage == "attn.q_rot"  # the rotated q (transformers' apply_rotary_pos_emb)
    intro = [row.layer for row in r.layers if row.introduces]
    assert intro == [ROPE_BAD_LAYER]
    assert f"layer {ROPE_BAD_LAYER}" in r.conclusion and "jump" in r.conclusion


def test_attribution_tells_local_from_inherited(llama_dumps):
    entry = str(TESTS / "helpers" / "bisect" / "bisect_models.py")
    r = ffdebug.bisect(
        f"{llama_dumps}/ref",
        f"{llama_dumps}/rope",
        model_ref=f"{entry}:llama_ref",
        model_target=f"{entry}:llama_target",
    )
    verdicts = {a["layer"]: a["verdict"] for a in r.attribution}
    assert verdicts[ROPE_BAD_LAYER] == "local"
    assert verdicts[ROPE_BAD_LAYER + 1] == "inherited"
    assert verdicts[0] == "clean"
    assert r.pattern == "jump" and r.first_divergence.layer == ROPE_BAD_LAYER


def test_bf16_target_is_drift_not_a_bug(llama_dumps):
    r = ffdebug.bisect(f"{llama_dumps}/ref", f"{llama_dumps}/bf16")
    assert r.pattern == "drift"
    # bf16 rounds each result to 2^-9 (~0.2%): every block's output is at least that far off and
    # the error grows layer by layer, staying in the ok band (< 1%) inside the blocks; the worst
    # stage crosses 1% (drift) and nothing comes near diverge (10%).
    rels = [row.rel_out for row in r.layers]
    assert all(2.0**-9 <= x < 0.01 for x in rels) and rels == sorted(rels), rels
    assert r.verdict == "drift"
    assert not r.failed()
    assert "drift" in r.conclusion and r.conclusion.endswith("PASSED")


def test_noise_run_in_the_target_dtype_calibrates_bf16_to_match(llama_dumps):
    r = ffdebug.bisect(f"{llama_dumps}/ref", f"{llama_dumps}/bf16", noise=f"{llama_dumps}/noise_bf16")
    assert r.pattern == "match"
    assert r.verdict == "ok"
    assert r.first_divergence is None


def test_identical_runs_match(llama_dumps):
    r = ffdebug.bisect(f"{llama_dumps}/ref", f"{llama_dumps}/ref")
    assert (r.pattern, r.verdict, r.first_divergence, r.sub_stage) == ("match", "ok", None, None)
    assert r.conclusion.endswith("PASSED")


def test_attribution_feeds_a_decoder_block_the_reference_encoder_output(tmp_path):
    """Blenderbot (encoder layers 0-1, decoder layers 2-3): v scaled in encoder layer 1. Every decoder
    block reads that encoder's output through cross-attention; re-run on the reference's decoder
    input but its own encoder's output, each would err by itself. Fed the reference's encoder output
    too (`encoder_hidden_in`), only layer 1 errs: a jump there."""
    from ffdebug.selftest.models import build, resolve

    model = build(resolve("BlenderbotForConditionalGeneration"))
    ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(3))
    values = {"input_ids": ids, "decoder_input_ids": ids}
    target = copy.deepcopy(model)
    with torch.no_grad():
        target.model.encoder.layers[1].self_attn.v_proj.weight.mul_(1.5)
    for side, m in (("ref", model), ("target", target)):
        with ffdebug.capture(m, dir=str(tmp_path), side=side), torch.no_grad():
            m(**values)
    r = ffdebug.bisect(
        f"{tmp_path}/ref", f"{tmp_path}/target", model_ref=(model, values), model_target=(target, values)
    )
    verdicts = {a["layer"]: a["verdict"] for a in r.attribution}
    assert verdicts[1] == "local" and verdicts[0] == "clean"
    assert all(verdicts[layer] != "local" for layer in (2, 3)), r.attribution
    assert (r.pattern, r.first_divergence.layer, r.decided) == ("jump", 1, True), r.reason
