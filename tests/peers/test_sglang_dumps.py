"""SGLang dumper runs read as they are: keys, order, steps, ranks, gaps, dims unsharding."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers.peers.peer_layouts import SGLangRun, residual_stream
from typer.testing import CliRunner

from ffdebug.cli.app import app
from ffdebug.io.dims import parse_dims, unshard_plan
from ffdebug.store.reader import open_side


def _run(root, bug_layer=None, extra_after=None):
    """A 3-layer run dumped as SGLang models do: input ids, then per layer (set_ctx layer_id)
    the block input, the MLP output and the block output; 13 dumps, so dump_index reaches 10+."""
    run = SGLangRun(root)
    ins, updates, outs = residual_stream(bug_layer=bug_layer)
    run.dump("input_ids", torch.arange(7))
    for layer in range(3):
        run.ctx = {"layer_id": layer}
        run.dump("layer_input", ins[layer])
        run.dump("mlp_output", updates[layer])
        run.dump("layer_output", outs[layer])
        if extra_after == layer:
            run.dump("debug_probe", outs[layer] * 2)
    run.ctx = {}
    run.step()
    return run


def _compare(*args):
    r = CliRunner().invoke(app, ["compare", *map(str, args), "--json"])
    return r.exit_code, json.loads(r.stdout)


def test_a_layer0_bug_is_reported_first_in_dump_order_with_layer_step_and_rank(tmp_path):
    _run(tmp_path / "baseline")
    run = _run(tmp_path / "target", bug_layer=0)
    code, data = _compare(tmp_path / "baseline", tmp_path / "target")
    assert code == 1
    # lexical file order would put dump_index=10 (layer 2) first; dump order puts layer 0 first
    assert data["first_divergence"]["key"] == "L000.ffn_out"
    assert data["first_divergence"]["layer"] == 0
    assert [s["key"] for s in data["stages"]][1:5] == [
        "L000.hidden_in",
        "L000.ffn_out",
        "L000.hidden_out",
        "L001.hidden_in",
    ]
    assert data["coverage"]["sides"]["target"]["finished"] is None  # an imported dump records no finish

    r = CliRunner().invoke(app, ["inspect", run.dir, "--json"])
    rows = {row["key"]: row for row in json.loads(r.stdout)["tensors"]}
    assert rows["L002.ffn_out"]["layer"] == 2 and rows["L002.ffn_out"]["rank"] == 0
    assert rows["L002.ffn_out"]["step"] == {"step": 0}
    assert rows["embed.input_ids"]["layer"] is None


def test_bisect_reads_sglang_runs_directly(tmp_path):
    _run(tmp_path / "baseline")
    _run(tmp_path / "target", bug_layer=1)
    r = CliRunner().invoke(app, ["bisect", str(tmp_path / "baseline"), str(tmp_path / "target"), "--json"])
    data = json.loads(r.stdout)
    assert r.exit_code == 1 and data["first_divergence"]["layer"] == 1


def test_one_extra_dump_on_the_target_does_not_pass(tmp_path):
    """SGLang: `18 passed | 10 failed | 2 skipped`, exit 1; the extra dump shifts every later
    dump_index, so pairing must not go by dump_index, and the extra stage is left uncompared."""
    _run(tmp_path / "baseline")
    _run(tmp_path / "target", extra_after=0)
    code, data = _compare("baseline-vs-target", "--dir", tmp_path)
    assert code == 4, data["coverage"]["missing"]
    assert data["verdict"] == "ok" and len(data["stages"]) == 10  # every shared stage paired by name
    assert data["coverage"]["only_target"] == ["debug_probe"]


def test_a_gap_in_dump_index_blocks_exit_0(tmp_path):
    _run(tmp_path / "baseline")
    run = _run(tmp_path / "target")
    lost = next(f for f in os.listdir(run.dir) if "dump_index=5___" in f)
    os.remove(os.path.join(run.dir, lost))
    code, data = _compare(tmp_path / "baseline", tmp_path / "target")
    assert code == 4
    assert any("dump_index 5 missing" in m for m in data["coverage"]["missing"])
    assert data["coverage"]["sides"]["target"]["problems"]


def test_a_file_weights_only_refuses_is_listed_with_the_global_it_needs(tmp_path):
    _run(tmp_path / "baseline")
    run = _run(tmp_path / "target")
    name = "step=0___rank=0___dump_index=14___name=sampler_state___recompute_status=disabled.pt"
    torch.save(
        {"value": torch.ones(2), "meta": {"when": __import__("datetime").date(2026, 12, 1)}},
        os.path.join(run.dir, name),
    )
    code, data = _compare(tmp_path / "baseline", tmp_path / "target")
    assert code == 4
    assert any("datetime.date" in m and name in m for m in data["coverage"]["missing"])


def test_ranks_steps_and_user_tags_pair_as_sglang_matches_bundles(tmp_path):
    """Two ranks (replicated, no dims), two steps, a user tag: each (step, tag, rank) pairs with
    its own counterpart; the bug on rank 1, step 1, expert 3 only is found there."""
    for side in ("baseline", "target"):
        for rank in (0, 1):
            run = SGLangRun(tmp_path / side, rank=rank, world_size=2)
            for step in (0, 1):
                for expert in (2, 3):
                    t = torch.full((4,), float(step * 10 + expert))
                    if side == "target" and rank == 1 and step == 1 and expert == 3:
                        t = -t
                    run.dump("expert_out", t, expert=expert)
                run.step()
    code, data = _compare(tmp_path / "baseline", tmp_path / "target")
    assert code == 1
    bad = [s for s in data["stages"] if s["severity"] != "ok"]
    assert len(bad) == 1 and len(data["stages"]) == 8


def test_recomputed_copies_are_checked_and_set_aside(tmp_path):
    """Megatron activation recompute dumps each tensor twice; the copies are replicas."""
    _run(tmp_path / "baseline")
    run = SGLangRun(tmp_path / "target")
    ins, updates, outs = residual_stream()
    run.dump("input_ids", torch.arange(7))
    for layer in range(3):
        run.ctx = {"layer_id": layer}
        for status in ("original", "recompute"):
            scale = 1.1 if (layer, status) == (2, "recompute") else 1.0
            for name, t in (
                ("layer_input", ins[layer]),
                ("mlp_output", updates[layer] * scale),
                ("layer_output", outs[layer]),
            ):
                run.dump(name, t, recompute_status=status)
    code, data = _compare(tmp_path / "baseline", tmp_path / "target")
    assert data["verdict"] == "ok" and len(data["stages"]) == 10
    assert code == 4 and any(
        "L002.ffn_out: the recomputed copy differs" in m for m in data["coverage"]["missing"]
    )


def test_import_writes_a_store_that_compares_the_same(tmp_path):
    _run(tmp_path / "baseline")
    _run(tmp_path / "target", bug_layer=1)
    out = tmp_path / "dump"
    runner = CliRunner()
    for src, side in (("baseline", "ref"), ("target", "target")):
        r = runner.invoke(
            app, ["import", str(tmp_path / src), str(out), "--side", side, "--format", "sglang"]
        )
        assert r.exit_code == 0, r.output
    code, data = _compare("ref-vs-target", "--dir", out)
    assert code == 1 and data["first_divergence"]["key"] == "L001.ffn_out"
    assert data["coverage"]["sides"]["ref"]["finished"] is None
    rec = next(r for r in open_side(str(out / "target")).records if r.key == "L001.ffn_out")
    assert rec.layer == 1 and rec.step == {"step": 0} and rec.extra["sglang"]["dump_index"] == 6


def test_e2e_demo_tp_shards_vs_cp_zigzag_sp_shards(tmp_path):
    """SGLang's test_e2e_demo: passed 2 (good, sharded), failed 1 (bad), skipped 1 (orphan),
    errored 1 (dims `h[cp]` while the dump is tensor parallel)."""
    torch.manual_seed(0)
    good, full = torch.randn(4, 8), torch.randn(2, 8, 16)
    base, tgt = tmp_path / "baseline", tmp_path / "target"
    SGLangRun(base).dump("my_good_tensor", good)
    SGLangRun(base).dump("my_bad_tensor", torch.randn(4, 8))
    SGLangRun(tgt).dump("my_good_tensor", good + torch.randn(4, 8) * 1e-5)
    SGLangRun(tgt).dump("my_bad_tensor", torch.randn(4, 8) * 100)
    SGLangRun(tgt).dump("my_orphan_tensor", torch.randn(4, 8))
    for r, shard in enumerate(full.chunk(2, dim=-1)):
        SGLangRun(base, rank=r, parallel_info={"tp_rank": r, "tp_size": 2}).dump(
            "my_sharded_tensor", shard, dims="b s h[tp]"
        )
    noisy = full + torch.randn_like(full) * 1e-5
    chunks = noisy.chunk(4, dim=1)
    zig = torch.cat([chunks[0], chunks[3], chunks[1], chunks[2]], dim=1).chunk(2, dim=1)
    rank = 0
    for cp in range(2):
        for sp, piece in enumerate(zig[cp].chunk(2, dim=1)):
            info = {"cp_rank": cp, "cp_size": 2, "sp_rank": sp, "sp_size": 2}
            SGLangRun(tgt, rank=rank, parallel_info=info).dump(
                "my_sharded_tensor", piece, dims="b s[cp:zigzag,sp] h"
            )
            rank += 1
    bad_dims = torch.randn(2, 8, 16)
    for r, shard in enumerate(bad_dims.chunk(2, dim=-1)):
        SGLangRun(base, rank=r, parallel_info={"tp_rank": r, "tp_size": 2}).dump(
            "my_bad_dims_tensor", shard, dims="b s h[tp]"
        )
        SGLangRun(tgt, rank=r, parallel_info={"tp_rank": r, "tp_size": 2}).dump(
            "my_bad_dims_tensor", shard, dims="b s h[cp]"
        )
    code, data = _compare(base, tgt)
    assert code == 1
    by_key: dict = {}
    for s in data["stages"]:
        by_key.setdefault(s["key"], []).append(s)
    assert by_key["my_good_tensor"][0]["severity"] == "ok"
    sharded = by_key["my_sharded_tensor"]
    assert len(sharded) == 1 and sharded[0]["severity"] == "ok" and sharded[0]["rel_diff"] < 1e-9
    assert sharded[0]["shape_ref"] == sharded[0]["shape_target"] == [2, 8, 16]
    assert by_key["my_bad_tensor"][0]["severity"] not in ("ok", "drift")
    assert data["coverage"]["only_target"] == ["my_orphan_tensor"]
    assert any("h[cp]" in m and "tp" in m for m in data["coverage"]["missing"])


@pytest.mark.parametrize(
    "text, names, shards",
    [
        (
            "b s[cp:zigzag,sp] h[tp] d",
            ["b", "s", "h", "d"],
            [[], [("cp", True), ("sp", False)], [("tp", False)], []],
        ),
        ("b s(cp,zigzag) h(tp) d", ["b", "s", "h", "d"], [[], [("cp", True)], [("tp", False)], []]),
        ("t (num_heads*head_dim)[tp] # ep:replicated", ["t", "(num_heads*head_dim)"], [[], [("tp", False)]]),
    ],
)
def test_dims_spellings(text, names, shards):
    dims = parse_dims(text)
    assert list(dims.names) == names
    assert [[(s.axis, s.zigzag) for s in d] for d in dims.shards] == shards


def test_dims_fold_partial_sums_and_expert_blocks_and_check_replicas():
    full = torch.randn(4, 6)
    parts = [full * 0.25, full * 0.75]
    coords = [{"tp": (r, 2)} for r in range(2)]
    plan = unshard_plan(parse_dims("t h[tp:partial]"), coords)
    assert np.allclose(plan.apply([p.numpy() for p in parts]), full.double().numpy())
    experts = torch.randn(4, 3, 5)
    coords = [{"ep": (r, 2), "tp": (t, 2)} for r in range(2) for t in range(2)]
    pieces = [experts.chunk(2, 0)[r] for r in range(2) for _ in range(2)]
    plan = unshard_plan(parse_dims("e[ep] a b # tp:replicated"), coords)
    assert np.array_equal(plan.apply([p.numpy() for p in pieces]), experts.numpy())
    assert plan.describe() == "replicated+cat:0"


def test_parallel_rank_tags_in_names_replicas_and_bare_values(tmp_path):
    """`include_parallel_rank_in_filename` adds tp_rank=… to names (not a tag to pair by); a
    `# tp:replicated` tensor whose replicas differ is a problem; the dump loader's bare values
    (no `{value, meta}`) are read."""
    full = torch.randn(3, 8)
    for side in ("baseline", "target"):
        for r in range(2):
            info = {"tp_rank": r, "tp_size": 2}
            run = SGLangRun(tmp_path / side, rank=r, world_size=2, parallel_info=info)
            run.dump("attn_output", full.chunk(2, dim=1)[r], dims="t h[tp]", layer_id=0, tp_rank=r)
            rep = full + (1e-3 if side == "target" and r == 1 else 0.0)
            run.dump("hidden", rep, dims="t h # tp:replicated", layer_id=0, tp_rank=r)
    bare = (
        tmp_path
        / "baseline"
        / "dump_20261201_120000_000abc"
        / "step=0___rank=0___dump_index=3___name=bare.pt"
    )
    torch.save(torch.ones(3), bare)
    store = open_side(str(tmp_path / "target"))
    attn = next(r for r in store.records if r.key == "L000.attn_out")
    assert attn.shape == (3, 8) and attn.step == {"step": 0} and [p.rank for p in attn.parts] == [0, 1]
    assert np.array_equal(attn.load(), full.numpy())
    assert store.problems == ["L000.hidden: replicated rank 1 differs from rank 0"]
    base = open_side(str(tmp_path / "baseline"))
    assert np.array_equal(next(r for r in base.records if r.key == "bare").load(), np.ones(3, np.float32))


def test_non_intrusive_names_and_gradients_map_to_stage_keys():
    from ffdebug.io.peer_names import canonical_key

    assert canonical_key("non_intrusive__model.layers.3.output", 3) == "L003.hidden_out"
    assert canonical_key("non_intrusive__model.layers.3.inputs.0", 3) == "L003.hidden_in"
    assert canonical_key("non_intrusive__model.layers.3.mlp.down_proj.output", 3) == "L003.mlp.down_proj.out"
    assert (
        canonical_key("non_intrusive__model.layers.3.self_attn.inputs.positions", 3)
        == "L003.self_attn.in.positions"
    )
    assert canonical_key("non_intrusive__model.norm.output", None) == "final.norm_out"
    assert canonical_key("non_intrusive__lm_head.output", None) == "final.logits"
    assert (
        canonical_key("mlp_output", 0) == "L000.ffn_out" and canonical_key("my_probe", 2) == "L002.my_probe"
    )
    assert (
        canonical_key("input_ids", None) == "embed.input_ids"
        and canonical_key("my_probe", None) == "my_probe"
    )


def test_dependent_axes_resolve_as_sglang_does():
    """`attn_tp` equal to `tp` on every piece follows from the declared `tp`; an axis that varies
    independently (`ep` here) is undeclared."""
    from ffdebug.io.dims import resolve_axes

    dims = parse_dims("t h[tp]")
    coords = [{"tp": (r, 2), "attn_tp": (r, 2)} for r in range(2)]
    kept, loose = resolve_axes(dims, coords)
    assert loose == [] and kept == [{"tp": (0, 2)}, {"tp": (1, 2)}]
    coords = [{"tp": (t, 2), "ep": (e, 2)} for t in range(2) for e in range(2)]
    assert resolve_axes(dims, coords)[1] == ["ep"]
