"""Calls (warm-up, prefill) and tensor-parallel dumps (partial sums before the all-reduce)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.bisect.bisect_models import dump, input_ids, llama

import ffdebug
from ffdebug.comparison.pairing import Filters, group_calls, pick_prefill_call
from ffdebug.store.reader import open_side

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one


class TappedDown(torch.nn.Module):
    """The reference's down projection, dumping its full output as `L{NNN}.mlp.down_proj.out`."""

    def __init__(self, linear) -> None:
        super().__init__()
        self.weight = linear.weight

    def forward(self, x):
        out = F.linear(x, self.weight)
        ffdebug.tap(f"L{_layer():03d}.mlp.down_proj.out", out)
        return out


class RowParallelDown(TappedDown):
    """A TP=2 row-parallel down projection on `rank`: dumps its partial sum before the all-reduce."""

    def __init__(self, linear, rank: int, declare: bool) -> None:
        super().__init__(linear)
        self.rank, self.declare = rank, declare

    def forward(self, x):
        half = x.shape[-1] // 2
        sl = slice(self.rank * half, (self.rank + 1) * half)
        partial = F.linear(x[..., sl], self.weight[:, sl])
        tags = {"reduction": "partial"} if self.declare else {}
        ffdebug.tap(f"L{_layer():03d}.mlp.down_proj.out", partial, **tags)
        return F.linear(x, self.weight)  # what the all-reduce hands back


def _layer() -> int:
    from ffdebug.capture.state import current_layer

    return current_layer()


def _with_down(model, make):
    m = copy.deepcopy(model)
    for layer in m.model.layers:
        layer.mlp.down_proj = make(layer.mlp.down_proj)
    return m


def _tp_dumps(tmp_path, monkeypatch, declare: bool) -> str:
    base = llama(num_layers=3)
    ids = input_ids()
    dump(_with_down(base, TappedDown), tmp_path, "ref", ids)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        dump(_with_down(base, lambda lin, r=rank: RowParallelDown(lin, r, declare)), tmp_path, "target", ids)
    return str(tmp_path)


def test_declared_partial_sums_are_summed_over_ranks(tmp_path, monkeypatch):
    d = _tp_dumps(tmp_path, monkeypatch, declare=True)
    assert {r.rank for r in open_side(f"{d}/target").records} == {0, 1}
    r = ffdebug.bisect(f"{d}/ref", f"{d}/target")
    assert (r.pattern, r.verdict) == ("match", "ok")
    partial = [s for s in r.shards if s["key"].endswith("mlp.down_proj.out")]
    assert len(partial) == 3 and all(s["declared"] == "sum" and s["matches"] for s in partial)


def test_undeclared_pre_all_reduce_dumps_are_reported_as_partial_sums(tmp_path, monkeypatch):
    d = _tp_dumps(tmp_path, monkeypatch, declare=False)
    # every rank alone disagrees with the full tensor; compare then finds the sum that explains
    # them, exactly as bisect does (they share the reading): both pass
    plain = ffdebug.compare(f"{d}/ref", f"{d}/target")
    assert plain.first_divergence is None and plain.exit_code() == 0
    folded = {s.key: s for s in plain.stages if s.finding == "shard_reading"}
    assert set(folded) == {f"L00{i}.mlp.down_proj.out" for i in range(3)}
    assert folded["L000.mlp.down_proj.out"].unsharded_target == {"how": "sum", "ranks": 2, "inferred": True}
    r = ffdebug.bisect(f"{d}/ref", f"{d}/target")
    found = {s["key"]: s for s in r.shards}
    s = found["L000.mlp.down_proj.out"]
    assert s["matches"] and s["reading"] == "sum" and "partial sums" in s["explained_by"]
    assert (r.pattern, r.verdict) == ("match", "ok")
    assert any("reduction='partial'" in n for n in r.notes)


def test_warmup_call_with_dummy_inputs_is_not_a_divergence(tmp_path):
    model = llama(num_layers=3)
    ids = input_ids()
    dump(model, tmp_path, "ref", ids)
    with ffdebug.capture(model, dir=tmp_path, side="target"), torch.no_grad():
        model(input_ids=torch.zeros_like(ids))  # the engine's untagged warm-up
        model(input_ids=ids)
        model(input_ids=ids[:, -1:])  # a decode step
    r = ffdebug.bisect(f"{tmp_path}/ref", f"{tmp_path}/target")
    assert (r.pattern, r.verdict, r.first_divergence) == ("match", "ok", None)
    assert r.warmup_skipped == 1
    assert r.call.call == 0 and len(r.calls) == 1

    groups = group_calls(open_side(f"{tmp_path}/target"), Filters())
    ref_group = group_calls(open_side(f"{tmp_path}/ref"), Filters())[0]
    assert [g.warmup for g in groups] == [True, False, False]
    assert pick_prefill_call(groups, like=ref_group).call == 1
    assert pick_prefill_call(groups).call == 1  # more than one token per sequence: the prefill


def test_input_ids_differ_exit_3(tmp_path):
    from typer.testing import CliRunner

    from ffdebug.cli.app import app

    model = llama(num_layers=2)
    dump(model, tmp_path, "ref", input_ids())
    dump(model, tmp_path, "target", input_ids(seed=8))
    res = CliRunner().invoke(app, ["bisect", "--dir", str(tmp_path)])
    assert res.exit_code == 3 and "fix tokenization first" in res.output


def _rank_taps(directory, side: str, monkeypatch, pieces) -> str:
    """Free taps only (no model): `L000.hidden_in` (replicated, equal on every rank) and, per rank,
    `L000.mlp.proj.out` = pieces[rank] = (tensor, tags)."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 4, 8, generator=g)
    monkeypatch.setenv("WORLD_SIZE", str(len(pieces)))
    for rank, (tensor, tags) in enumerate(pieces):
        monkeypatch.setenv("RANK", str(rank))
        with ffdebug.capture(None, dir=directory, side=side):
            ffdebug.tap("L000.hidden_in", hidden, layer=0)
            ffdebug.tap("L000.mlp.proj.out", tensor, layer=0, **tags)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    return f"{directory}/{side}"


def _column_parallel(tmp_path, monkeypatch, declare: bool):
    """Reference: the full [2, 4, 8] output; TP=2 target: each rank dumps a [2, 4, 4] slice along dim 2
    before the all-gather. Declared with shard={dim, index, count}, rank 0 holds shard index 1 (folding
    must follow the declared index, not the rank)."""
    full = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))
    ref = _rank_taps(tmp_path, "ref", monkeypatch, [(full, {})])
    pieces = []
    for rank in (0, 1):
        index = 1 - rank if declare else rank
        tags = {"shard": {"dim": 2, "index": index, "count": 2}} if declare else {}
        pieces.append((full[..., index * 4 : (index + 1) * 4], tags))
    return ref, _rank_taps(tmp_path, "target", monkeypatch, pieces)


def test_declared_shards_are_concatenated_in_shard_index_order(tmp_path, monkeypatch):
    ref, target = _column_parallel(tmp_path, monkeypatch, declare=True)
    res = ffdebug.compare(ref, target)
    assert res.verdict == "ok" and all(s.bit_equal == 1.0 for s in res.stages)
    r = ffdebug.bisect(ref, target)
    (shard,) = r.shards
    assert (shard["key"], shard["declared"], shard["matches"], shard["rel"]) == (
        "L000.mlp.proj.out",
        "cat:2",
        True,
        0.0,
    )
    assert (r.pattern, r.verdict, r.judgement, r.failed()) == ("match", "ok", "ok", False)


def test_undeclared_shards_are_found_as_a_concatenation(tmp_path, monkeypatch):
    ref, target = _column_parallel(tmp_path, monkeypatch, declare=False)
    plain = ffdebug.compare(ref, target)  # each rank alone: half the reference's last dim
    (stage,) = [s for s in plain.stages if s.key == "L000.mlp.proj.out"]
    assert (stage.finding, stage.severity, stage.rel) == ("shard_reading", "ok", 0.0)
    # the replicated hidden_in is compared on each target rank
    assert [s.rank for s in plain.stages if s.key == "L000.hidden_in"] == [0, 1]
    assert plain.exit_code() == 0
    r = ffdebug.bisect(ref, target)
    (shard,) = r.shards
    assert shard["matches"] and shard["reading"] == "cat:2" and shard["rel"] == 0.0
    assert shard["explained_by"] == "concatenation of 2 shards along dim 2"
    assert (r.pattern, r.verdict) == ("match", "ok")
    assert any("shard={dim,index,count}" in n for n in r.notes)


@pytest.mark.parametrize("case", ["declared_partial_sums", "undeclared_shards"])
def test_tp2_dumps_that_match_once_folded_pass_bisect(tmp_path, monkeypatch, case):
    if case == "undeclared_shards":
        ref, target = _column_parallel(tmp_path, monkeypatch, declare=False)
    else:  # row-parallel: each rank's partial product x[..., half] @ W[:, half]^T, before the all-reduce
        g = torch.Generator().manual_seed(3)
        x, w = torch.randn(2, 4, 8, generator=g), torch.randn(8, 8, generator=g)
        ref = _rank_taps(tmp_path, "ref", monkeypatch, [(F.linear(x, w), {})])
        halves = (slice(0, 4), slice(4, 8))
        parts = [(F.linear(x[..., h], w[:, h]), {"reduction": "partial"}) for h in halves]
        target = _rank_taps(tmp_path, "target", monkeypatch, parts)
    r = ffdebug.bisect(ref, target)
    assert all(s["matches"] for s in r.shards) and (r.pattern, r.verdict) == ("match", "ok")
    assert (r.judgement, r.failed()) == ("ok", False)
