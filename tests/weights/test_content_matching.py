"""Content matching: a from-scratch port (own names, fused qkv / gate-up, stacked experts) against
the Hugging Face checkpoint it loads, with no map (docs/weights-diff.md, "Content matching")."""

from __future__ import annotations

import pytest
import torch
from helpers.weights.ports import ENTRY, build, load_hf, tiny_qwen3_moe
from helpers.weights.weights_utils import run_cli, run_json
from safetensors.torch import load_file

import ffdebug


@pytest.fixture(scope="module")
def llama(hf_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(hf_dir), load_file(str(hf_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3moe") / "ckpt"
    model = tiny_qwen3_moe()
    model.save_pretrained(path)
    return model.config, load_file(str(path / "model.safetensors")), path


def _problems(res):
    return {t.name: t for t in res.tensors if t.finding != "equal"}


def test_correct_port_equals_checkpoint_without_a_map(hf_dir, llama):
    cfg, sd = llama
    port = load_hf(build(cfg), sd)
    res = ffdebug.weights_diff(hf_dir, port)
    assert res, res.to_json()
    # every checkpoint tensor compared once, every port tensor used
    assert sorted(t.name for t in res.tensors) == sorted(sd)
    assert not res.only_ref and not res.only_target and not res.content["unmatched_target"]
    assert {t.finding for t in res.tensors} == {"equal"}
    used = {t.origin["target"].split("[")[0] for t in res.tensors}
    assert used == set(port.state_dict())
    wqkv = next(r for r in res.content["relations"] if r["tensor"] == "blocks.1.attn.wqkv.weight")
    # the order is the one the values have (q, k, v), not the alphabetical one
    assert [p["name"].split(".")[-2] for p in wqkv["parts"]] == ["q_proj", "k_proj", "v_proj"]
    assert [p["at"] for p in wqkv["parts"]] == ["[0:32]", "[32:48]", "[48:64]"]


def test_swapped_fused_part_and_unloaded_tensor_are_named(hf_dir, llama):
    cfg, sd = llama
    port = load_hf(build(cfg), sd, swap_qk_layer=1, skip=("blocks.0.ff.w2.weight",))
    res = ffdebug.weights_diff(hf_dir, port, init=build(cfg))
    assert not res and res.schema_clean
    probs = _problems(res)
    assert set(probs) == {
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
    }
    q = probs["model.layers.1.self_attn.q_proj.weight"]
    assert (
        q.finding == "swapped" and q.layout["found_at"] == "[16:48]" and q.layout["compared_at"] == "[0:32]"
    )
    assert probs["model.layers.1.self_attn.k_proj.weight"].finding == "swapped"
    down = probs["model.layers.0.mlp.down_proj.weight"]
    assert down.finding == "not_loaded" and down.origin["target"] == "blocks.0.ff.w2.weight"
    # without the port's init the tensor is still paired (by the learned rule) and compared
    bare = _problems(ffdebug.weights_diff(hf_dir, port))
    assert bare["model.layers.0.mlp.down_proj.weight"].finding == "mismatch"
    assert any("uncorrelated" in n for n in bare["model.layers.0.mlp.down_proj.weight"].notes)


def test_permuted_expert_stack_is_named(moe):
    cfg, sd, path = moe
    assert ffdebug.weights_diff(path, load_hf(build(cfg, moe=True), sd))
    perm = [2, 0, 1, 3]
    res = ffdebug.weights_diff(path, load_hf(build(cfg, moe=True), sd, permute_experts=(1, perm)))
    probs = _problems(res)
    assert res.schema_clean and {t.finding for t in probs.values()} == {"permuted"}
    # slot s holds expert perm[s]: experts 0, 1, 2 moved, 3 stayed; both stacked tensors
    moved = {n.split(".")[5] for n in probs}
    assert moved == {"0", "1", "2"} and all(".layers.1." in n for n in probs)
    e0 = probs["model.layers.1.mlp.experts.0.up_proj.weight"]
    assert e0.layout == {**e0.layout, "tensor": "blocks.1.moe.w_gate_up", "found_at": "[1, 16:32]"}
    assert len([n for n in probs if n.endswith("down_proj.weight")]) == 3


def test_load_audit_on_the_port_names_only_the_unloaded_tensor(hf_dir, tmp_path, monkeypatch):
    (tmp_path / "port_entry.py").write_text(
        ENTRY.replace("CKPT", repr(str(hf_dir))).replace("SKIP", "('blocks.1.attn.wqkv.weight',)")
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    code, out = run_json("load-audit", "port_entry:load", str(hf_dir))
    assert code == 1
    assert not out["never_loaded"] and not out["not_covered"] and not out["value_mismatch"]
    # the fused tensor left unloaded is named once per checkpoint tensor it should hold
    assert sorted(n["origin"]["target"] for n in out["not_loaded"]) == [
        f"model.layers.1.self_attn.{p}_proj.weight" for p in "kqv"
    ]
    assert {n["origin"]["ref"].split("[")[0] for n in out["not_loaded"]} == {"blocks.1.attn.wqkv.weight"}
    assert out["loaded"] == 18  # the other fused / renamed tensors were loaded, not "left at init"
    text = " ".join(run_cli("load-audit", "port_entry:load", str(hf_dir)).stdout.split())
    assert "not loaded: blocks.1.attn.wqkv.weight[0:32]" in text and "FAILED" in text


def test_transposed_and_scaled_is_scaled(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32))
    gpt2.save_pretrained(tmp_path / "gpt2")
    sd = load_file(str(tmp_path / "gpt2" / "model.safetensors"))
    conv1d = [k for k in sd if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))]
    port = {k: (sd[k].t().contiguous() if k in conv1d else sd[k]) for k in sd}  # Linear layout
    port["transformer.h.1.mlp.c_fc.weight"] = port["transformer.h.1.mlp.c_fc.weight"] * 0.5
    res = ffdebug.weights_diff(tmp_path / "gpt2", port)
    by = {t.name: t for t in res.tensors}
    assert len(res.tensors) == len(sd)  # nothing left out of the numerics
    t = by["transformer.h.1.mlp.c_fc.weight"]
    assert t.finding == "scaled" and t.scale_factor == pytest.approx(0.5) and t.after_transpose
    assert {by[k].finding for k in conv1d if k != t.name} == {"transposed"}
    # with the transform the schema is satisfied and only the scale remains
    fixed = ffdebug.weights_diff(tmp_path / "gpt2", port, transforms=["*.c_*.weight=transpose"])
    assert not fixed.shape_mismatch
    assert {x.name: x.finding for x in fixed.problems()} == {t.name: "scaled"}
    # renamed (a port's own names): content relates the transposed copies and the scaled one
    renamed = {k.replace("transformer.h.", "layers.").replace(".mlp.", ".ffn."): v for k, v in port.items()}
    res = ffdebug.weights_diff(tmp_path / "gpt2", renamed)
    assert {x.name: x.finding for x in res.problems()} == {t.name: "scaled"}
    assert not res.only_ref and not res.only_target


def test_unused_map_rule_warns(hf_dir, tmp_path):
    alias = tmp_path / "aliases.txt"
    alias.write_text("^nothing\\.here\\.=model.\n")
    code, out = run_json("weights-diff", hf_dir, hf_dir, "--alias-file", alias, "--map", "^model\\.=model.")
    assert code == 0
    assert out["warnings"] == [
        "--map / alias rule '^nothing\\\\.here\\\\.=model.' matched no target name (it rewrites target names)"
    ]


# --- gathered rows: parts that are not contiguous blocks (weights.gather, weights.rows) ---------

_H, _D = 4, 8  # the heads and head size of `_mha_llama`


@pytest.fixture(scope="module")
def mha():
    """A tiny HF Llama with as many kv heads as heads and a qkv bias (q, k, v of one shape)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=_H,
        num_key_value_heads=_H,
        head_dim=_D,
        vocab_size=128,
        attention_bias=True,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()  # HF starts biases at zero: every row would be the same
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _per_head(x):
    return x.view(_H, _D, *x.shape[1:])


def _halves_to_pairs(w):
    """A q / k weight (or bias) in the rotary layout of interleaved pairs, from HF's halves."""
    return w.view(_H, 2, _D // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _engine_checkpoint(sd, layout: str, swap_layer: int | None = None) -> dict:
    """The port's own names; each layer's q / k / v fused (weight and bias) as `layout` says:
    `heads` interleaved per head `[q_0, k_0, v_0, q_1, …]`, `rotary` `[q | k | v]` with q and k in
    interleaved-pair rotary order; in `swap_layer` the converter put k where q goes."""
    out = {}
    for name, x in sd.items():
        if not any(f".{p}_proj." in name for p in "qkv"):
            out[name.replace("model.layers.", "blk.").replace("self_attn.o_proj", "attn.wo")] = x
    for i in range(3):
        for kind in ("weight", "bias"):
            q, k, v = (sd[f"model.layers.{i}.self_attn.{p}_proj.{kind}"] for p in "qkv")
            if i == swap_layer:
                q, k = k, q
            if layout == "heads":
                fused = torch.stack([_per_head(q), _per_head(k), _per_head(v)], 1).reshape(
                    3 * _H * _D, *q.shape[1:]
                )
            else:
                fused = torch.cat([_halves_to_pairs(q), _halves_to_pairs(k), v])
            out[f"blk.{i}.attn.wqkv.{kind}"] = fused
    return out


@pytest.mark.parametrize("layout", ["heads", "rotary"])
def test_gathered_qkv_relates_without_a_map_and_a_swapped_layer_is_named(mha, layout):
    """Per-head interleaved and rotary-permuted fused q / k / v (weights and biases) relate row by
    row to HF's three tensors; the rule says which rows; a layer whose converter swapped q and k is
    compared at the port's convention and named."""
    res = ffdebug.weights_diff(mha, _engine_checkpoint(mha, layout))
    assert res and not res.content["unmatched_ref"] and not res.content["unmatched_target"], res.to_json()
    assert sorted(t.name for t in res.tensors) == sorted(mha)
    rule = next(r for r in res.content["rules"] if r.startswith("target blk.#.attn.wqkv.weight"))
    if layout == "heads":  # q's rows 0:8 of every 24 (one head's q, k, v), four heads
        assert "q_proj.weight[rows 0:8 +24k (k<4)]" in rule and "v_proj.weight[rows 16:24 +24k (k<4)]" in rule
    else:  # HF's halves [x0..x3 | x4..x7] of a head stored as pairs (x0, x4), (x1, x5), ...
        assert "q_proj.weight[rows 0:7:2, 1:8:2 +8k (k<4)]" in rule
        assert "rotary halves stored as interleaved pairs, per head of 8 rows" in rule
    bad = ffdebug.weights_diff(mha, _engine_checkpoint(mha, layout, swap_layer=1))
    probs = _problems(bad)
    assert not bad and set(probs) == {
        f"model.layers.1.self_attn.{p}_proj.{kind}" for p in "qk" for kind in ("weight", "bias")
    }
    q = probs["model.layers.1.self_attn.q_proj.weight"]
    assert q.finding == "swapped" and q.layout["tensor"] == "blk.1.attn.wqkv.weight"
    k_rows = {"heads": "[rows 8:16 +24k (k<4)]", "rotary": "[rows 32:39:2, 33:40:2 +8k (k<4)]"}[layout]
    assert q.layout["found_at"] == k_rows


def test_rows_reordered_under_the_same_name_are_named_permuted(mha):
    """A converter that wrote q / k in the other rotary layout under HF's own names: each such
    tensor is `permuted`, with the rows and the rotary re-ordering named; the rest equal."""
    sd = {k: (_halves_to_pairs(v) if ".q_proj." in k or ".k_proj." in k else v) for k, v in mha.items()}
    res = ffdebug.weights_diff(mha, sd)
    probs = _problems(res)
    assert not res and set(probs) == {k for k in mha if ".q_proj." in k or ".k_proj." in k}
    w = probs["model.layers.2.self_attn.k_proj.weight"]
    assert w.finding == "permuted" and w.layout["rows"] == "0:7:2, 1:8:2 +8k (k<4)"
    assert w.layout["rotary"] == "rotary halves stored as interleaved pairs, per head of 8 rows"
    assert {t.finding for t in res.tensors if t.name not in probs} == {"equal"}
