"""compare() on real HF implementations: identical, injected bug at layer k, bf16, input ids."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

import ffdebug
from ffdebug.cli.app import app


def _dump(model, ids, directory, side, **kw):
    with ffdebug.capture(model, dir=directory, side=side, **kw), torch.no_grad():
        model(input_ids=ids)
    return directory / side


def test_identical_is_ok_and_bit_equal(tmp_path, tiny_llama, input_ids):
    ref = _dump(tiny_llama, input_ids, tmp_path, "ref")
    tgt = _dump(copy.deepcopy(tiny_llama), input_ids, tmp_path, "target")
    res = ffdebug.compare(ref, tgt)
    assert res.verdict == "ok" and res.first_divergence is None and bool(res)
    assert all(s["bit_equal"] == 1.0 and s["severity"] == "ok" for s in res.stages)
    assert len(res.stages) == 4 + 6 * 4


@pytest.mark.parametrize("k", [1, 2])
def test_scaled_mlp_at_layer_k_is_first_divergence(tmp_path, tiny_llama, input_ids, k):
    ref = _dump(tiny_llama, input_ids, tmp_path, "ref")
    target = copy.deepcopy(tiny_llama)
    target.model.layers[k].mlp.register_forward_hook(lambda m, a, o: o * 1.5)
    tgt = _dump(target, input_ids, tmp_path, "target")
    res = ffdebug.compare(ref, tgt)
    first = res.first_divergence
    assert (first["layer"], first["stage"]) == (k, "ffn_out")
    assert first["severity"] == "bug"  # pure scale: cos 1, rel 50%
    assert first["cos"] == pytest.approx(1.0, abs=1e-6) and first["rel"] == pytest.approx(0.5, rel=1e-5)
    assert all(s["severity"] == "ok" for s in res.stages if s["layer"] is not None and s["layer"] < k)


def _llama8():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def test_bf16_target_is_drift_not_bug(tmp_path, input_ids):
    """bf16 rounding (~0.4% per element) accumulates over 8 layers into the drift band."""
    model = _llama8()
    ref = _dump(model, input_ids, tmp_path, "ref")
    tgt = _dump(copy.deepcopy(model).to(torch.bfloat16), input_ids, tmp_path, "target")
    res = ffdebug.compare(ref, tgt)
    assert res.verdict == "drift", [
        (s["key"], s["severity"], s["rel"]) for s in res.stages if s["severity"] != "ok"
    ]
    assert bool(res)  # default fail-on diverge passes


def test_input_ids_gate_exit_3(tmp_path, tiny_llama, input_ids):
    _dump(tiny_llama, input_ids, tmp_path, "ref")
    other = input_ids.clone()
    other[1, 5] += 1
    _dump(tiny_llama, other, tmp_path, "target")
    r = CliRunner().invoke(app, ["compare", "ref-vs-target", "--dir", str(tmp_path)])
    assert r.exit_code == 3
    assert "input ids differ" in r.output and "position [1, 5]" in r.output


def test_cli_json_keys_and_exit_codes(tmp_path, tiny_llama, input_ids):
    _dump(tiny_llama, input_ids, tmp_path, "ref")
    target = copy.deepcopy(tiny_llama)
    target.model.layers[3].mlp.register_forward_hook(lambda m, a, o: o * 1.02)
    _dump(target, input_ids, tmp_path, "target")
    runner = CliRunner()
    r = runner.invoke(app, ["compare", "ref-vs-target", "--dir", str(tmp_path), "--json"])
    data = json.loads(r.output)
    assert set(data) >= {"verdict", "stages", "first_divergence"}
    assert set(data["stages"][0]) >= {
        "key",
        "layer",
        "layer_class",
        "severity",
        "cos",
        "rel",
        "rel_diff",
        "max_abs",
        "max_abs_at",
        "shape_ref",
        "shape_target",
    }
    assert data["verdict"] == "drift" and data["first_divergence"]["key"] == "L003.ffn_out"
    assert r.exit_code == 0  # drift is below the default fail-on (diverge)
    r2 = runner.invoke(
        app, ["compare", str(tmp_path / "ref"), str(tmp_path / "target"), "--fail-on", "drift"]
    )
    assert r2.exit_code == 1 and "FAILED" in r2.output and "layer 3" in r2.output
    r3 = runner.invoke(app, ["compare", "ref-vs-target", "--dir", str(tmp_path), "--layers", "0-2"])
    assert r3.exit_code == 0 and "PASSED" in r3.output
    r4 = runner.invoke(app, ["compare", "ref-vs-target", "--dir", str(tmp_path), "--exact"])
    assert r4.exit_code == 1


def test_missing_side_lists_found(tmp_path, tiny_llama, input_ids):
    _dump(tiny_llama, input_ids, tmp_path, "ref")
    r = CliRunner().invoke(app, ["compare", "ref-vs-target", "--dir", str(tmp_path)])
    assert r.exit_code == 2 and "sides present: ref" in r.output


def test_warmup_call_set_aside(tmp_path, tiny_llama, input_ids):
    with ffdebug.capture(tiny_llama, dir=tmp_path, side="ref", stages="final.logits"), torch.no_grad():
        tiny_llama(input_ids=input_ids)
    with ffdebug.capture(tiny_llama, dir=tmp_path, side="target", stages="final.logits"), torch.no_grad():
        with ffdebug.step(phase="warmup"):
            tiny_llama(input_ids=torch.zeros_like(input_ids))
        tiny_llama(input_ids=input_ids)
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    assert res.verdict == "ok" and res.warmup_skipped == 1


def test_shape_mismatch_reported(tmp_path):
    ffd = tmp_path
    with ffdebug.capture(None, dir=ffd, side="ref"):
        ffdebug.tap("x", torch.ones(2, 3))
    with ffdebug.capture(None, dir=ffd, side="target"):
        ffdebug.tap("x", torch.ones(3, 2))
    res = ffdebug.compare(ffd / "ref", ffd / "target")
    s = res.stages[0]
    assert s["finding"] == "shape_mismatch" and s["severity"] == "bug" and s["cos"] is None


def test_stats_only_compared_on_stats(tmp_path, tiny_llama, input_ids):
    _dump(tiny_llama, input_ids, tmp_path, "ref", mode="stats")
    target = copy.deepcopy(tiny_llama)
    target.model.layers[2].mlp.register_forward_hook(lambda m, a, o: o * 2.0)
    _dump(target, input_ids, tmp_path, "target", mode="stats")
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    assert res.stats_only
    assert res.first_divergence["key"] == "L002.ffn_out"


def test_noise_calibration(tmp_path, input_ids):
    model = _llama8()
    ref = _dump(model, input_ids, tmp_path, "ref")
    bf = copy.deepcopy(model).to(torch.bfloat16)
    noise = _dump(bf, input_ids, tmp_path, "noise")
    tgt = _dump(copy.deepcopy(bf), input_ids, tmp_path, "target")
    assert ffdebug.compare(ref, tgt).verdict == "drift"
    res = ffdebug.compare(ref, tgt, noise=noise)
    assert res.verdict == "ok"  # the target is exactly as far from ref as the noise run
    assert any(s.get("within_noise") for s in res.stages)
