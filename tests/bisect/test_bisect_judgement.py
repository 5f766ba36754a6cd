"""Bisect's judgement on harder cases: where the bands alone would mislead (docs/bisect.md "Bisecting").

Same dtype and an exactly equal prefix: any error that then appears is a bug signal, however small,
and bisect fails (verdict and judgement `bug`, one grade) although the worst band may be `ok` or
`drift`."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.bisect.bisect_models import (
    ROPE_BAD_LAYER,
    dump,
    input_ids,
    llama,
    llama_scaled,
    llama_wrong_rope,
    qwen2_sliding,
    wrong_sliding_window,
)
from typer.testing import CliRunner

import ffdebug
from ffdebug.cli.app import app

runner = CliRunner()


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    """One fp32 Llama reference, targets with one bug each (or two), and bf16 runs."""
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("judge")
    ref = llama()
    ids = input_ids()
    dump(ref, d, "ref", ids)
    dump(llama_wrong_rope(ref), d, "rope", ids)
    dump(llama_wrong_rope(ref, layer=0), d, "rope0", ids)
    dump(llama_scaled(ref, "lm_head.weight", 1.001), d, "lm_head", ids)
    two = llama_scaled(llama_wrong_rope(ref, layer=1), "model.layers.3.mlp.down_proj.weight", 3.0)
    dump(two, d, "two", ids)
    ref_bf16 = llama().to(torch.bfloat16)
    dump(ref_bf16, d, "noise_bf16", ids)  # the reference in the target's dtype
    dump(llama_wrong_rope(ref_bf16), d, "bf16_rope", ids)
    return str(d)


def _bisect(d, target, **kw):
    return ffdebug.bisect(f"{d}/ref", f"{d}/{target}", **kw)


# The block-level stages only: without the rotated q / k taps (which show the rotary bug plainly)
BLOCK_STAGES = ("embed.*", "final.*", "L*_in", "L*_out")


@pytest.mark.integration
def test_rotary_base_jump_fails_although_its_worst_band_is_drift(d):
    r = _bisect(d, "rope", stages=BLOCK_STAGES)
    assert (r.pattern, r.first_divergence.layer, r.first_divergence.stage) == ("jump", 2, "attn_out")
    # The bands alone call it drift (rel a few %): the bug grade comes from the exact prefix.
    assert r.first_divergence.severity == "drift" and r.verdict == "bug"
    assert "exactly equal" in r.signal
    assert r.judgement == "bug" and r.failed() and not r
    assert r.conclusion.endswith("verdict bug (raised by the bug signal). FAILED")
    globs = [arg for g in BLOCK_STAGES for arg in ("--stages", g)]
    res = runner.invoke(app, ["bisect", f"{d}/ref", f"{d}/rope", "--json", *globs])
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert (data["verdict"], data["judgement"], data["passed"]) == ("bug", "bug", False)
    # --fail-on still decides: a signal counts as `bug`, below `scramble`.
    assert (
        runner.invoke(app, ["bisect", f"{d}/ref", f"{d}/rope", "--fail-on", "scramble", *globs]).exit_code
        == 0
    )
    # with the rotated q / k dumped, the rotary table itself is named inside the layer
    full = _bisect(d, "rope")
    assert (full.first_divergence.layer, full.sub_stage.stage) == (2, "attn.q_rot")


def test_bug_in_the_first_layer_is_a_jump_with_a_signal(d):
    r = _bisect(d, "rope0")
    assert (r.pattern, r.first_divergence.layer, r.sub_stage.stage) == ("jump", 0, "attn.q_rot")
    assert [row.layer for row in r.layers if row.introduces] == [0]
    assert r.signal and r.judgement == "bug" and r.failed()


def test_tiny_error_only_in_lm_head_after_exact_layers_is_localised(d):
    r = _bisect(d, "lm_head")
    assert r.first_divergence.severity == "ok"  # rel 0.1%: every band is ok; the signal raises it
    assert r.pattern == "match" and not any(row.introduces for row in r.layers)
    assert r.first_divergence.key == "final.logits" and r.first_divergence.layer is None
    assert r.first_divergence.rel == pytest.approx(0.001, rel=0.05)
    assert r.signal and r.judgement == "bug" and r.failed()
    assert "final.logits (outside the layers)" in r.conclusion


def test_two_bugs_first_layer_reported_and_the_second_named(d):
    r = _bisect(d, "two")
    assert r.first_divergence.layer == 1 and r.pattern == "jump"
    assert [row.layer for row in r.layers if row.introduces] == [1, 3]
    assert "also introducing error: layer 3" in r.reason and "layer 3" in r.conclusion
    assert r.verdict == "bug" and r.failed()


def test_bf16_rope_bug_is_found_by_the_noise_run_and_pure_bf16_is_not(d):
    r = _bisect(d, "bf16_rope", noise=f"{d}/noise_bf16")
    assert (r.pattern, r.first_divergence.layer) == ("jump", ROPE_BAD_LAYER)
    assert [row.layer for row in r.layers if row.introduces] == [ROPE_BAD_LAYER]
    assert "noise" in r.signal and r.failed()
    clean = _bisect(d, "noise_bf16")  # no bug, no noise run: drift, no signal, passes
    assert (clean.pattern, clean.signal, clean.failed()) == ("drift", None, False)


def test_all_ok_run_matches_and_exits_0(d):
    res = runner.invoke(app, ["bisect", f"{d}/ref", f"{d}/ref", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert (data["pattern"], data["verdict"], data["judgement"], data["signal"]) == (
        "match",
        "ok",
        "ok",
        None,
    )
    assert data["first_divergence"] is None and data["sub_stage"] is None


@pytest.mark.integration
def test_broken_sliding_window_layers_are_a_layer_class_pattern(tmp_path):
    ref = qwen2_sliding()
    ids = input_ids()
    dump(ref, tmp_path, "ref", ids)
    dump(wrong_sliding_window(ref), tmp_path, "target", ids)
    r = ffdebug.bisect(f"{tmp_path}/ref", f"{tmp_path}/target")
    assert r.pattern == "layer_class"
    assert (r.first_divergence.layer, r.first_divergence.layer_class) == (0, "sliding_attention")
    assert r.sub_stage.stage == "attn_out"
    classes = {c.layer_class: c for c in r.per_class}
    assert classes["sliding_attention"].introducing == [0, 2, 4]
    assert classes["sliding_attention"].first_bad_layer == 0
    # The full-attention layers carry the inherited error but introduce none: not blamed.
    assert classes["full_attention"].introducing == []
    assert classes["full_attention"].first_bad_layer is None
    assert classes["full_attention"].first_over_threshold == 1
    assert "sliding_attention code path is implicated" in r.conclusion
