"""Run under ``torchrun --nproc-per-node 2`` by ``tests/trainer/test_fsdp2.py`` (not a test module; the test puts
``tests/`` on ``PYTHONPATH`` with ``helpers.subprocess_env``).

fsdp2_driver.py probe OUT
    builds GRPO and DMD2 trainers with backend.kind=fsdp2 and records, on rank 0, into OUT/probe.json:
    the parameter / optimizer types and identities after prepare; three AdamW steps through the
    trainer's own role phase against a one-process AdamW on the concatenated batch; a functional call
    with a snapshot (zeros) against the same call on a plain module; how often a block's forward runs
    in one forward + backward with and without ``backend.activation_checkpointing: full``.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

from helpers.trainer.trainer_utils import example, load

FSDP2 = "backend.kind=fsdp2"


def build(trainer: str, out: Path, *overrides: str):
    from reference_trainer.run import build_trainer

    out.mkdir(parents=True, exist_ok=True)  # the role phases below log their steps there
    return build_trainer(load(example(trainer), FSDP2, *overrides), out)


def layout(trainer) -> dict:
    """Types after prepare, and whether the optimizer holds exactly the variants' trainable parameters."""
    from torch.distributed.tensor import DTensor

    trainable = [p for m in trainer.variants.variants.values() for p in m.parameters() if p.requires_grad]
    held = [p for group in trainer.optim.optimizer.param_groups for p in group["params"]]
    owned = [p for params in trainer.optim.roles.values() for p in params]
    return {
        "trainable": len(trainable),
        "trainable_dtensor": sum(isinstance(p, DTensor) for p in trainable),
        "held": len(held),
        "held_is_trainable": sorted(map(id, held)) == sorted(map(id, trainable)),
        "roles_are_held": sorted(map(id, owned)) == sorted(map(id, held)),
        "placements": sorted({str(p.placements) for p in trainable if isinstance(p, DTensor)}),
        "roles": {role: len(params) for role, params in trainer.optim.roles.items()},
    }


def adamw_steps(trainer, steps: int = 3) -> dict:
    """Three steps of a velocity MSE through ``optim.phase``, each rank on its 2 samples, against one
    process stepping an unsharded copy on all 4 with the same optimizer configuration (its forward and
    backward run per rank part, so both sides use the same kernels; the loss is the mean of the parts)."""
    from reference_trainer.optim import build_optimizer
    from reference_trainer.sharding import full_tensors

    backend, adapter, variants = trainer.backend, trainer.adapter, trainer.variants
    full = full_tensors(variants.state_tensors())
    reference = copy.deepcopy(variants.variant("policy").template)
    reference.load_state_dict(
        {k[len("variant.policy.") :]: v.clone() for k, v in full.items() if k.startswith("variant.policy.")},
        assign=True,
    )
    reference.requires_grad_(True)
    optimizer = build_optimizer(
        {"policy": list(reference.parameters())}, {"policy": trainer.config.optimizer_for("policy")}
    )
    prompts = ["a red cat", "a blue dog", "a green tree", "a yellow sun"]
    condition = trainer.conditions.get(prompts)
    generator = torch.Generator().manual_seed(7)
    mine = slice(2 * backend.rank, 2 * backend.rank + 2)
    for _ in range(steps):
        x = torch.randn((4, *adapter.latent_shape), generator=generator)
        sigma = torch.rand(4, generator=generator)
        with trainer.optim.phase("policy") as phase:
            phase.backward(adapter.forward(x[mine], sigma[mine], condition.select(mine)).square().mean())
        for rank in range(backend.world_size):  # each rank's 2 samples as the ranks run them (same kernels)
            part = slice(2 * rank, 2 * rank + 2)
            velocity = adapter.forward(x[part], sigma[part], condition.select(part), module=reference)
            (velocity.square().mean() / backend.world_size).backward()
        torch.nn.utils.clip_grad_norm_(list(reference.parameters()), trainer.args.max_grad_norm)
        optimizer.step("policy")
        optimizer.zero_grad()
    after = full_tensors(variants.state_tensors())
    differences = [
        float((after[f"variant.policy.{key}"] - p.detach()).abs().max())
        for key, p in reference.named_parameters()
    ]
    moved = max(
        float((after[f"variant.policy.{key}"] - full[f"variant.policy.{key}"]).abs().max())
        for key, _ in reference.named_parameters()
    )
    return {"max_abs_difference": max(differences), "max_abs_update": moved}


def snapshot_call(trainer) -> dict:
    """A forward with an all-zero snapshot runs the snapshot, not the live (sharded) weights."""
    adapter = trainer.adapter
    module = trainer.variants.variant("policy")
    zeros = {key: torch.zeros_like(p) for key, p in trainer.variants.snapshot("reference").items()}
    plain = copy.deepcopy(module.template)
    plain.load_state_dict({**plain.state_dict(), **zeros}, assign=True)
    condition = trainer.conditions.get(["a red cat"])
    x, sigma = torch.ones((1, *adapter.latent_shape)), torch.tensor([0.5])
    with torch.no_grad():
        snapshot = adapter.forward(x, sigma, condition, parameters=zeros)
        expected = adapter.forward(x, sigma, condition, module=plain)
        live = adapter.forward(x, sigma, condition)
    return {
        "snapshot_equals_plain": bool(torch.equal(snapshot, expected)),
        "live_differs": bool((live - expected).abs().max() > 1e-3),
    }


def block_forwards(trainer) -> int:
    """Forward calls of the first block during one forward + backward of the routed variant."""
    from reference_trainer.fsdp import blocks

    calls = []
    block = blocks(trainer.variants.variants["policy"])[0]
    handle = block.register_forward_pre_hook(lambda *_: calls.append(1))
    adapter = trainer.adapter
    condition = trainer.conditions.get(["a red cat"])
    x, sigma = torch.ones((1, *adapter.latent_shape)), torch.tensor([0.5])
    with trainer.optim.phase("policy") as phase:
        phase.backward(adapter.forward(x, sigma, condition).square().mean())
    handle.remove()
    return len(calls)


def probe(out: Path) -> None:
    grpo = build("grpo", out / "grpo", "train.kl_beta=0.1")
    result = {"grpo": layout(grpo), "world_size": grpo.backend.world_size}
    result["snapshot"] = snapshot_call(grpo)
    result["adamw"] = adamw_steps(grpo)
    result["block_forwards"] = block_forwards(grpo)
    checkpointed = build("grpo", out / "grpo-ac", "backend.activation_checkpointing=full")
    result["block_forwards_checkpointed"] = block_forwards(checkpointed)
    result["dmd2"] = layout(build("dmd2", out / "dmd2"))
    if grpo.backend.is_main:
        (out / "probe.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    torch.set_num_threads(1)
    probe(Path(sys.argv[2]))
    from reference_trainer.distributed import shutdown

    shutdown()
