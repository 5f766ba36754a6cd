"""``backend.kind: fsdp2`` on two CPU ranks (gloo, ``torchrun --nproc-per-node 2``): two launches.

* probe (``fsdp2_driver.py``): after prepare every trainable parameter of GRPO's one variant and of
  DMD2's two is a ``DTensor`` (``Shard(0)``) and the optimizer holds exactly those objects, role by
  role; three AdamW steps through the trainer's role phase (each rank on 2 samples) match one process
  stepping an unsharded copy on all 4 within 1e-6 (measured 6e-8 to 9e-8 at ATEN_CPU_CAPABILITY avx2
  and default, the update itself ~1e-2): the one process runs each rank's 2 samples as its own forward,
  so both sides use the same GEMM shapes (a batch of 4 picks other kernels on some CPUs: 2.7e-6 on
  an AMD EPYC), and what is left is the order of the gradient reduction and of the clip norm; a snapshot
  forward runs the snapshot, not the live shards; ``activation_checkpointing: full`` recomputes each
  block in backward (its forward runs twice);
* DMD2 (two roles, cut inside a rollout iteration) runs 4 steps straight and 2 then resumed to 4
  (``distributed_driver.py resume``): metrics and the final checkpoint are bitwise equal, and match a
  one-process run with the same global batch (metrics within 1e-7 + 1e-5·|value|, exported weights
  within 1e-5: the export holds the gathered full weights).

In-process: which modules are blocks; per-block activation checkpointing (a block's forward runs
again in backward) and its refusal when gradient checkpointing is already on.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers.trainer.trainer_utils import assert_rank_layout_matches, example, load, metrics
from safetensors.torch import load_file
from test_distributed import DRIVER, FAST_EVAL, _files, torchrun

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one

FSDP2_DRIVER = DRIVER.parent / "fsdp2_driver.py"
DMD2 = ("dmd2", 4, 2, ["train.prompts_per_iteration=2", "backend.kind=fsdp2"])


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2-probe")
    torchrun("probe", str(out), driver=FSDP2_DRIVER)
    return json.loads((out / "probe.json").read_text())


@pytest.fixture(scope="module")
def dmd2_run(tmp_path_factory):
    name, n, m, overrides = DMD2
    out = tmp_path_factory.mktemp("fsdp2-dmd2")
    torchrun("resume", str(out), name, str(n), str(m), FAST_EVAL, *overrides)
    return out


@pytest.mark.integration
@pytest.mark.parametrize(
    "trainer, roles", [("grpo", {"policy": 66}), ("dmd2", {"generator": 66, "fake": 66})]
)
def test_every_trainable_parameter_is_a_dtensor_held_by_the_optimizer(probe, trainer, roles):
    found = probe[trainer]
    assert probe["world_size"] == 2
    assert found["roles"] == roles  # the sd3_tiny transformer has 66 parameters
    assert found["trainable"] == found["trainable_dtensor"] == found["held"] == sum(roles.values())
    assert found["held_is_trainable"] and found["roles_are_held"]
    assert found["placements"] == ["(Shard(dim=0),)"]


@pytest.mark.numeric
@pytest.mark.integration
def test_three_adamw_steps_match_one_process(probe):
    assert probe["adamw"]["max_abs_difference"] <= 1e-6
    assert probe["adamw"]["max_abs_update"] > 1e-3  # the weights moved: the comparison can fail


@pytest.mark.integration
def test_snapshot_forward_runs_the_snapshot_not_the_live_shards(probe):
    assert probe["snapshot"] == {"snapshot_equals_plain": True, "live_differs": True}


@pytest.mark.integration
def test_activation_checkpointing_recomputes_each_block_in_backward(probe):
    assert (probe["block_forwards"], probe["block_forwards_checkpointed"]) == (1, 2)


@pytest.mark.integration
def test_dmd2_two_rank_exact_resume(dmd2_run):
    _, n, _, _ = DMD2
    straight, cut = dmd2_run / "straight", dmd2_run / "cut"
    assert (straight / "metrics.jsonl").read_bytes() == (cut / "metrics.jsonl").read_bytes()
    assert [r["optimizer_step"] for r in metrics(straight)] == list(range(1, n + 1))
    assert {r["role"] for r in metrics(straight)} == {"fake", "generator"}
    final = f"checkpoints/step-{n:06d}"
    a, b = _files(straight / final), _files(cut / final)
    assert a.keys() == b.keys() and "state/cycle_start.safetensors" in _files(cut / "checkpoints/step-000002")
    assert [key for key in a if a[key] != b[key]] == []
    assert json.loads((straight / "run.json").read_text())["backend"] == {"kind": "fsdp2", "world_size": 2}


@pytest.mark.integration
def test_dmd2_two_ranks_match_one_rank(dmd2_run, tmp_path):
    from reference_trainer.run import train

    _, n, _, _ = DMD2
    torch.set_num_threads(1)
    train(load(example("dmd2"), FAST_EVAL, max_steps=n), tmp_path / "one")
    single, double = metrics(tmp_path / "one"), metrics(dmd2_run / "straight")
    assert len(single) == len(double) == n
    assert_rank_layout_matches(single, double)
    final = f"checkpoints/step-{n:06d}/model"
    for variant in ("generator", "fake"):
        full = load_file(tmp_path / "one" / final / variant / "diffusion_pytorch_model.safetensors")
        gathered = load_file(dmd2_run / "straight" / final / variant / "diffusion_pytorch_model.safetensors")
        assert full.keys() == gathered.keys()
        for key, value in full.items():
            assert gathered[key].shape == value.shape, key
            assert float((gathered[key] - value).abs().max()) <= 1e-5, (variant, key)


def test_blocks_are_the_children_of_the_outermost_module_lists():
    from torch import nn

    from reference_trainer.fsdp import blocks

    inner = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
    first = nn.Sequential(nn.Linear(2, 2), inner)
    model = nn.ModuleDict(
        {
            "head": nn.Linear(2, 2),
            "a": nn.ModuleList([first, nn.Linear(2, 2)]),
            "b": nn.ModuleList([nn.ReLU()]),
        }
    )
    found = blocks(model)
    assert [id(m) for m in found] == [id(first), id(model["a"][1]), id(model["b"][0])]
    assert blocks(nn.Linear(2, 2)) == []


def _block_model():
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))


def _forwards_of_first_block(model, mode: str) -> int:
    from reference_trainer.fsdp import blocks, checkpoint_blocks

    found = blocks(model)
    checkpoint_blocks("policy", model, found, mode)
    calls = []
    found[0].register_forward_pre_hook(lambda *_: calls.append(1))
    h = model[0](torch.ones(2, 3))
    for block in model[1]:
        h = block(h)
    h.square().sum().backward()
    return len(calls)


def test_full_activation_checkpointing_recomputes_each_block_in_process():
    assert _forwards_of_first_block(_block_model(), "none") == 1
    assert _forwards_of_first_block(_block_model(), "full") == 2


def test_activation_checkpointing_already_on_is_refused():
    from reference_trainer.errors import ConfigError
    from reference_trainer.fsdp import blocks, checkpoint_blocks

    model = _block_model()
    model.is_gradient_checkpointing = True  # what diffusers' enable_gradient_checkpointing() sets
    with pytest.raises(ConfigError, match="backend.activation_checkpointing: variant 'policy' already has"):
        checkpoint_blocks("policy", model, blocks(model), "full")
