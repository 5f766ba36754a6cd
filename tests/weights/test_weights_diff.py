"""weights-diff: every input kind, schema + rename suggestions, per-tensor findings (issue 3)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.weights.weights_utils import run_cli, run_json
from safetensors.torch import save_file

import ffdebug
from ffdebug.weights.diff import STABLE_KEYS

TENSOR_KEYS = {
    "name",
    "severity",
    "finding",
    "byte_equal",
    "cos",
    "rel",
    "max_abs",
    "shape_ref",
    "shape_target",
    "dtype_ref",
    "dtype_target",
}


# --- must show: save_pretrained vs itself reloaded ---------------------------------------------


def test_hf_saved_vs_reloaded_matches(hf_dir, tmp_path):
    from transformers import LlamaForCausalLM

    LlamaForCausalLM.from_pretrained(hf_dir).save_pretrained(tmp_path / "reloaded")
    result = ffdebug.weights_diff(hf_dir, tmp_path / "reloaded")
    assert result, result.to_json()
    assert result.verdict == "ok"
    assert all(t.finding == "equal" and t.byte_equal for t in result.tensors)
    assert len(result.tensors) == result.ref["tensors"] > 10

    code, out = run_json("weights-diff", hf_dir, tmp_path / "reloaded")
    assert code == 0 and out["verdict"] == "ok" and out["passed"]
    assert set(STABLE_KEYS) <= set(out)
    assert set(out["tensors"][0]) >= TENSOR_KEYS


def test_text_output_schema_first_then_conclusion(hf_dir, tmp_path):
    r = run_cli("weights-diff", hf_dir, hf_dir / "model.safetensors")
    assert r.exit_code == 0, r.stdout
    assert r.stdout.lstrip().startswith("Schema")
    assert r.stdout.strip().endswith("PASSED")


# --- must show: model. prefix stripped --------------------------------------------------------


def test_stripped_prefix_suggests_mapping_and_rerun_matches(hf_dir, hf_state, tmp_path):
    stripped = {k.removeprefix("model."): v for k, v in hf_state.items()}
    save_file(stripped, tmp_path / "stripped.safetensors")

    off = (
        "--match-content",
        "off",
    )  # the name path (content matching would pair them: test_content_matching.py)
    code, out = run_json("weights-diff", hf_dir, tmp_path / "stripped.safetensors", *off)
    assert code == 1
    n = sum(1 for k in hf_state if k.startswith("model."))
    assert len(out["only_ref"]) == n and all(k.startswith("model.") for k in out["only_ref"])
    assert len(out["only_target"]) == n
    assert "lm_head.weight" not in out["only_ref"]  # it had no prefix: it still pairs
    (rename,) = out["renames"]
    assert rename["apply"] == "--strip-prefix model."
    assert rename["matches"] == n and rename["to"] == "model.*"
    assert out["apply"] == "--strip-prefix model."

    text = run_cli("weights-diff", hf_dir, tmp_path / "stripped.safetensors", *off).stdout
    assert "only in ref" in text and "--strip-prefix model." in text and "FAILED" in text
    # The schema is printed before any number.
    assert text.index("suggestion") < text.index("compared tensors")

    code, out = run_json(
        "weights-diff", hf_dir, tmp_path / "stripped.safetensors", "--strip-prefix", "model."
    )
    assert code == 0 and out["verdict"] == "ok" and not out["only_ref"] and not out["only_target"]


def test_layers_h_rename_and_map_option(hf_state, tmp_path):
    ref = {k: v for k, v in hf_state.items() if ".layers." in k}
    renamed = {
        k.replace("model.layers.", "transformer.h.").replace(".self_attn.", ".attn."): v
        for k, v in ref.items()
    }
    result = ffdebug.weights_diff(
        ref, renamed, match_content="off"
    )  # the name path (content matching would pair them: test_content_matching.py)
    applies = [r["apply"] for r in result.renames]
    assert any("transformer" in a and "{L}" in a and "self_attn" in a for a in applies), applies
    assert any(a.startswith("--map '^transformer\\.h\\.") for a in applies)
    # Applying every suggestion makes the sides match.
    maps = [a.split(" ", 1)[1].strip("'") for a in applies]
    assert ffdebug.weights_diff(ref, renamed, maps=maps)


def test_fused_qkv_suggested_by_shape_and_fuse_option(hf_state):
    ref = {k: v for k, v in hf_state.items() if ".layers." in k}
    fused = {}
    for k, v in ref.items():
        if ".q_proj." in k:
            parts = [ref[k.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            fused[k.replace("q_proj", "qkv_proj")] = torch.cat(parts, 0)
        elif ".k_proj." not in k and ".v_proj." not in k:
            fused[k] = v
    result = ffdebug.weights_diff(
        ref, fused, match_content="off"
    )  # the name path (content matching would pair them: test_content_matching.py)
    assert not result
    (sug,) = result.renames
    assert sug["kind"] == "fused" and sug["apply"] == "--fuse qkv_proj=q_proj+k_proj+v_proj"
    assert sug["from"] == "model.layers.0.self_attn.qkv_proj.weight"
    assert sug["to"] == [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert sug["matches"] == 2

    ok = ffdebug.weights_diff(ref, fused, fuse=["qkv_proj=q_proj+k_proj+v_proj"])
    assert ok, ok.to_json()
    assert "model.layers.1.self_attn.v_proj.weight" in {t.name for t in ok.tensors}
    # Reverse direction: the reference is fused, the target split.
    assert ffdebug.weights_diff(fused, ref, fuse=["qkv_proj=q_proj+k_proj+v_proj"])


def test_alias_file(hf_state, tmp_path):
    renamed = {k.replace("model.layers.", "blocks."): v for k, v in hf_state.items()}
    alias = tmp_path / "aliases.yaml"
    alias.write_text('aliases:\n  "^blocks\\\\.{L}\\\\.": "model.layers.{L}."\n')
    assert ffdebug.weights_diff(hf_state, renamed, alias_file=str(alias))
    txt = tmp_path / "aliases.txt"
    txt.write_text("# engine names\n^blocks\\.=model.layers.\n")
    assert ffdebug.weights_diff(hf_state, renamed, alias_file=str(txt))


# --- must show: transposed / sign flip / bf16 ---------------------------------------------------


def test_findings_transposed_sign_flip_bf16(hf_dir, hf_state, tmp_path):
    bad = dict(hf_state)
    q = "model.layers.0.self_attn.q_proj.weight"  # square [32, 32]
    norm = "model.layers.1.input_layernorm.weight"
    up = "model.layers.0.mlp.up_proj.weight"
    down = "model.layers.1.mlp.down_proj.weight"
    bad[q] = hf_state[q].t().contiguous()
    bad[norm] = -hf_state[norm]
    bad[up] = hf_state[up].to(torch.bfloat16)
    bad[down] = hf_state[down] * 1.5
    save_file(bad, tmp_path / "bad.safetensors")

    code, out = run_json("weights-diff", hf_dir, tmp_path / "bad.safetensors")
    assert code == 1
    by = {t["name"]: t for t in out["tensors"]}
    assert (by[q]["finding"], by[q]["severity"]) == ("transposed", "scramble")
    assert by[q]["after_transpose"]["cos"] == pytest.approx(1.0)
    assert (by[norm]["finding"], by[norm]["severity"]) == ("sign_flip", "scramble")
    assert by[norm]["cos"] == pytest.approx(-1.0)
    assert (by[up]["finding"], by[up]["severity"]) == ("dtype_only", "ok")
    assert by[up]["dtype_target"] == "bfloat16" and not by[up]["byte_equal"]
    assert (by[down]["finding"], by[down]["severity"]) == ("scaled", "bug")
    assert by[down]["scale_factor"] == pytest.approx(1.5)
    assert out["dtype_mismatch"] == [{"name": up, "dtype_ref": "float32", "dtype_target": "bfloat16"}]
    assert out["verdict"] == "scramble"
    others = [t for n, t in by.items() if n not in (q, norm, up, down)]
    assert others and all(t["finding"] == "equal" for t in others)


def test_rounding_and_allow_dtype(hf_state):
    ref = {k: v for k, v in hf_state.items() if "mlp" in k}
    # Truncation instead of round-to-nearest: not the cast, but within one bf16 ulp.
    tgt = {k: (v.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16) for k, v in ref.items()}
    result = ffdebug.weights_diff(ref, tgt)
    assert {t.finding for t in result.tensors} == {"rounding"}
    assert {t.severity for t in result.tensors} == {"ok"}
    assert not result  # dtype differences are schema differences ...
    assert ffdebug.weights_diff(ref, tgt, allow_dtype=True)  # ... unless allowed


def test_transform_transpose_and_user_function(hf_state, tmp_path, monkeypatch):
    ref = {k: v for k, v in hf_state.items() if "self_attn" in k}
    tgt = {k: v.t().contiguous() if "o_proj" in k else -v if "k_proj" in k else v for k, v in ref.items()}
    assert not ffdebug.weights_diff(ref, tgt)
    (tmp_path / "engine_layout.py").write_text("def unflip(t, name):\n    return -t\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    res = ffdebug.weights_diff(
        ref, tgt, transforms=["*.o_proj.weight=transpose", "target:*.k_proj.weight=engine_layout:unflip"]
    )
    assert res, res.to_json()
    assert all(t.finding == "equal" for t in res.tensors)


def test_skip_and_layers(hf_state):
    tgt = dict(hf_state)
    tgt["model.layers.1.mlp.up_proj.weight"] = torch.zeros_like(tgt["model.layers.1.mlp.up_proj.weight"])
    assert not ffdebug.weights_diff(hf_state, tgt)
    assert ffdebug.weights_diff(hf_state, tgt, skip=["*.mlp.*"])
    only0 = ffdebug.weights_diff(hf_state, tgt, layers="0")
    assert only0
    names = {t.name for t in only0.tensors}
    assert "model.embed_tokens.weight" in names and not any(".layers.1." in n for n in names)
    assert not ffdebug.weights_diff(hf_state, tgt, layers="-1")


# --- every input kind ---------------------------------------------------------------------------


def test_sharded_index_pt_and_bin(hf_dir, hf_state, tmp_path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(hf_dir)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert ffdebug.weights_diff(hf_dir, tmp_path / "sharded")
    assert ffdebug.weights_diff(hf_dir, tmp_path / "sharded" / "model.safetensors.index.json")
    torch.save(hf_state, tmp_path / "sd.pt")
    torch.save({"state_dict": hf_state}, tmp_path / "wrapped.bin")
    assert ffdebug.weights_diff(tmp_path / "sd.pt", tmp_path / "wrapped.bin")
    res = ffdebug.weights_diff(hf_dir, tmp_path / "sd.pt")
    assert res and res.target["kind"] == "pt"


def test_diffusers_component_and_pipeline_root(tmp_path):
    from diffusers import SD3Transformer2DModel

    from reference_trainer.adapters.sd3 import SD3_TINY

    torch.manual_seed(0)
    model = SD3Transformer2DModel(**SD3_TINY)
    model.save_pretrained(tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text(
        json.dumps({"_class_name": "StableDiffusion3Pipeline"})
    )
    res = ffdebug.weights_diff(tmp_path / "pipe" / "transformer", model)
    assert res and res.ref["kind"] == "diffusers"
    r = run_cli("weights-diff", tmp_path / "pipe", tmp_path / "pipe" / "transformer")
    assert r.exit_code == 2
    assert "pass one component folder" in r.stderr and "transformer" in r.stderr
    r = run_cli("inspect", tmp_path / "pipe" / "transformer", "--json")
    assert r.exit_code == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["kind"] == "diffusers" and info["records"] == len(model.state_dict())


def test_inspect_hf_folder_and_index(hf_dir, tmp_path):
    r = run_cli("inspect", hf_dir, "--json")
    assert r.exit_code == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["kind"] == "hf-folder"
    row = next(t for t in info["tensors"] if t["key"] == "model.norm.weight")
    assert row["stats"]["mean"] == pytest.approx(1.0) and row["shape"] == [32]


@pytest.mark.integration
def test_weight_dump_and_entry(hf_dir, tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    from ffdebug.capture.weights import dump_weights

    model = LlamaForCausalLM.from_pretrained(hf_dir)
    side = dump_weights(model, str(tmp_path / "dump"))
    res = ffdebug.weights_diff(hf_dir, side)
    # Dumps hold every buffer, checkpoints only persistent ones: the rotary tables are listed apart.
    assert res and res.target["kind"] == "weight-dump" and res.target["world_size"] == 1
    assert not res.only_target and res.buffers_not_in_checkpoint == [
        {"name": "model.rotary_emb.inv_freq", "side": "target"},
        {"name": "model.rotary_emb.original_inv_freq", "side": "target"},
    ]
    assert all(t.finding == "equal" for t in res.tensors)
    assert ffdebug.weights_diff(hf_dir, side, skip=["*rotary_emb*"])
    # A module's state_dict() has no non-persistent buffers either; two dumps compare them.
    assert ffdebug.weights_diff(side, model).buffers_not_in_checkpoint
    assert not ffdebug.weights_diff(side, side).buffers_not_in_checkpoint
    assert ffdebug.weights_diff(hf_dir, tmp_path / "dump", skip=["*rotary_emb*"])  # DIR holding weights/

    (tmp_path / "loader_mod.py").write_text(
        "from transformers import LlamaForCausalLM\n"
        f"def build():\n    return LlamaForCausalLM.from_pretrained({str(hf_dir)!r})\n"
        "def state():\n    return build().state_dict()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert ffdebug.weights_diff(hf_dir, "loader_mod:build")
    code, out = run_json("weights-diff", hf_dir, "loader_mod:state")
    assert code == 0 and out["target"]["kind"] == "entry"
    code, out = run_json("weights-diff", hf_dir, f"{tmp_path / 'loader_mod.py'}:build")
    assert code == 0


def test_streaming_reader_maps_each_read_and_keeps_nothing_open(hf_dir):
    """Each read maps its own tensor (a private mapping the array holds: its pages, and the
    descriptor Python's `mmap` keeps, go with the array); nothing stays open once the arrays are
    gone, and nothing is cached on the file or the record."""
    import mmap
    import os

    import numpy as np

    from ffdebug.io import safetensors
    from ffdebug.io.checkpoints import safetensors_records

    def open_fds() -> set[str]:
        return set(os.listdir("/proc/self/fd"))

    def owner(x):  # the object holding the array's memory (np.frombuffer keeps a memoryview of it)
        while isinstance(x, np.ndarray):
            x = x.base
        return x.obj if isinstance(x, memoryview) else x

    before = open_fds()
    f = safetensors.SafetensorsFile(str(hf_dir / "model.safetensors"))
    entries = safetensors_records(f)
    first, again = entries[0].load(), entries[0].load()
    assert isinstance(owner(first), mmap.mmap) and isinstance(owner(again), mmap.mmap)
    assert owner(first) is not owner(again)  # one mapping per read, none shared or cached
    assert np.array_equal(first, again)
    want = entries[0].source.file.meta[entries[0].key]
    assert (first.shape, str(first.dtype)) == want
    first.reshape(-1)[0] = 1e30  # a private mapping: never written back, never seen by another read
    assert np.array_equal(entries[0].load(), again)
    del first, again
    assert open_fds() == before  # the header read closed its descriptor; the mappings went with the arrays


def test_h_n_suggestion_add_prefix_and_schema_only(hf_state, tmp_path):
    layers = {k: v for k, v in hf_state.items() if ".layers." in k}
    h = {k.replace("model.layers.", "h."): v for k, v in layers.items()}
    res = ffdebug.weights_diff(layers, h, schema_only=True, match_content="off")
    assert res.schema_only and not res.tensors and not res
    assert [r["apply"] for r in res.renames] == ["--map '^h\\.=model.layers.'"]
    save_file(h, tmp_path / "h.safetensors")
    save_file(layers, tmp_path / "ref.safetensors")
    code, out = run_json(
        "weights-diff",
        tmp_path / "ref.safetensors",
        tmp_path / "h.safetensors",
        "--map",
        "^h\\.=model.layers.",
    )
    assert code == 0 and len(out["tensors"]) == len(layers)
    bare = {k.removeprefix("model."): v for k, v in layers.items()}
    assert ffdebug.weights_diff(layers, bare, add_prefix="model.")
    r = run_cli(
        "weights-diff",
        tmp_path / "ref.safetensors",
        tmp_path / "h.safetensors",
        "--schema-only",
        "--match-content",
        "off",
    )
    assert r.exit_code == 1 and "--map" in r.stdout and "Numerics not run" in r.stdout


def test_value_equal_other_bits():
    ref = {"ids": torch.arange(6), "z": torch.zeros(4)}
    tgt = {"ids": torch.arange(6, dtype=torch.int32), "z": -torch.zeros(4)}
    res = ffdebug.weights_diff(ref, tgt, allow_dtype=True)
    assert res, res.to_json()
    by = {t.name: t for t in res.tensors}
    assert by["ids"].finding == "dtype_only" and by["z"].finding == "equal" and not by["z"].byte_equal


# --- same dtype: any change beyond one ulp is the loader's ------------------------------------------


def test_same_dtype_rows_left_at_init_are_a_bug_however_small(tmp_path):
    """Three added-token rows of a 4000-row embedding not loaded: rel 3.5% (the `drift` band), but
    both sides are fp32 and the other rows are bit-equal, so the loader changed them: a bug."""
    torch.manual_seed(0)
    emb = torch.randn(4000, 32) * 0.02
    bad = emb.clone()
    bad[-3:] = torch.randn(3, 32) * 0.02
    save_file({"embed.weight": emb}, tmp_path / "ref.safetensors")
    save_file({"embed.weight": bad}, tmp_path / "tgt.safetensors")
    code, out = run_json("weights-diff", tmp_path / "ref.safetensors", tmp_path / "tgt.safetensors")
    (t,) = out["tensors"]
    assert 0.01 < t["rel"] < 0.1  # the bands alone would say drift and pass
    assert (t["finding"], t["severity"], code) == ("mismatch", "bug", 1)
    assert t["max_abs_at"][0] >= 3997  # the coordinate points at the unloaded rows


def test_same_dtype_bf16_round_trip_is_rounding_drift():
    torch.manual_seed(0)
    w = torch.randn(64, 64)
    res = ffdebug.weights_diff({"w": w}, {"w": w.to(torch.bfloat16).float()})
    (t,) = res.tensors
    assert (t.finding, t.severity) == ("rounding", "drift")
    assert any("bfloat16" in n for n in t.notes)
    assert res and res.failed("drift")  # passes the default --fail-on diverge, not --fail-on drift
    one_ulp = ffdebug.weights_diff({"w": w}, {"w": w.nextafter(torch.tensor(float("inf")))})
    assert (one_ulp.tensors[0].finding, one_ulp.tensors[0].severity) == ("rounding", "ok")


def test_hand_quantised_deepseek_fp8_blocks_match_at_e4m3_precision():
    """DeepSeek-V3 layout, quantised here without ffdebug: 128x128 blocks, `weight_scale_inv`
    (dequant = q * scale_inv per block), e4m3 (3 mantissa bits: |error| <= 2^-4 |w| + subnormals)."""
    torch.manual_seed(0)
    w = torch.randn(256, 384) * 0.02
    blocks = w.reshape(2, 128, 3, 128)
    scale_inv = blocks.abs().amax(dim=(1, 3)) / 448.0
    q = (blocks / scale_inv[:, None, :, None]).reshape(256, 384).to(torch.float8_e4m3fn)
    deq = (q.float().reshape(2, 128, 3, 128) * scale_inv[:, None, :, None]).reshape(256, 384)
    res = ffdebug.weights_diff(
        {"l.weight": w}, {"l.weight": q, "l.weight_scale_inv": scale_inv}, allow_dtype=True
    )
    assert res, res.to_json()
    (t,) = res.tensors
    assert (t.finding, t.dtype_target) == ("rounding", "float8_e4m3fn")
    assert t.severity == "drift"  # e4m3: rel in [2^-5, 2^-4]/sqrt(3) (test_weights_tp_quant), 1% < rel
    assert t.max_abs == pytest.approx(float((deq.double() - w.double()).abs().max()), rel=1e-6)
    assert t.rel == pytest.approx(float((deq.double() - w.double()).norm() / w.double().norm()), rel=1e-6)
    assert t.rel < 2.0**-4


@pytest.mark.integration
def test_layer_selected_dump_restricts_the_other_side(hf_dir, tmp_path, monkeypatch):
    """`FFDEBUG_WEIGHT_DUMP_LAYERS=1` (playbook phase 1): the checkpoint's other layers cannot be in
    the dump, so they are left out (and said so); a buffer-only difference does not fail."""
    from transformers import LlamaForCausalLM

    from ffdebug import maybe_dump_weights_and_exit

    model = LlamaForCausalLM.from_pretrained(hf_dir)
    monkeypatch.setenv("FFDEBUG_WEIGHT_DUMP_DIR", str(tmp_path / "wd"))
    monkeypatch.setenv("FFDEBUG_WEIGHT_DUMP_LAYERS", "-1")  # the last of 2 layers
    monkeypatch.setenv("FFDEBUG_WEIGHT_DUMP_EXIT", "0")
    side = maybe_dump_weights_and_exit(model)
    r = run_cli("weights-diff", side, hf_dir)
    assert r.exit_code == 0, r.stdout
    text = " ".join(r.stdout.split())
    assert (
        "target restricted to layers 1: the reference is a weight dump of FFDEBUG_WEIGHT_DUMP_LAYERS=-1"
        in text
    )
    assert "(9 tensor(s) of other layers left out)" in text
    assert "buffers not in checkpoints (2, dump only, not compared): model.rotary_emb.inv_freq" in text
    assert text.index("restricted") < text.index("byte-equal") and text.endswith("PASSED")
    code, out = run_json("weights-diff", hf_dir, side)  # either side may be the dump
    assert code == 0 and out["restricted"] == [
        {"side": "reference", "layers": [1], "left_out": 9, "because": "-1"}
    ]
    assert {t.get("layer") for t in out["tensors"]} == {None, 1}

    # A layer the dump should hold but does not is still reported.
    import shutil

    shutil.copytree(side, tmp_path / "partial")
    manifest = tmp_path / "partial" / "rank000" / "manifest.jsonl"
    lines = manifest.read_text().splitlines()
    manifest.write_text("\n".join(x for x in lines if "layers.1.mlp.up_proj" not in x) + "\n")
    res = ffdebug.weights_diff(tmp_path / "partial", hf_dir)
    assert not res and res.only_target == ["model.layers.1.mlp.up_proj.weight"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.float8_e4m3fn])
def test_abs_max_exact_and_nonfinite(dtype):
    """max |x| of (−3, 0.5, 2) is 3 in every dtype (all three are exact in fp8 e4m3 too), through
    `aminmax` or the float64 chunks; an Inf or NaN anywhere makes it non-finite; empty is 0."""
    import math

    from ffdebug.weights.numerics import abs_max, within_rounding

    x = torch.tensor([-3.0, 0.5, 2.0]).to(dtype)
    assert abs_max(x) == 3.0
    assert abs_max(x[:0]) == 0.0
    if dtype != torch.float8_e4m3fn:  # e4m3fn has no Inf
        assert not math.isfinite(abs_max(torch.tensor([1.0, float("inf")]).to(dtype)))
    assert not math.isfinite(abs_max(torch.tensor([1.0, float("nan"), -5.0]).to(dtype)))
    # the absmax a caller passes sets the floor: |2.0 - 2.001| = 1e-3 <= 1e-6·2 + 1e-6·2⁻⁸·max|r|
    # only when max|r| >= (1e-3 - 2e-6)·2⁸ / 1e-6 ≈ 255,488
    r, t = torch.tensor([2.0], dtype=torch.float64), torch.tensor([2.001], dtype=torch.float64)
    assert not within_rounding(r, t, 1e-6)
    assert within_rounding(r, t, 1e-6, absmax=3e5) and not within_rounding(r, t, 1e-6, absmax=2e5)


def test_a_free_bound_of_max_ref_settles_a_failing_pair_without_measuring_it():
    """`bound` (‖r‖₂ from the metrics, never below max|r|) gives the loosest floor: a pair that
    fails even with it fails without max|r| being measured; a pair that passes with it is still
    checked against the floor of the true max|r| (measured once, by the function given)."""
    import numpy as np

    from ffdebug.weights.numerics import within_rounding

    def never():
        raise AssertionError("max|r| measured although the bound settled the pair")

    r = np.array([2.0, -1.0, 0.5], dtype=np.float64)
    bound = float(np.linalg.norm(r))  # 2.29 >= max|r| = 2
    far = r + np.array([1e-3, 0.0, 0.0])
    assert not within_rounding(r, far, 1e-6, never, bound)
    # |Δ| = 2e-6 + 1e-6·2⁻⁸·2.1: within the bound's floor (2e-6 + 8.9e-9), beyond the true one (7.8e-9)
    near = r + np.array([2e-6 + 1e-6 * 2.0**-8 * 2.1, 0.0, 0.0])
    calls = []

    def measured():
        calls.append(1)
        return 2.0

    assert not within_rounding(r, near, 1e-6, measured, bound) and calls == [1]
    assert within_rounding(r, r * (1 + 2.0**-30), 1e-6, measured, bound) and calls == [1, 1]
