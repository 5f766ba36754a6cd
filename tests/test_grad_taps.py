"""Sampled gradient taps (`ffdebug.tap_grads`, docs/trainer-taps.md "Sampled gradients"): opt-in,
grouped by parameter name, sampled at indices fixed by each parameter's name and shape."""

from __future__ import annotations

import hashlib

import pytest
import torch

import ffdebug
from ffdebug.arrays import to_torch
from ffdebug.capture.grads import group_of
from ffdebug.errors import FFDebugError
from ffdebug.store.reader import open_side


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(5, 4), torch.nn.Linear(4, 2)])
        self.head = torch.nn.Linear(2, 2)


def _grads(net):
    torch.manual_seed(0)
    x = torch.randn(3, 5)
    net.blocks[1](net.blocks[0](x)).square().sum().backward()  # head gets no gradient


def _documented_indices(name: str, shape: tuple[int, ...], count: int) -> torch.Tensor:
    """The docs' recipe, written out: sha256("<name>:<d0>x<d1>") seeds a randperm, first N sorted."""
    digest = hashlib.sha256(f"{name}:{'x'.join(map(str, shape))}".encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") % 2**63)
    numel = int(torch.tensor(shape).prod())
    return torch.randperm(numel, generator=generator)[:count].sort().values


def test_groups_are_the_name_up_to_the_first_index():
    assert group_of("transformer_blocks.3.attn.to_q.weight") == "transformer_blocks.3"
    assert group_of("proj_out.weight") == "proj_out"
    assert group_of("pos_embed.proj.bias") == "pos_embed"
    assert group_of("scale") == "scale"


def test_sampled_gradients_per_group_with_the_group_norm(tmp_path):
    torch.manual_seed(1)
    net = Net()
    _grads(net)
    with ffdebug.capture(dir=str(tmp_path), side="ref", grad_sample=3):
        with ffdebug.step(optimizer_step=0, phase="train"):
            ffdebug.tap_grads("policy", net.named_parameters())
    records = {r.key: to_torch(r.load()) for r in open_side(tmp_path / "ref").records}
    assert list(records) == [
        "grad.policy.blocks.0",
        "grad_norm.policy.blocks.0",
        "grad.policy.blocks.1",
        "grad_norm.policy.blocks.1",
        "grad.policy.head",
        "grad_norm.policy.head",
    ]
    w, b = net.blocks[0].weight, net.blocks[0].bias
    expected = torch.cat(
        [
            w.grad.flatten()[_documented_indices("blocks.0.weight", (4, 5), 3)],
            b.grad.flatten()[_documented_indices("blocks.0.bias", (4,), 3)],
        ]
    )
    assert torch.equal(records["grad.policy.blocks.0"], expected)
    full = torch.cat([w.grad.flatten(), b.grad.flatten()]).double()
    assert records["grad_norm.policy.blocks.0"].item() == pytest.approx(float(full.norm()), rel=1e-6)
    assert records["grad.policy.blocks.1"].numel() == 3 + 2  # a 2-element bias is taken whole
    assert torch.count_nonzero(records["grad.policy.head"]) == 0  # no gradient: zeros, norm 0
    assert records["grad_norm.policy.head"].item() == 0.0


def test_off_by_default_and_a_bad_count_names_the_variable(tmp_path):
    net = Net()
    _grads(net)
    with ffdebug.capture(dir=str(tmp_path), side="ref"):
        with ffdebug.step(optimizer_step=0, phase="train"):
            ffdebug.tap_grads("policy", net.named_parameters())
            ffdebug.tap("loss.policy", torch.ones(()))
    assert [r.key for r in open_side(tmp_path / "ref").records] == ["loss.policy"]

    from ffdebug._env import read_dump_config

    env = {"FFDEBUG_FWD_DUMP_DIR": str(tmp_path / "env"), "FFDEBUG_FWD_DUMP_GRAD_SAMPLE": "many"}
    with pytest.raises(FFDebugError, match="FFDEBUG_FWD_DUMP_GRAD_SAMPLE"):
        read_dump_config(env)
    assert read_dump_config({**env, "FFDEBUG_FWD_DUMP_GRAD_SAMPLE": "16"}).grad_sample == 16
