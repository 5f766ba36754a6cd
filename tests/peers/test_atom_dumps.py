"""ATOM debug_helper dumps read as they are: a mixed hook + ref_ directory as two sides, calls
and ATOM's warm-up pick, weight dumps against a checkpoint, `*_fwd.pt` dicts."""

from __future__ import annotations

import json

import torch
from helpers.peers.peer_layouts import atom_hook, atom_ref, atom_weights, residual_stream
from safetensors.torch import save_file
from typer.testing import CliRunner

from ffdebug.cli.app import app


def _cli(*args):
    r = CliRunner().invoke(app, [*map(str, args), "--json"])
    return r.exit_code, (json.loads(r.stdout) if r.stdout.strip().startswith("{") else r.output)


def _mixed_dir(d, bug_layer=2, calls=None):
    """ATOM's own hook files (Block + a sub-stage class) beside the reference's ref_ files."""
    d.mkdir()
    ins, updates, outs = residual_stream(num_layers=4)
    t_ins, t_updates, t_outs = residual_stream(num_layers=4, bug_layer=bug_layer)
    for layer in range(4):
        atom_ref(d, layer, "Block", "hidden_in", 0, ins[layer])
        atom_ref(d, layer, "Block", "hidden_out", 0, outs[layer])
        atom_ref(d, layer, "MoE", "out", 0, updates[layer])
        for call in calls or [None]:
            warm = call == 0 and calls
            h_in, h_out = (t_ins[layer][:4], t_outs[layer][:4]) if warm else (t_ins[layer], t_outs[layer])
            fields = {"residual": h_in * 0.5}
            atom_hook(d, layer, "Block", 0, h_out, inp=h_in, call=call, input_fields=fields)
            atom_hook(d, layer, "MoE", 0, t_updates[layer][: len(h_in)], call=call)
    return d


def test_a_mixed_directory_compares_ref_vs_target_as_two_sides(tmp_path):
    d = _mixed_dir(tmp_path / "atom")
    code, data = _cli("compare", "ref-vs-target", "--dir", d, "--allow-partial")
    assert code == 1
    fd = data["first_divergence"]
    assert (fd["layer"], fd["key"]) == (2, "L002.MoE.out")  # the sub-stage runs before the block output
    keys = {s["key"] for s in data["stages"]}
    assert {"L002.hidden_in", "L002.hidden_out", "L003.MoE.out"} <= keys
    bad_layers = sorted({s["layer"] for s in data["stages"] if s["severity"] != "ok"})
    assert bad_layers[0] == 2 and all(s["severity"] == "ok" for s in data["stages"] if s["layer"] in (0, 1))

    code, info = _cli("inspect", d / "target")
    rows = {r["key"]: r for r in info["tensors"]}
    assert rows["L002.hidden_out"]["layer"] == 2 and rows["L002.hidden_out"]["rank"] == 0
    assert rows["L002.hidden_out"]["call"] == 0 and rows["L002.hidden_in.residual"]["io"] == "in"


def test_bisect_reads_the_mixed_directory_directly(tmp_path):
    d = _mixed_dir(tmp_path / "atom", bug_layer=1)
    code, data = _cli("bisect", "--dir", d, "--allow-partial")
    assert code == 1 and data["first_divergence"]["layer"] == 1


def test_untagged_calls_pick_the_prefill_not_atoms_warmup(tmp_path):
    """ONE_SHOT=0: call000 is the warm-up (4 rows, a power of two), call001 the prefill (7 rows);
    the reference (one call) pairs with call001 and the warm-up is set aside, not a divergence."""
    d = _mixed_dir(tmp_path / "atom", bug_layer=None, calls=[0, 1])
    code, data = _cli("compare", "ref-vs-target", "--dir", d, "--allow-partial")
    assert code == 0, data
    assert data["verdict"] == "ok" and data["coverage"]["calls"]["only_target"] == []
    assert all(s["shape_target"][0] == 7 for s in data["stages"])


def test_a_weight_dump_diffs_against_a_safetensors_checkpoint(tmp_path):
    """ATOM dumped layers 0 and 1 of a TP=2 model (column-parallel q_proj split on dim 0, norm
    replicated, a rotary buffer); the checkpoint's layer 1 q_proj differs in one row."""
    torch.manual_seed(0)
    ckpt = {}
    for layer in range(3):
        ckpt[f"model.layers.{layer}.self_attn.q_proj.weight"] = torch.randn(8, 4)
        ckpt[f"model.layers.{layer}.input_layernorm.weight"] = torch.randn(4)
    ckpt["model.embed_tokens.weight"] = torch.randn(10, 4)
    ckpt["model.layers.1.mlp.experts.0.w1.weight"] = torch.randn(4, 4)  # ATOM never dumps experts
    dump = tmp_path / "weights"
    dump.mkdir()
    loaded = {k: v.clone() for k, v in ckpt.items()}
    loaded["model.layers.1.self_attn.q_proj.weight"][5] += 1.0  # the loading bug
    for rank in range(2):
        for layer in (0, 1):
            q = loaded[f"model.layers.{layer}.self_attn.q_proj.weight"].chunk(2, dim=0)[rank]
            params = {
                f"model.layers.{layer}.self_attn.q_proj.weight": q.contiguous(),
                f"model.layers.{layer}.input_layernorm.weight": loaded[
                    f"model.layers.{layer}.input_layernorm.weight"
                ],
            }
            atom_weights(
                dump,
                rank,
                layer,
                params,
                {f"model.layers.{layer}.self_attn.rotary_emb.inv_freq": torch.ones(2)},
                tp_size=2,
            )
    save_file(ckpt, str(tmp_path / "model.safetensors"))
    code, data = _cli("weights-diff", tmp_path / "model.safetensors", dump)
    assert code == 1, data
    bad = [t for t in data["tensors"] if t["severity"] != "ok"]
    assert [t["name"] for t in bad] == ["model.layers.1.self_attn.q_proj.weight"]
    assert data["only_ref"] == [] and data["only_target"] == []  # layer 2 and embeddings left out: not dumped
    names = {t["name"] for t in data["tensors"]}
    assert (
        "model.layers.0.self_attn.q_proj.weight" in names
        and "model.layers.2.self_attn.q_proj.weight" not in names
    )


def test_fwd_dicts_map_layers_and_gate_input_ids(tmp_path):
    ins, _, outs = residual_stream(num_layers=3)
    _, _, bad = residual_stream(num_layers=3, bug_layer=1)

    def fwd(side, ids, hidden):
        obj = {"embed.input_ids": ids, "embed.final_h": hidden[-1]}
        obj.update({f"layer{i}.hidden_out": h for i, h in enumerate(hidden)})
        torch.save(obj, tmp_path / f"{side}_rank0_fwd.pt")

    fwd("ref", torch.arange(7), outs)
    fwd("atom", torch.arange(7), bad)
    code, data = _cli("compare", "ref-vs-target", "--dir", tmp_path, "--allow-partial")
    assert code == 1 and data["first_divergence"]["key"] == "L001.hidden_out"
    assert "final.norm_out" in {s["key"] for s in data["stages"]}
    fwd("atom", torch.arange(7).flip(0), bad)
    code, _ = _cli("compare", "ref-vs-target", "--dir", tmp_path)
    assert code == 3  # ATOM: "STOP, fix tokenization first"


def test_import_splits_the_mixed_directory_into_sides(tmp_path):
    d = _mixed_dir(tmp_path / "atom")
    r = CliRunner().invoke(app, ["import", str(d), str(tmp_path / "dump")])
    assert r.exit_code == 0, r.output
    code, data = _cli("compare", "ref-vs-target", "--dir", tmp_path / "dump", "--allow-partial")
    assert code == 1 and data["first_divergence"]["key"] == "L002.MoE.out"
