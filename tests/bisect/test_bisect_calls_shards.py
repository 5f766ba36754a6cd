"""Calls (warm-up, prefill) and tensor-parallel dumps (partial sums before the all-reduce)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from bisect_models import dump, input_ids, llama

import ffdebug
from ffdebug.compare.pairing import Filters, group_calls, pick_prefill_call
from ffdebug.store.reader import open_side


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
    from ffdebug.capture.session import current_layer

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
    assert {r["rank"] for r in open_side(f"{d}/target").records} == {0, 1}
    r = ffdebug.bisect(f"{d}/ref", f"{d}/target")
    assert (r.pattern, r.verdict) == ("match", "ok")
    partial = [s for s in r.shards if s["key"].endswith("mlp.down_proj.out")]
    assert len(partial) == 3 and all(s["declared"] == "sum" and s["matches"] for s in partial)


def test_undeclared_pre_all_reduce_dumps_are_reported_as_partial_sums(tmp_path, monkeypatch):
    d = _tp_dumps(tmp_path, monkeypatch, declare=False)
    plain = ffdebug.compare(f"{d}/ref", f"{d}/target")  # rank 0 alone disagrees with the full tensor
    assert plain.first_divergence["key"] == "L000.mlp.down_proj.out"
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
    assert r.call["call"] == 0 and len(r.calls) == 1

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
