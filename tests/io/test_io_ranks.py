"""Rank plans against hand-computed folds, and the folded records compare builds from them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ffdebug
from ffdebug.arrays import as_array
from ffdebug.errors import FFDebugError
from ffdebug.io.ranks import (
    Concat,
    ConcatZigzag,
    ExpertGather,
    PlanMismatch,
    Replicated,
    Sum,
    fold,
    manifest_plan,
)
from ffdebug.io.record import Record, ShardSpec
from ffdebug.io.sources import InMemory
from ffdebug.store.writer import StoreWriter


def T(x, dtype=torch.float32):
    return as_array(torch.tensor(x, dtype=dtype))


def _same(a, b) -> bool:
    """One dtype, one shape, equal values (rank plans fold numpy arrays, `ffdebug.arrays`)."""
    a, b = as_array(a), as_array(b)
    return a.dtype == b.dtype and np.array_equal(a, b)


def test_concat_along_a_dim():
    a, b = T([[1, 2], [3, 4]]), T([[5], [6]])
    plan = Concat(1)
    assert plan.describe() == "cat:1"
    assert plan.shape([(2, 2), (2, 1)]) == (2, 3)
    assert _same(plan.apply([a, b]), T([[1, 2, 5], [3, 4, 6]]))
    assert Concat(0).shape([(1, 3), (2, 3)]) == (3, 3)
    with pytest.raises(PlanMismatch, match="differ off dim 1"):
        plan.shape([(2, 2), (3, 1)])
    with pytest.raises(PlanMismatch, match="out of range"):
        Concat(2).shape([(2, 2), (2, 2)])


def test_zigzag_context_parallel_cp2():
    # sequence of 8 positions, 2*cp = 4 chunks of 2: c0=[0,1] c1=[2,3] c2=[4,5] c3=[6,7];
    # rank 0 holds c0 + c3, rank 1 holds c1 + c2
    rank0, rank1 = T([0, 1, 6, 7]), T([2, 3, 4, 5])
    plan = ConcatZigzag(0, 2)
    assert plan.shape([(4,), (4,)]) == (8,)
    assert _same(plan.apply([rank0, rank1]), torch.arange(8.0))
    assert plan.describe() == "zigzag:0:2"


def test_zigzag_cp3_along_the_sequence_dim_of_a_batch():
    # [batch 1, seq 12, hidden 2]; 6 chunks of 2 positions; rank r holds chunks r and 5-r, i.e.
    # rank 0 positions 0,1,10,11 — rank 1 positions 2,3,8,9 — rank 2 positions 4,5,6,7
    full = torch.arange(24.0).reshape(1, 12, 2)
    held = {0: [0, 1, 10, 11], 1: [2, 3, 8, 9], 2: [4, 5, 6, 7]}
    parts = [full[:, held[r]] for r in range(3)]
    assert _same(ConcatZigzag(1, 3).apply(parts), full)
    with pytest.raises(PlanMismatch, match="context-parallel size of 3"):
        ConcatZigzag(1, 3).shape([(1, 4, 2)] * 2)
    with pytest.raises(PlanMismatch, match="even size"):
        ConcatZigzag(1, 3).shape([(1, 3, 2)] * 3)


def test_sum_of_partials_in_float64():
    out = Sum().apply([T([1.5, 2.0], torch.bfloat16), T([10.0, 20.0], torch.bfloat16)])
    assert out.dtype == np.float64 and out.tolist() == [11.5, 22.0]
    assert Sum().describe() == "sum"
    with pytest.raises(PlanMismatch):
        Sum().shape([(2,), (3,)])


def test_replicated_picks_the_standing_rank():
    a, b = T([1, 2]), T([3, 4])
    assert _same(Replicated().apply([a, b]), a)
    assert _same(Replicated(1).apply([a, b]), b)
    assert Replicated().describe() == "replicated"


def test_expert_gather_orders_experts_by_global_id():
    e = [torch.full((2, 3), float(i)) for i in range(4)]
    # round-robin placement: rank 0 holds experts 0 and 2, rank 1 holds 1 and 3
    rank0, rank1 = torch.stack([e[0], e[2]]), torch.stack([e[1], e[3]])
    plan = ExpertGather(0, ((0, 2), (1, 3)))
    assert plan.shape([(2, 2, 3), (2, 2, 3)]) == (4, 2, 3)
    out = plan.apply([rank0, rank1])
    assert [float(out[i, 0, 0]) for i in range(4)] == [0.0, 1.0, 2.0, 3.0]
    contiguous = ExpertGather().apply([torch.stack(e[:2]), torch.stack(e[2:])])
    assert _same(contiguous, torch.stack(e))
    with pytest.raises(PlanMismatch, match="permutation"):
        ExpertGather(0, ((0, 0), (1, 3))).shape([(2, 2, 3), (2, 2, 3)])


def _rec(rank, value, **kw):
    t = torch.tensor(value, dtype=torch.float32)
    return Record(
        key="L000.out", seq=0, rank=rank, world_size=2, shape=tuple(t.shape), source=InMemory(t), **kw
    )


def test_manifest_plan_and_folded_record():
    shards = [_rec(1, [[3.0]], shard=ShardSpec(1, 0, 2)), _rec(0, [[4.0, 5.0]], shard=ShardSpec(1, 1, 2))]
    plan, ordered = manifest_plan(shards)
    assert plan == Concat(1) and [p.rank for p in ordered] == [1, 0]  # shard index order, not rank
    merged = fold(ordered, plan)
    assert (merged.rank, merged.world_size, merged.shape) == (0, 1, (1, 3))
    assert merged.fold == Concat(1) and len(merged.parts) == 2 and merged.has_payload
    assert merged.load().tolist() == [[3.0, 4.0, 5.0]]
    partial = [_rec(0, [1.0, 2.0], reduction="partial"), _rec(1, [3.0, 4.0], reduction="partial")]
    assert manifest_plan(partial)[0] == Sum() and fold(partial, Sum()).load().tolist() == [4.0, 6.0]
    assert manifest_plan([_rec(0, [1.0]), _rec(1, [1.0])])[0] == Replicated()
    stats_only = Record(key="L000.out", seq=0, rank=1, shape=(1,))
    assert not fold([partial[0], stats_only], Sum()).has_payload
    with pytest.raises(FFDebugError, match="do not fold as cat:0"):
        fold([_rec(0, [[1.0, 2.0]]), _rec(1, [[1.0]])], Concat(0))


def _write(side_dir, rank, world, tensor, meta):
    w = StoreWriter(str(side_dir), side_dir.name, rank=rank, world_size=world)
    w.write("L000.mlp.down_proj.out", tensor, dict(layer=0, io="out", **meta))
    w.close()


@pytest.mark.integration
@pytest.mark.parametrize(
    ("meta", "how", "parts"),
    [
        (lambda r: {"reduction": "partial"}, "sum", lambda full: [full * 0.25, full * 0.75]),
        (
            lambda r: {"shard": {"dim": 1, "index": r, "count": 2}},
            "cat:1",
            lambda full: list(full.chunk(2, 1)),
        ),
    ],
)
def test_compare_folds_a_multi_rank_side_and_says_how(tmp_path, meta, how, parts):
    full = torch.arange(12.0).reshape(3, 4) + 1.0
    _write(tmp_path / "ref", 0, 1, full, {})
    for r, piece in enumerate(parts(full)):
        _write(tmp_path / "target", r, 2, piece.contiguous(), meta(r))
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    (stage,) = [s for s in res.to_json()["stages"] if s["key"] == "L000.mlp.down_proj.out"]
    assert stage["unsharded_target"] == {"how": how, "ranks": 2}
    assert "unsharded_ref" not in stage and stage["severity"] == "ok" and stage["shape_target"] == [3, 4]


@pytest.mark.integration
def test_compare_checks_every_replicated_rank_against_a_single_rank_reference(tmp_path):
    """Undeclared ranks of the same shape are replicas: each one is compared (and named), so a
    wrong rank 1 cannot hide behind a correct rank 0."""
    full = torch.arange(12.0).reshape(3, 4) + 1.0
    _write(tmp_path / "ref", 0, 1, full, {})
    for r, piece in enumerate([full, full * 1.5]):
        _write(tmp_path / "target", r, 2, piece.contiguous(), {})
    res = ffdebug.compare(tmp_path / "ref", tmp_path / "target")
    stages = [s for s in res.stages if s.key == "L000.mlp.down_proj.out"]
    assert [(s.rank, s.severity) for s in stages] == [(0, "ok"), (1, "bug")]
    assert res.exit_code() == 1 and res.coverage.ranks_compared == [0, 1]
