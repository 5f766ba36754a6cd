"""Stacked MoE experts (transformers 5): the model holds `experts.gate_up_proj` [E, 2I, H] and
`experts.down_proj` [E, H, I]; `save_pretrained` writes one tensor per expert and part."""

from __future__ import annotations

import pytest
import torch
from helpers.weights.weights_utils import run_cli, run_json

import ffdebug

ENTRY = """
import torch
from transformers import DeepseekV3ForCausalLM


def load(checkpoint):
    return DeepseekV3ForCausalLM.from_pretrained(checkpoint).eval()


def load_and_scale_one_expert(checkpoint):
    model = load(checkpoint)
    with torch.no_grad():  # a post-processing bug touching expert 3's up_proj of layer 2 only
        model.model.layers[2].mlp.experts.gate_up_proj[3, 16:].mul_(0.5)
    return model
"""
GATE_UP = "experts.gate_up_proj=experts.{E}.gate_proj.weight+experts.{E}.up_proj.weight"
DOWN = "experts.down_proj=experts.{E}.down_proj.weight"


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """(the demo DeepSeek-V3 model, its save_pretrained folder, a folder with the loader entry)."""
    from ffdebug.demo import build_model

    root = tmp_path_factory.mktemp("moe")
    model = build_model()
    model.save_pretrained(root / "ckpt")
    (root / "moe_entry.py").write_text(ENTRY)
    return model, root / "ckpt", root


def test_checkpoint_is_per_expert_and_model_stacked(moe):
    model, ckpt, _ = moe
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in keys
    assert tuple(model.state_dict()["model.layers.1.mlp.experts.gate_up_proj"].shape) == (8, 32, 32)


def test_load_audit_round_trip_passes(moe, monkeypatch):
    _, ckpt, root = moe
    monkeypatch.syspath_prepend(str(root))
    r = run_cli("load-audit", "moe_entry:load", ckpt)
    assert r.exit_code == 0, r.stdout
    assert "All 121 checkpoint tensors were loaded as stored. PASSED" in " ".join(r.stdout.split())
    code, out = run_json("load-audit", "moe_entry:load", ckpt)
    assert code == 0 and out["loaded"] == 121 and not out["never_loaded"] and not out["not_covered"]
    assert "as transformers converts them on load" in out["notes"][0]


def test_load_audit_names_a_changed_and_a_missing_expert(moe, monkeypatch, tmp_path):
    _, ckpt, root = moe
    monkeypatch.syspath_prepend(str(root))
    import moe_entry

    code, out = run_json("load-audit", "moe_entry:load_and_scale_one_expert", ckpt)
    assert code == 1
    (bad,) = out["value_mismatch"]
    assert (bad["name"], bad["finding"], bad["module_class"]) == (
        "model.layers.2.mlp.experts.3.up_proj.weight",
        "scaled",
        "DeepseekV3Experts",
    )

    from safetensors.torch import load_file, save_file

    state = load_file(str(ckpt / "model.safetensors"))
    del state["model.layers.1.mlp.experts.5.gate_proj.weight"]
    save_file(state, tmp_path / "missing.safetensors")
    res = ffdebug.load_audit(moe_entry.load(ckpt), tmp_path / "missing.safetensors")
    assert not res and not res.never_loaded and not res.value_mismatch
    assert [(n["name"], n["module_class"]) for n in res.not_covered] == [
        ("model.layers.1.mlp.experts.5.gate_proj.weight", "DeepseekV3Experts")
    ]


def test_load_audit_infers_stacking_without_transformers_mapping(moe, monkeypatch):
    model, ckpt, _ = moe
    from ffdebug.weights import audit

    monkeypatch.setattr(audit, "transformers_stack_rules", lambda m: ([], []))
    res = audit.load_audit(model, ckpt)
    assert res, res.to_json()
    assert res.loaded == 121
    assert any("by shape" in n and GATE_UP in n for n in res.notes), res.notes


@pytest.mark.integration
def test_weights_diff_dump_vs_checkpoint_suggests_stack_and_rerun_matches(moe, tmp_path):
    from ffdebug.capture.weights import dump_weights

    model, ckpt, _ = moe
    side = dump_weights(model, str(tmp_path / "dump"))
    off = (
        "--match-content",
        "off",
    )  # the name path (content matching would pair them: test_content_matching.py)
    code, out = run_json("weights-diff", side, ckpt, "--skip", "*rotary_emb*", *off)
    assert code == 1 and len(out["only_ref"]) == 6 and len(out["only_target"]) == 72
    stacked = [r for r in out["renames"] if r["kind"] == "stacked"]
    assert [r["apply"] for r in stacked] == [f"--stack '{GATE_UP}'", f"--stack '{DOWN}'"]
    assert [r["matches"] for r in stacked] == [3, 3]
    assert out["apply"] == f"--stack '{GATE_UP}' --stack '{DOWN}'"

    args = ("--skip", "*rotary_emb*", "--stack", GATE_UP, "--stack", DOWN)
    code, out = run_json("weights-diff", side, ckpt, *args)
    assert code == 0 and out["schema_clean"] and len(out["tensors"]) == 121
    # Either side may be the stacked one; a part without `.weight` finds the checkpoint's.
    short = "experts.gate_up_proj=experts.{E}.gate_proj+experts.{E}.up_proj"
    res = ffdebug.weights_diff(ckpt, side, skip=["*rotary_emb*"], stack=[short, DOWN])
    assert res, (res.only_ref, res.only_target, res.notes)

    # Parts in the wrong order (up before gate) have the right shapes: the values tell.
    swapped = "experts.gate_up_proj=experts.{E}.up_proj.weight+experts.{E}.gate_proj.weight"
    bad = ffdebug.weights_diff(side, ckpt, skip=["*rotary_emb*"], stack=[swapped, DOWN])
    assert not bad and bad.schema_clean
    assert {t.name.rsplit(".", 2)[-2] for t in bad.problems()} == {"gate_proj", "up_proj"}


def test_stack_size_mismatch_is_a_note_not_a_pairing():
    ref = {"m.experts.gate_up_proj": torch.zeros(2, 6, 4)}
    tgt = {f"m.experts.{e}.{p}.weight": torch.zeros(2, 4) for e in range(2) for p in ("gate_proj", "up_proj")}
    res = ffdebug.weights_diff(ref, tgt, stack=[GATE_UP])
    assert res.only_ref == ["m.experts.gate_up_proj"] and len(res.only_target) == 4
    assert "add up to 4 along dim 0, one expert holds 6" in res.notes[0]
