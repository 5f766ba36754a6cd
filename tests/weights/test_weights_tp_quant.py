"""weights-diff: tensor-parallel shards merged back, fp8 dequantisation (issue 3)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.weights.tp_dumps import ROW, tp_split, write_dump
from helpers.weights.weights_utils import run_json
from safetensors.torch import save_file

import ffdebug
from ffdebug.weights import quant

# --- must show: TP=2 row and column shards merge back and match -----------------------------------


@pytest.mark.integration
def test_tp2_weight_dump_merges_back(hf_dir, hf_state, tmp_path):
    write_dump(tmp_path / "weights", tp_split(hf_state))
    code, out = run_json("weights-diff", hf_dir, tmp_path / "weights")
    assert code == 0, out
    assert out["target"]["world_size"] == 2
    by = {t["name"]: t for t in out["tensors"]}
    assert len(by) == len(hf_state) and all(t["finding"] == "equal" for t in by.values())
    assert by["model.layers.0.self_attn.q_proj.weight"]["tp"] == {
        "ref": "single",
        "target": "concat",
        "dim": 0,
    }
    assert by["model.layers.0.mlp.down_proj.weight"]["tp"]["dim"] == 1
    assert by["model.norm.weight"]["tp"]["target"] == "replicated"


@pytest.mark.integration
def test_tp2_manifest_shard_metadata_and_rank_files(hf_dir, hf_state, tmp_path):
    shards = tp_split(hf_state)
    write_dump(tmp_path / "meta" / "weights", shards, with_meta=True)
    assert ffdebug.weights_diff(hf_dir, tmp_path / "meta")
    for r, shard in enumerate(shards):
        save_file(shard, tmp_path / f"model-rank{r}.safetensors")
    res = ffdebug.weights_diff(hf_dir, tmp_path, tp_merge="auto")
    assert res and res.target["kind"] == "per-rank"


def test_tp_merge_explicit_dim_and_bad_merge(hf_state, tmp_path):
    rows = {k: v for k, v in hf_state.items() if any(r in k for r in ROW)}
    shards = tp_split(rows)
    for r, shard in enumerate(shards):
        (tmp_path / f"rank{r}").mkdir()
        save_file(shard, tmp_path / f"rank{r}" / "model.safetensors")
    assert ffdebug.weights_diff(rows, tmp_path, tp_merge=1)
    wrong = ffdebug.weights_diff(rows, tmp_path, tp_merge=0)
    assert not wrong and wrong.shape_mismatch


@pytest.mark.integration
def test_tp_replicated_tensor_differing_across_ranks(hf_dir, hf_state, tmp_path):
    shards = tp_split(hf_state)
    shards[1]["model.norm.weight"] = shards[1]["model.norm.weight"] + 1e-3
    write_dump(tmp_path / "weights", shards)
    code, out = run_json("weights-diff", hf_dir, tmp_path / "weights")
    assert code == 1
    assert out["replica_mismatch"] == [{"name": "model.norm.weight", "side": "target", "ranks": [1]}]
    assert out["verdict"] == "ok"  # rank 0 matches the reference; the replica check fails the run


@pytest.mark.integration
def test_both_sides_per_rank_compare_rank_by_rank(hf_state, tmp_path):
    shards = tp_split(hf_state)
    write_dump(tmp_path / "a" / "weights", shards)
    shards[1]["model.layers.0.mlp.up_proj.weight"] = -shards[1]["model.layers.0.mlp.up_proj.weight"]
    write_dump(tmp_path / "b" / "weights", shards)
    res = ffdebug.weights_diff(tmp_path / "a", tmp_path / "b")
    bad = [t for t in res.tensors if t.finding != "equal"]
    assert [t.name for t in bad] == ["model.layers.0.mlp.up_proj.weight@rank1"]
    assert bad[0].finding == "sign_flip"


# --- must show: fp8 with scales vs the original weights: rounding level -------------------------


def _fp8_checkpoint(state: dict, dtype: str, block, e8m0: bool, suffix: str) -> dict:
    out = {}
    for name, t in state.items():
        if t.dim() == 2 and "embed" not in name and "lm_head" not in name:
            q, s = quant.quantize_fp8(t, dtype, block, e8m0=e8m0)
            out[name] = q
            out[name + suffix] = s
        else:
            out[name] = t
    return out


@pytest.mark.parametrize(
    "dtype,block,e8m0,suffix",
    [
        ("float8_e4m3fn", None, False, "_scale"),  # per tensor (compressed-tensors)
        ("float8_e4m3fn", (16, 16), False, "_scale_inv"),  # per block (DeepSeek-V3), padded blocks
        ("float8_e4m3fn", (1, 32), True, "_scale"),  # e8m0 block scales (MX)
        ("float8_e5m2", None, False, "_scale"),
    ],
)
def test_fp8_with_scales_is_rounding_level(hf_dir, hf_state, tmp_path, dtype, block, e8m0, suffix):
    state = {k: v for k, v in hf_state.items() if ".layers.0." in k or "norm" in k}
    state["model.layers.0.extra.weight"] = torch.randn(40, 24)  # 40 rows: a padded last 16-block
    ckpt = _fp8_checkpoint(state, dtype, block, e8m0, suffix)
    save_file(state, tmp_path / "ref.safetensors")
    save_file(ckpt, tmp_path / "fp8.safetensors")
    code, out = run_json(
        "weights-diff", tmp_path / "ref.safetensors", tmp_path / "fp8.safetensors", "--allow-dtype"
    )
    assert code == 0, out
    assert not out["only_target"]  # scales were used, not listed
    fp8 = [t for t in out["tensors"] if t["dtype_target"] == dtype]
    assert len(fp8) == 8 and len(out["dequantized"]) == 8
    # Round to nearest leaves each element within half a spacing: |e| <= 2^-(m+1)|w| for m
    # mantissa bits, and >= 2^-(m+2)|w| on average over a binade, so rel (an rms) lies in
    # [2^-(m+2)/sqrt(3), 2^-(m+1)/sqrt(3)]: e4m3 [0.018, 0.036], e5m2 [0.036, 0.072]. That is the
    # drift rel band (1% < rel <= 10%), and cos ~ 1 - rel^2/2 < 0.9999 is drift too.
    for t in fp8:
        assert t["finding"] == "rounding", t
        assert t["severity"] == "drift", t
        m = 3 if "e4m3" in dtype else 2
        assert 0.9 * 2.0 ** -(m + 2) / 3**0.5 < t["rel"] < 1.1 * 2.0 ** -(m + 1) / 3**0.5, t
        assert t["dequantized"]
    assert out["verdict"] == "drift"
    assert {d["dtype_target"] for d in out["dtype_mismatch"]} == {dtype}


def test_fp8_wrong_scale_is_caught_and_raw_mode(hf_state):
    w = hf_state["model.layers.0.mlp.up_proj.weight"]
    q, s = quant.quantize_fp8(w, "float8_e4m3fn", (16, 16))
    good = ffdebug.weights_diff({"w": w}, {"w": q, "w_scale_inv": s}, allow_dtype=True)
    assert good and good.tensors[0].finding == "rounding"
    bad = ffdebug.weights_diff({"w": w}, {"w": q, "w_scale_inv": s * 2}, allow_dtype=True)
    assert not bad and bad.tensors[0].finding == "scaled" and bad.tensors[0].severity == "bug"
    raw = ffdebug.weights_diff({"w": w}, {"w": q, "w_scale_inv": s}, dequant="none")
    assert raw.only_target == ["w_scale_inv"]


def test_e8m0_decoding_and_scale_expansion():
    import ml_dtypes

    x = np.array([127, 128, 120, 255, 0, 254], dtype=np.uint8)
    got = quant.e8m0_to_float(x)
    assert got.dtype == np.float32 and np.isnan(got[3])
    assert got[[0, 1, 2, 4, 5]].tolist() == [1.0, 2.0, 2.0**-7, 2.0**-127, 2.0**127]  # 2^-127: a subnormal
    assert np.array_equal(quant.e8m0_to_float(x.view(ml_dtypes.float8_e8m0fnu)), got, equal_nan=True)
    assert np.array_equal(x.view(ml_dtypes.float8_e8m0fnu).astype(np.float32), got, equal_nan=True)
    # Blocks are powers of two where one fits, the last one padded: 5 columns in 2 blocks = 4 + 1.
    s = quant.expand_scale(np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32), (3, 5))
    assert s.tolist() == [[1, 1, 1, 1, 2], [1, 1, 1, 1, 2], [3, 3, 3, 3, 4]]
    assert quant.block_size(7168, 56) == 128 and quant.block_size(40, 3) == 16
    per_channel = quant.expand_scale(np.array([2.0, 3.0], dtype=np.float32), (2, 4))
    assert per_channel.tolist() == [[2.0], [3.0]]


def test_fp8_conclusion_counts_rounding_apart_from_real_differences():
    """bf16 vs fp8: every tensor is `rounding` (graded drift by the bands); the sentence must not
    call them differences beyond rounding. One sign flip among them is counted alone."""
    from ffdebug.report.weights_text import weights_conclusion

    torch.manual_seed(0)
    ref = {f"layers.{i}.w": torch.randn(64, 64).to(torch.bfloat16) for i in range(3)}
    ref["norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    tgt = {"norm.weight": ref["norm.weight"]}
    for k in list(ref)[:3]:
        tgt[k], tgt[k + "_scale"] = quant.quantize_fp8(ref[k].float(), "float8_e4m3fn", None)
    res = ffdebug.weights_diff(ref, tgt, allow_dtype=True)
    assert [t.finding for t in res.tensors] == ["rounding"] * 3 + ["equal"]
    assert {t.severity for t in res.tensors[:3]} == {"drift"}
    text = weights_conclusion(res.to_json())
    assert "beyond rounding" not in text and "Schema differs" not in text, text
    assert "All 4 compared tensors match within rounding; 3 of them graded drift" in text
    assert "3 dtype difference(s) allowed" in text and text.endswith("PASSED")

    tgt["norm.weight"] = -ref["norm.weight"]
    text = weights_conclusion(ffdebug.weights_diff(ref, tgt, allow_dtype=True).to_json())
    assert "1 of 4 tensors differ beyond rounding, worst scramble; first norm.weight (sign_flip" in text
    assert "3 more within rounding but graded drift" in text and text.endswith("FAILED")


@pytest.mark.parametrize("block,e8m0", [(None, False), ((16, 16), False), ((1, 32), True)])
def test_quantize_round_trip_on_numpy_and_torch(block, e8m0):
    """`quantize_fp8` returns arrays of the kind it is given (numpy: ml_dtypes' float8; torch: the
    same bits as torch tensors), and `dequantize` brings either back within e4m3's rounding."""
    w = np.random.default_rng(0).standard_normal((40, 64)).astype(np.float32)
    q, s = quant.quantize_fp8(w, "float8_e4m3fn", block, e8m0=e8m0)
    assert isinstance(q, np.ndarray) and str(q.dtype) == "float8_e4m3fn"
    assert str(s.dtype) == ("float8_e8m0fnu" if e8m0 else "float32")
    back = quant.dequantize(q, s)
    assert back.dtype == np.float32 and np.all(np.abs(back - w) <= 2.0**-4 * np.abs(w) + 1e-6)
    tq, ts = quant.quantize_fp8(torch.from_numpy(w), "float8_e4m3fn", block, e8m0=e8m0)
    assert isinstance(tq, torch.Tensor) and tq.dtype == torch.float8_e4m3fn
    assert np.array_equal(tq.view(torch.uint8).numpy(), q.view(np.uint8))
    assert np.array_equal(quant.dequantize(tq, ts), back)
