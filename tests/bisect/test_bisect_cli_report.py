"""CLI (bisect, slot-invariance), the HTML report, and layer classes from HF configs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import torch
from helpers import hang_timeout
from helpers.bisect.bisect_models import (
    DS_CLASSES,
    deepseek,
    deepseek_missing_routed_scaling,
    dump,
    input_ids,
    llama,
)
from typer.testing import CliRunner

from ffdebug.cli.app import app
from ffdebug.models.blocks import config_layer_classes

runner = CliRunner()


@pytest.fixture(scope="module")
def ds_dir(tmp_path_factory):
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp("ds_cli")
    ref = deepseek(num_layers=4, dense=1)
    ids = input_ids(vocab=256)
    dump(ref, d, "ref", ids, DS_CLASSES)
    dump(deepseek_missing_routed_scaling(ref), d, "target", ids, DS_CLASSES)
    return str(d)


@pytest.mark.integration
def test_bisect_cli_json_and_exit_code(ds_dir):
    res = runner.invoke(app, ["bisect", "--dir", ds_dir, "--json"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert data["pattern"] == "layer_class"
    assert data["first_divergence"]["layer"] == 1 and data["first_divergence"]["layer_class"] == "moe"
    assert data["passed"] is False
    res = runner.invoke(app, ["bisect", f"{ds_dir}/ref", f"{ds_dir}/target", "--fail-on", "scramble"])
    assert res.exit_code == 0, res.output
    last = res.stdout.strip().splitlines()[-1]
    assert last.endswith("PASSED")
    assert "layer 1 (moe)" in res.stdout and "layer_class" in res.stdout


def test_bisect_cli_usage_errors_exit_2(ds_dir, tmp_path):
    res = runner.invoke(app, ["bisect", "--dir", str(tmp_path)])
    assert res.exit_code == 2 and "not found" in res.output
    res = runner.invoke(app, ["bisect", "--dir", ds_dir, "--layer-class", "oops"])
    assert res.exit_code == 2 and "--layer-class" in res.output
    res = runner.invoke(app, ["bisect", "--dir", ds_dir, "--model-target", "nomodule"])
    assert res.exit_code == 2 and "--model-target" in res.output
    res = runner.invoke(app, ["bisect", "--dir", ds_dir, "--model-target", "os:getcwd"])
    assert res.exit_code == 2 and "--model-target 'os:getcwd'" in res.output and "nn.Module" in res.output
    res = runner.invoke(app, ["bisect", "--dir", ds_dir, "--model-target", "no_such_module_xyz:build"])
    assert res.exit_code == 2 and "--model-target" in res.output and "cannot import" in res.output


def test_html_report_is_self_contained_with_an_svg_plot(ds_dir, tmp_path):
    out = tmp_path / "report.html"
    res = runner.invoke(app, ["bisect", "--dir", ds_dir, "--html", str(out)])
    assert res.exit_code == 1, res.output
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert page.count("<svg") == 2 and page.count("<polyline") == 4  # cos and rel, one line per class
    # every layer is a point of its class's curve, in both plots: dense = layer 0, moe = layers 1-3
    points = re.findall(r"<title>(\w+) layer (\d+): ", page)
    assert sorted(points) == sorted([("dense", "0"), ("moe", "1"), ("moe", "2"), ("moe", "3")] * 2)
    assert "dense" in page and "moe" in page
    assert re.search(r"https?:|<script|<link|<img|@import|url\(", page) is None
    assert 'id="conclusion"' in page and "FAILED" in page and "layer 1 (moe)" in page
    assert "judgement <b>bug</b>" in page


@pytest.mark.chromium
@pytest.mark.skipif(os.environ.get("FFDEBUG_TEST_CHROMIUM") != "1", reason="opt-in: FFDEBUG_TEST_CHROMIUM=1")
def test_html_report_renders_in_headless_chromium(ds_dir, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "install Debian's chromium package"
    out = tmp_path / "report.html"
    runner.invoke(app, ["bisect", "--dir", ds_dir, "--html", str(out)])
    shot = tmp_path / "shot.png"
    subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}", "--window-size=1100,900",
         f"file://{out}"],
        check=True, capture_output=True, timeout=hang_timeout(300),
    )  # fmt: skip
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    colours = {img.getpixel((x, y)) for x in range(0, img.width, 3) for y in range(0, img.height, 3)}
    assert (31, 119, 180) in colours and (214, 39, 40) in colours  # the class curves were drawn


def _slot_dump(d, side: str, batch: int, perturb_slot: int | None = None, size: float = 0.05):
    """The same prompt in every slot; the target's layer-1 attention adds `size` x its mean |out|
    to one slot (a slot-dependent bug, or at 1e-7 a batch-variant kernel's rounding)."""
    torch.set_num_threads(1)  # bits are compared: one intra-op thread
    model = llama(num_layers=3)
    if perturb_slot is not None:

        def bump(module, args, output):
            out, weights = output
            out = out.clone()
            out[perturb_slot] += size * out[perturb_slot].abs().mean()
            return out, weights

        model.model.layers[1].self_attn.register_forward_hook(bump)
    ids = input_ids(batch=1).repeat(batch, 1)
    dump(model, d, side, ids)


@pytest.mark.integration
def test_slot_invariance_names_the_first_stage_where_slot_2_differs(tmp_path):
    _slot_dump(tmp_path, "target", batch=3, perturb_slot=2)
    _slot_dump(tmp_path / "single", "ref", batch=1)
    res = runner.invoke(
        app,
        ["slot-invariance", "--dir", str(tmp_path), "--slots", "3", "--single", str(tmp_path / "single/ref"),
         "--json"],
    )  # fmt: skip
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    bug = data["first_slot_bug"]
    assert (bug["key"], bug["slot"]) == ("L001.attn_out", 2)
    first = data["first_non_invariant"]
    assert (first["key"], first["slot"], first["classification"]) == ("L001.attn_out", 2, "slot_bug")
    keys = [s["key"] for s in data["stages"]]
    before = data["stages"][: keys.index("L001.attn_out")]
    assert before and all(s["worst"]["bit_equal"] == 1.0 for s in before)
    assert all(s["single"]["severity"] == "ok" for s in data["stages"])  # slot 0 == the single run
    text = runner.invoke(app, ["slot-invariance", f"{tmp_path}/target", "--slots", "3"])
    assert "First non-invariant stage: L001.attn_out (slot 2" in text.stdout
    assert text.stdout.strip().endswith("FAILED")


@pytest.mark.integration
def test_slot_invariance_rounding_level_difference_is_numerical(tmp_path):
    _slot_dump(tmp_path, "target", batch=2, perturb_slot=1, size=1e-7)
    res = runner.invoke(app, ["slot-invariance", "--dir", str(tmp_path), "--slots", "2", "--json"])
    data = json.loads(res.stdout)
    first = data["first_non_invariant"]
    assert (first["key"], first["classification"]) == ("L001.attn_out", "numerical")
    assert data["first_slot_bug"] is None
    assert res.exit_code == 0, res.output  # default --fail-on drift: inside the ok band passes
    res = runner.invoke(app, ["slot-invariance", "--dir", str(tmp_path), "--slots", "2", "--exact"])
    assert res.exit_code == 1, res.output


@pytest.mark.integration
def test_slot_invariance_clean_batch_passes_and_needs_equal_prompts(tmp_path):
    _slot_dump(tmp_path, "target", batch=2)
    res = runner.invoke(app, ["slot-invariance", "--dir", str(tmp_path), "--slots", "2"])
    assert res.exit_code == 0, res.output
    model = llama(num_layers=2)
    dump(model, tmp_path, "mixed", input_ids(batch=2))
    res = runner.invoke(app, ["slot-invariance", "--dir", str(tmp_path), "--side", "mixed", "--slots", "2"])
    assert res.exit_code == 3 and "same prompt" in res.output


def test_layer_classes_from_hf_configs():
    assert config_layer_classes({"first_k_dense_replace": 2}, 4) == ["dense", "dense", "moe", "moe"]
    assert config_layer_classes({"mlp_only_layers": [1], "num_experts": 4}, 3) == ["moe", "dense", "moe"]
    assert config_layer_classes({"decoder_sparse_step": 2, "num_experts": 4}, 4) == ["dense", "moe"] * 2
    types = ["sliding_attention", "full_attention"] * 2
    assert config_layer_classes({"layer_types": types}, 4) == types
    assert config_layer_classes({"attn_layer_indices": [1]}, 3) == ["mamba", "attention", "mamba"]
    assert config_layer_classes({"attn_type_list": [0, 1]}, 2) == ["linear_attention", "full_attention"]
    hybrid = {
        "layer_types": ["linear_attention", "full_attention"],
        "decoder_sparse_step": 2,
        "num_experts": 4,
    }
    assert config_layer_classes(hybrid, 2) == ["linear_attention+dense", "full_attention+moe"]
    assert config_layer_classes({}, 3) is None


def test_layer_classes_are_recorded_in_the_manifest(ds_dir):
    from ffdebug.store.reader import open_side

    recs = {r.key: r for r in open_side(f"{ds_dir}/ref").records}
    assert recs["L000.hidden_out"].layer_class == "dense"
    assert recs["L003.moe.router.out"].layer_class == "moe"


def test_structural_layer_classes_without_config_fields():
    import torch.nn as nn

    from ffdebug.models.blocks import find_blocks

    class Block(nn.Module):
        def __init__(self, moe: bool) -> None:
            super().__init__()
            self.attn = nn.Linear(4, 4)
            self.mlp = nn.Sequential(nn.Linear(4, 4)) if moe else nn.Linear(4, 4)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block(False), Block(True), Block(True)])

    labels = [b.layer_class for b in find_blocks(Net())]
    assert labels == ["Block[mlp=Linear]", "Block[mlp=Sequential]", "Block[mlp=Sequential]"]
    declared = [b.layer_class for b in find_blocks(Net(), declared="hash:0,routed:1-")]
    assert declared == ["hash", "routed", "routed"]  # (the HF path: the DeepSeek fixture above)
