"""load-audit: checkpoint tensors never loaded, model tensors left at init, skipped shapes (issue 3)."""

from __future__ import annotations

import json

import torch
from helpers.weights.weights_utils import run_cli
from safetensors.torch import save_file

import ffdebug

HEAD_MODULE = '''
import torch
from safetensors.torch import load_file


class Head(torch.nn.Module):
    """Mixes the last N hidden states: in_features = N * hidden."""

    def __init__(self, n_inputs, hidden=8):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, hidden)
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(n_inputs * hidden, 3)


def build(checkpoint):
    """Loads like `from_pretrained(..., ignore_mismatched_sizes=True)`: what does not fit is skipped."""
    torch.manual_seed(123)
    model = Head(n_inputs=4)
    state = load_file(checkpoint)
    own = model.state_dict()
    fitting = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(fitting, strict=False)
    return model
'''


def _head_checkpoint(tmp_path, monkeypatch):
    (tmp_path / "head_model.py").write_text(HEAD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import head_model

    torch.manual_seed(0)
    trained = head_model.Head(n_inputs=5)
    path = tmp_path / "head.safetensors"
    save_file(trained.state_dict(), path)
    return path


def test_head_sized_for_4_inputs_vs_checkpoint_with_5(tmp_path, monkeypatch):
    ckpt = _head_checkpoint(tmp_path, monkeypatch)
    r = run_cli("load-audit", "head_model:build", ckpt, "--json")
    assert r.exit_code == 1, r.stderr
    out = json.loads(r.stdout)
    assert out["shape_mismatch"][0] == {
        "name": "head.weight",
        "shape_model": [3, 32],
        "shape_checkpoint": [3, 40],
        "module": "head",
        "module_class": "Linear",
    }
    assert [s["name"] for s in out["shape_mismatch"]] == ["head.weight"]  # the bias fits: [3]
    assert out["loaded"] == 5 and not out["never_loaded"] and not out["not_covered"]
    assert out["passed"] is False and out["verdict"] == "bug"  # never "ok" beside a failure
    text = run_cli("load-audit", f"{tmp_path / 'head_model.py'}:build", ckpt)
    assert text.exit_code == 1
    assert "head.weight" in text.stdout and "Linear" in text.stdout and "[3, 32]" in text.stdout
    assert text.stdout.strip().endswith("FAILED")


def test_never_loaded_not_covered_and_value_mismatch(tmp_path, monkeypatch):
    ckpt = _head_checkpoint(tmp_path, monkeypatch)
    import head_model
    from safetensors.torch import load_file

    state = load_file(ckpt)
    state["proj.weights"] = state.pop("proj.weight")  # a typo in the converter
    state.pop("head.weight")
    renamed = tmp_path / "renamed.safetensors"
    save_file(state, renamed)
    model = head_model.Head(n_inputs=5)
    model.load_state_dict(state, strict=False)
    with torch.no_grad():
        model.norm.weight.neg_()  # loaded, then changed by a buggy post-processing step
    result = ffdebug.load_audit(model, renamed)
    assert not result
    assert [n["name"] for n in result.never_loaded] == ["proj.weights"]
    assert {n["name"]: n["module_class"] for n in result.not_covered} == {
        "proj.weight": "Linear",
        "head.weight": "Linear",
    }
    (bad,) = result.value_mismatch
    assert (bad["name"], bad["finding"], bad["severity"], bad["module_class"]) == (
        "norm.weight",
        "sign_flip",
        "scramble",
        "LayerNorm",
    )


def test_hf_model_loads_cleanly_and_tied_weights(hf_dir, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir)
    result = ffdebug.load_audit(model, hf_dir)
    assert result, result.to_json()
    assert result.loaded == len(model.state_dict())

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    tied = LlamaForCausalLM(cfg)
    state = {k: v for k, v in tied.state_dict().items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "tied.safetensors")
    res = ffdebug.load_audit(tied, tmp_path / "tied.safetensors")
    assert res, res.to_json()
    assert res.tied == [{"name": "lm_head.weight", "tied_to": "model.embed_tokens.weight"}]


def test_audit_with_prefix_mapping(hf_dir, hf_state, tmp_path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir)
    save_file({"module." + k: v for k, v in hf_state.items()}, tmp_path / "ddp.safetensors")
    res = ffdebug.load_audit(
        model, tmp_path / "ddp.safetensors", match_content="off"
    )  # the name path (content matching would pair them: test_content_matching.py)
    assert not res and res.renames[0]["apply"] == "--strip-prefix module."
    assert ffdebug.load_audit(model, tmp_path / "ddp.safetensors", strip_prefix="module.")
