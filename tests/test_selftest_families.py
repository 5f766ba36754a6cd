"""selftest beyond causal LMs: encoder-decoder LMs, image classifiers and diffusers denoisers
(ffdebug/selftest/families.py, diffusers_zoo.py; docs/selftest.md "Families")."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from ffdebug.cli.app import app
from ffdebug.selftest import diffusers_zoo
from ffdebug.selftest.cases import HOLDS, SelftestOptions, run_model
from ffdebug.selftest.families import DIFFUSERS, IMAGE_CLASSIFICATION, SEQ2SEQ_LM, inputs
from ffdebug.selftest.models import SelftestError, build, resolve
from ffdebug.selftest.zoo import architectures, sample, summarise

runner = CliRunner()


@pytest.mark.parametrize(
    "spec, family, cls",
    [
        ("t5", SEQ2SEQ_LM, "T5ForConditionalGeneration"),
        ("BartForConditionalGeneration", SEQ2SEQ_LM, "BartForConditionalGeneration"),
        ("ViTForImageClassification", IMAGE_CLASSIFICATION, "ViTForImageClassification"),
        ("SD3Transformer2DModel", DIFFUSERS, "SD3Transformer2DModel"),
    ],
)
def test_a_spec_resolves_to_its_family(spec, family, cls):
    resolved = resolve(spec)
    assert (resolved.family, resolved.model_class.__name__) == (family, cls)


def test_bart_by_model_type_is_still_its_causal_lm():
    """A model_type resolves to the first family that knows it; the seq2seq class is named by class."""
    assert resolve("bart").model_class.__name__ == "BartForCausalLM"


def test_a_diffusers_config_file_resolves_with_its_values(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"_class_name": "SD3Transformer2DModel", "num_layers": 3, "in_channels": 8}))
    spec = resolve(str(path))
    assert spec.family == DIFFUSERS and spec.config["in_channels"] == 8 and spec.config["num_layers"] == 3
    path.write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    with pytest.raises(SelftestError, match="is not a diffusers transformer or UNet"):
        resolve(str(path))


def test_the_diffusers_shrinker_keeps_a_unet_consistent():
    cfg, changes = diffusers_zoo.shrink(
        diffusers_zoo.default_config(resolve("UNet2DConditionModel").model_class)
    )
    # two levels, their first and last kinds, channels per level, groups dividing them
    assert cfg["down_block_types"] == ("CrossAttnDownBlock2D", "DownBlock2D")
    assert cfg["up_block_types"] == ("UpBlock2D", "CrossAttnUpBlock2D")
    assert cfg["block_out_channels"] == (32, 64) and cfg["norm_num_groups"] == 8
    assert cfg["cross_attention_dim"] == 32 and cfg["layers_per_block"] == 1
    assert any(c.startswith("block_out_channels: (320, 640, 1280, 1280) -> (32, 64)") for c in changes)


@pytest.mark.parametrize(
    "axes, head_dim", [((16, 56, 56), 16), ((4, 4, 8), 16), ((32, 32), 8), ((2, 2, 2, 2), 8)]
)
def test_rotary_axes_are_resplit_to_the_head_dim_each_even(axes, head_dim):
    got = diffusers_zoo._axes(axes, head_dim)
    assert sum(got) == head_dim and all(a >= 2 and a % 2 == 0 for a in got) and len(got) == len(axes)


def test_inputs_follow_each_family_and_repeat_with_the_seed():
    spec = resolve("FluxTransformer2DModel")
    flux = build(spec)
    got = inputs(spec.family, flux, 2, 16, 0, 512)
    assert got["hidden_states"].shape == (2, 16, flux.config.in_channels)  # packed, with position ids
    assert got["img_ids"].shape == (16, 3) and got["txt_ids"].shape == (8, 3)
    assert got["encoder_hidden_states"].shape == (2, 8, 32) and got["pooled_projections"].shape == (2, 32)
    again = inputs(spec.family, flux, 2, 16, 0, 512)
    assert all(torch.equal(got[k], again[k]) for k in got)
    t5_spec = resolve("t5")
    t5 = inputs(SEQ2SEQ_LM, build(t5_spec), 2, 16, 0, 512)
    assert t5["input_ids"].shape == (2, 16) and t5["decoder_input_ids"].shape == (2, 8)
    vit = inputs(IMAGE_CLASSIFICATION, build(resolve("ViTForImageClassification")), 2, 16, 0, 512)
    assert vit["pixel_values"].shape[:2] == (2, 3)


def test_the_zoo_lists_every_family_from_the_libraries():
    assert "T5ForConditionalGeneration" in architectures(SEQ2SEQ_LM)
    assert "ViTForImageClassification" in architectures(IMAGE_CLASSIFICATION)
    denoisers = architectures(DIFFUSERS)
    assert {"SD3Transformer2DModel", "FluxTransformer2DModel", "UNet2DConditionModel"} <= set(denoisers)
    assert "AutoencoderKL" not in denoisers
    assert sample(2, 0, DIFFUSERS) == sample(2, 0, DIFFUSERS) and len(sample(2, 0, DIFFUSERS)) == 2


@pytest.mark.integration
@pytest.mark.parametrize("spec", ["T5ForConditionalGeneration", "UNet2DConditionModel"])
def test_a_bit_identical_copy_passes_outside_causal_lms(spec):
    """(a) on an encoder-decoder LM and a UNet: exit 0 and coverage complete; mutations planted."""
    report = run_model(spec, SelftestOptions(groups=("copy", "mutations")))
    assert report.built, report.error
    cases = {c.name: c for c in report.cases}
    assert cases["copy"].status == HOLDS, cases["copy"].got
    assert any(c.group == "mutations" for c in report.cases)
    assert summarise([report]).families[report.family]["copy"].holds == 1


def test_family_usage_errors_are_exit_2():
    r = runner.invoke(app, ["selftest", "--zoo", "--family", "audio"])
    assert r.exit_code == 2 and "--family audio: unknown" in r.stderr
    r = runner.invoke(app, ["selftest", "qwen2", "--family", "diffusers"])
    assert r.exit_code == 2 and "add --zoo" in r.stderr
