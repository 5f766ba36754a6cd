"""Coverage in every verdict: what was not compared never passes silently (exit 4 names it),
every target rank is compared, and compare and bisect agree on multi-rank dumps."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from helpers.tiny_models import tiny_llama
from typer.testing import CliRunner

import ffdebug
from ffdebug.cli.app import app
from ffdebug.comparison.engine import compare

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one

runner = CliRunner()


def ids(seed: int = 3):
    return torch.randint(3, 1000, (2, 8), generator=torch.Generator().manual_seed(seed))


def dump(model, directory, side: str, inputs=None, **options) -> str:
    with ffdebug.capture(model, dir=directory, side=side, **options), torch.no_grad():
        model(input_ids=ids() if inputs is None else inputs)
    return str(directory / side)


def run(*args: str) -> tuple[int, dict]:
    r = runner.invoke(app, [*args, "--json"])
    return r.exit_code, json.loads(r.stdout)


def sentence(*args: str) -> tuple[int, str]:
    """Exit code and the whole text output on one line (the console wraps the closing sentence)."""
    r = runner.invoke(app, list(args))
    return r.exit_code, " ".join(r.output.split())


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=2)


def test_complete_identical_runs_exit_0(model, tmp_path):
    dump(model, tmp_path, "ref")
    dump(model, tmp_path, "target")
    code, data = run("compare", "ref-vs-target", "--dir", str(tmp_path))
    assert code == 0 and data["complete"] and data["coverage"]["missing"] == []
    cov = data["coverage"]
    assert cov["final_compared"] and cov["ranks"] == {"compared": [0], "missing": []}
    assert cov["sides"]["ref"] == {"finished": True, "ranks": [0], "over_budget": 0, "problems": []}
    kinds = {k["kind"]: k for k in cov["kinds"]}
    assert kinds["attn_out"] == {"kind": "attn_out", "ref": 2, "target": 2, "paired": 2}  # 2 layers
    assert cov["paired"] == len(data["stages"])


def _kill_after(side_dir: str, keep: int) -> None:
    """What a SIGKILL leaves: no status.json, the manifest cut after `keep` lines plus half a line."""
    rank_dir = os.path.join(side_dir, "rank000")
    os.remove(os.path.join(rank_dir, "status.json"))
    manifest = os.path.join(rank_dir, "manifest.jsonl")
    lines = open(manifest, encoding="utf-8").read().splitlines(keepends=True)
    with open(manifest, "w", encoding="utf-8") as f:
        f.writelines(lines[:keep])
        f.write(lines[keep][: len(lines[keep]) // 2])


def test_killed_target_exit_4_naming_the_unfinished_side(model, tmp_path):
    dump(model, tmp_path, "ref")
    _kill_after(dump(model, tmp_path, "target"), keep=6)
    code, data = run("compare", "ref-vs-target", "--dir", str(tmp_path))
    assert code == 4 and not data["passed"] and not data["complete"]
    assert data["verdict"] == "ok"  # what was compared is fine: the verdict keeps its meaning
    assert data["coverage"]["sides"]["target"]["finished"] is False
    missing = " | ".join(data["coverage"]["missing"])
    assert "the target side did not finish cleanly" in missing and "manifest line(s) cut short" in missing
    assert "stage(s) dumped by the reference only" in missing and "final outputs" not in missing
    code, text = sentence("compare", "ref-vs-target", "--dir", str(tmp_path))
    assert code == 4 and "FAILED (incomplete: the target side did not finish cleanly" in text
    # --allow-partial turns 4 into 0 and says so
    code, text = sentence("compare", "ref-vs-target", "--dir", str(tmp_path), "--allow-partial")
    assert code == 0 and "PASSED (partial, allowed by --allow-partial: " in text


def test_side_without_status_exit_4(model, tmp_path):
    dump(model, tmp_path, "ref")
    os.remove(os.path.join(dump(model, tmp_path, "target"), "rank000", "status.json"))
    code, data = run("bisect", "--dir", str(tmp_path))
    assert code == 4 and data["judgement"] == "ok"
    assert data["coverage"]["missing"] == [
        "the target side did not finish cleanly (rank(s) 0 wrote no status.json)"
    ]


def test_missing_rank_exit_4(model, tmp_path, monkeypatch):
    """Both sides ran on 2 ranks; the target's rank 1 wrote nothing (it died before its first capture)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    for side in ("ref", "target"):
        for rank in (0, 1):
            monkeypatch.setenv("RANK", str(rank))
            dump(model, tmp_path, side)
    shutil.rmtree(tmp_path / "target" / "rank001")
    code, data = run("compare", "ref-vs-target", "--dir", str(tmp_path))
    assert code == 4
    assert data["coverage"]["ranks"] == {"compared": [0], "missing": [1]}
    assert "target rank(s) 1 wrote nothing (world size 2)" in data["coverage"]["missing"]


class TuplePort(torch.nn.Module):
    """A port whose forward takes the ids and returns its logits vocabulary-first (`[B, V, S]`) in
    a tuple: no `.logits` and no tensor whose last dim is the vocabulary, so its output is dumped
    as `final.out.0` (logits in any other form are found by their width: tests/test_roles.py)."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        return (self.inner(input_ids=input_ids).logits.transpose(1, 2),)


def test_port_whose_final_stages_do_not_pair_exit_4(model, tmp_path):
    """Every block stage of the port passes, but its output never paired with the reference's:
    before coverage this was `All N stages compared are ok. PASSED`."""
    dump(model, tmp_path, "ref")
    dump(TuplePort(copy.deepcopy(model)), tmp_path, "target")
    code, data = run("compare", "ref-vs-target", "--dir", str(tmp_path))
    assert code == 4 and data["verdict"] == "ok"
    cov = data["coverage"]
    assert cov["only_ref"] == ["final.logits"] and cov["only_target"] == ["final.out.0"]
    assert not cov["final_compared"]
    assert "stage kinds dumped by the reference only: final.logits" in cov["missing"]
    # the stage map pairs them: the run is complete, and the other layout is named, not passed
    code, data = run(
        "compare", "ref-vs-target", "--dir", str(tmp_path), "--map", r"final\.out\.0=final.logits"
    )
    assert code == 1 and data["coverage"]["final_compared"] and data["complete"]
    final = next(s for s in data["stages"] if s["key"] == "final.logits")
    assert final["finding"] == "shape_mismatch"


def test_correct_single_layer_selection_on_both_sides_exit_0(tmp_path):
    """The same FFDEBUG_FWD_DUMP_LAYERS on both sides (recorded in run.json) is reported, not a gap."""
    from ffdebug.demo import dump_both_sides

    dump_both_sides(str(tmp_path), extra_env={"FFDEBUG_FWD_DUMP_LAYERS": "0"})
    shutil.rmtree(tmp_path / "target")
    shutil.copytree(tmp_path / "ref", tmp_path / "target")  # a correct target: the reference's own dump
    code, data = run("compare", "ref-vs-target", "--dir", str(tmp_path))
    assert code == 0, data["coverage"]["missing"]
    assert {s["layer"] for s in data["stages"]} == {None, 0}
    assert "both sides dumped with FFDEBUG_FWD_DUMP_LAYERS=0" in data["coverage"]["selected_out"]


def test_different_dump_selections_block(tmp_path, monkeypatch):
    for side, layers in (("ref", "0"), ("target", "0-1")):
        monkeypatch.setenv("FFDEBUG_FWD_DUMP_LAYERS", layers)
        with ffdebug.capture(None, dir=tmp_path, side=side):
            ffdebug.tap("x", torch.ones(3))
    code, data = run("compare", "ref-vs-target", "--dir", str(tmp_path))
    assert code == 4
    assert data["coverage"]["missing"] == [
        "the sides were dumped with different selections (FFDEBUG_FWD_DUMP_LAYERS: ref 0 vs target 0-1)"
    ]


def test_extra_target_tap_blocks(tmp_path):
    """Stores without block stages: every key present on one side only blocks (SGLang's
    extra-dump case used to pass as `All 1 stages compared are ok`)."""
    for side, names in (("ref", ["a"]), ("target", ["a", "b"])):
        with ffdebug.capture(None, dir=tmp_path, side=side):
            for n in names:
                ffdebug.tap(n, torch.ones(3))
    code, data = run("compare", "ref-vs-target", "--dir", str(tmp_path))
    assert code == 4 and data["coverage"]["only_target"] == ["b"]


def test_stats_only_stages_block(model, tmp_path):
    dump(model, tmp_path, "ref", mode="stats")
    dump(model, tmp_path, "target", mode="stats")
    res = compare(tmp_path / "ref", tmp_path / "target")
    assert res.exit_code() == 4 and res.coverage.stats_only == len(res.stages) - 1  # input ids have payloads
    assert any("statistics only" in m for m in res.coverage.missing)


# --- ranks ---------------------------------------------------------------------------------------


def _replicated_target(model, tmp_path, monkeypatch, bad_rank: int | None):
    dump(model, tmp_path, "ref")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        m = model
        if rank == bad_rank:
            m = copy.deepcopy(model)
            with torch.no_grad():
                m.model.layers[1].mlp.down_proj.weight.mul_(1.5)
        dump(m, tmp_path, "target")
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")


def test_every_replicated_rank_is_compared_against_a_single_rank_reference(model, tmp_path, monkeypatch):
    _replicated_target(model, tmp_path, monkeypatch, bad_rank=None)
    code, data = run("compare", "ref-vs-target", "--dir", str(tmp_path))
    assert code == 0 and data["coverage"]["ranks"] == {"compared": [0, 1], "missing": []}
    assert {s["rank"] for s in data["stages"]} == {0, 1}


def test_a_replicated_rank_that_differs_exit_1_naming_the_rank(model, tmp_path, monkeypatch):
    _replicated_target(model, tmp_path, monkeypatch, bad_rank=1)
    code, text = sentence("compare", "ref-vs-target", "--dir", str(tmp_path))
    assert code == 1 and "First divergence at layer 1 (" in text and text.endswith("FAILED")
    assert "ffn_out on target rank 1: bug" in text
    # --rank N against the single-rank reference compares that rank alone
    code, data = run("compare", "ref-vs-target", "--dir", str(tmp_path), "--rank", "1")
    assert code == 1 and {s["rank"] for s in data["stages"]} == {1}
    assert data["coverage"]["ranks"] == {"compared": [1], "missing": []}
    assert "target rank(s) 0 left out by --rank" in data["coverage"]["selected_out"]
    code, data = run("compare", "ref-vs-target", "--dir", str(tmp_path), "--rank", "0")
    assert code == 0


def _row_parallel(tmp_path, monkeypatch, bug_layer: int | None):
    """Reference: full down-projection outputs; TP=2 target: undeclared partial sums per rank,
    rank 1's half of layer `bug_layer` scaled (a bug in one shard)."""
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 4, 8, generator=g) for _ in range(3)]
    ws = [torch.randn(8, 8, generator=g) for _ in range(3)]
    with ffdebug.capture(None, dir=tmp_path, side="ref"):
        for layer, (x, w) in enumerate(zip(xs, ws)):
            ffdebug.tap(f"L{layer:03d}.down.out", x @ w.T, layer=layer)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, half in enumerate((slice(0, 4), slice(4, 8))):
        monkeypatch.setenv("RANK", str(rank))
        with ffdebug.capture(None, dir=tmp_path, side="target"):
            for layer, (x, w) in enumerate(zip(xs, ws)):
                part = x[..., half] @ w[:, half].T
                if layer == bug_layer and rank == 1:
                    part = part * 1.3
                ffdebug.tap(f"L{layer:03d}.down.out", part, layer=layer)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")


def test_compare_and_bisect_agree_on_undeclared_partial_sums(tmp_path, monkeypatch):
    _row_parallel(tmp_path, monkeypatch, bug_layer=None)
    c = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    b = ffdebug.bisect(tmp_path / "ref", tmp_path / "target")
    assert (c.exit_code(), b.exit_code()) == (0, 0)
    assert [s.finding for s in c.stages] == ["shard_reading"] * 3
    assert all(s["matches"] and s["reading"] == "sum" for s in b.shards)


def test_compare_and_bisect_agree_on_a_bug_in_one_shard(tmp_path, monkeypatch):
    _row_parallel(tmp_path, monkeypatch, bug_layer=1)
    c = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    b = ffdebug.bisect(tmp_path / "ref", tmp_path / "target")
    assert (c.exit_code(), b.exit_code()) == (1, 1)
    assert c.first_divergence.layer == 1 and b.first_divergence.layer == 1
    assert [s.finding for s in c.stages if s.layer != 1] == ["shard_reading"] * 2
    bad = next(s for s in b.shards if s["key"] == "L001.down.out")
    assert not bad["matches"] and bad["readings"][0]["how"] == "sum"  # the closest reading, still off


def test_slot_invariance_blocks_on_unsplit_stages(tmp_path):
    with ffdebug.capture(None, dir=tmp_path, side="target"):
        ffdebug.tap("h", torch.ones(3, 4))  # 3 slots along dim 0
        ffdebug.tap("scalar", torch.ones(()))  # nothing to split
    code, data = run("slot-invariance", "--dir", str(tmp_path), "--slots", "3")
    assert code == 4 and data["coverage"]["missing"] == [
        "1 stage(s) not split into 3 slots along dim 0: scalar"
    ]
    code, _ = run("slot-invariance", "--dir", str(tmp_path), "--slots", "3", "--allow-partial")
    assert code == 0


def test_two_reference_ranks_against_four_target_ranks_compare_every_target_rank(
    model, tmp_path, monkeypatch
):
    """Replicated ranks on both sides but other world sizes: every target rank is still compared
    (rank 3 with a bug used to pass, folded away behind rank 0)."""
    for side, world in (("ref", 2), ("target", 4)):
        monkeypatch.setenv("WORLD_SIZE", str(world))
        for rank in range(world):
            monkeypatch.setenv("RANK", str(rank))
            m = model
            if side == "target" and rank == 3:
                m = copy.deepcopy(model)
                with torch.no_grad():
                    m.model.layers[1].mlp.down_proj.weight.mul_(3.0)
            dump(m, tmp_path, side)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    c = compare(tmp_path / "ref", tmp_path / "target")
    assert c.exit_code() == 1 and c.coverage.ranks_compared == [0, 1, 2, 3]
    assert (c.first_divergence.layer, c.first_divergence.rank) == (1, 3)
    b = ffdebug.bisect(tmp_path / "ref", tmp_path / "target")
    assert b.exit_code() == 1 and b.call.rank == 3 and b.first_divergence.layer == 1
    assert "on target rank 3" in b.conclusion


def test_a_warm_up_call_on_the_reference_side_is_set_aside(model, tmp_path):
    with ffdebug.capture(model, dir=tmp_path, side="ref"), torch.no_grad():
        model(input_ids=torch.full((2, 8), 5))  # an untagged warm-up: one repeated id
        model(input_ids=ids())
    dump(model, tmp_path, "target")
    res = compare(tmp_path / "ref", tmp_path / "target")
    assert res.exit_code() == 0 and not res.coverage.calls_only_ref
    assert any("reference side were set aside" in n for n in res.notes)


def test_list_valued_step_tags_do_not_crash(model, tmp_path):
    for side in ("ref", "target"):
        with ffdebug.capture(model, dir=tmp_path, side=side), torch.no_grad(), ffdebug.step(sizes=[2, 8]):
            model(input_ids=ids())
    assert compare(tmp_path / "ref", tmp_path / "target").exit_code() == 0
    assert ffdebug.bisect(tmp_path / "ref", tmp_path / "target").exit_code() == 0


def test_slot_invariance_says_which_ranks_and_calls_it_did_not_check(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        with ffdebug.capture(None, dir=tmp_path, side="target"):
            for step in (0, 1):
                with ffdebug.step(step=step):
                    ffdebug.tap("h", torch.ones(2, 3))
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    code, data = run("slot-invariance", "--dir", str(tmp_path), "--slots", "2")
    assert code == 4
    missing = " | ".join(data["coverage"]["missing"])
    assert (
        "rank(s) 1 of the batched run were not checked" in missing
        and "1 other non-warm-up call(s)" in missing
    )
