"""Run under ``torchrun --nproc-per-node 2`` by ``tests/trainer/test_distributed.py`` (not a test module; the test puts
``tests/`` on ``PYTHONPATH`` with ``helpers.subprocess_env``).

distributed_driver.py probe OUT
    DDP gradient vs the single-process gradient on the concatenated batch, the two-prompt
    AdvantageProcessor case, DistributedSampler shards; rank 0 writes OUT/probe.json.
distributed_driver.py resume OUT TRAINER N M [key=value ...]
    a straight N-step run into OUT/straight, then an M-step run into OUT/cut resumed to N (all with
    backend.kind=ddp); the test compares the two directories.
distributed_driver.py parity OUT KIND N [key=value ...]
    every example config of every registered trainer in turn (``trainer_utils.parity_cases``), N steps
    each with backend.kind=KIND, each
    rank on its share of the one-process global batch (``trainer_utils.rank_split``), once per mode of
    ``trainer_utils.PARITY_MODES`` (the example learning rates; every learning rate at 1e-12), into
    OUT/<mode>/<trainer>; the trained run again cut after N − 1 steps and resumed to N, into
    OUT/cut/<trainer>.
distributed_driver.py straight OUT TRAINER N [key=value ...]
    one N-step run into OUT/straight (backend.kind=ddp), e.g. for a one-rank comparison.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

from helpers.trainer.trainer_utils import (
    PARITY_MODES,
    example,
    load,
    parity_cases,
    rank_split,
    still_overrides,
)


def probe(out: Path) -> None:
    from reference_trainer.advantages import AdvantageConfig, AdvantageProcessor
    from reference_trainer.data import DatasetAcquisition, repeat_groups
    from reference_trainer.run import build_trainer

    trainer = build_trainer(load(example("grpo"), "backend.kind=ddp"), out / "run")
    backend, adapter = trainer.backend, trainer.adapter
    rank, world = backend.rank, backend.world_size
    prepared = adapter.get_component("transformer")
    native = trainer.variants.variants["policy"]
    result: dict = {
        "world_size": world,
        "prepared_type": type(prepared).__name__,
        "routed": trainer.variants.variant("policy") is prepared and prepared.module is native,
        "optimizer_children": [type(child).__name__ for child in trainer.optim.optimizer.children],
    }
    # 1. the DDP gradient of this rank's 2 samples vs one process's gradient on all 2·world samples
    reference = copy.deepcopy(native)
    prompts = ["a red cat", "a blue dog", "a green tree", "a yellow sun"][rank * 2 : rank * 2 + 2]
    condition = trainer.conditions.get(prompts)
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn((2, *adapter.latent_shape), generator=generator)
    sigma = torch.rand(2, generator=generator)
    adapter.forward(x, sigma, condition).square().mean().backward()  # module=None: the routed component
    ddp_grads = {key: p.grad.clone() for key, p in native.named_parameters()}
    rows = backend.gather_rows
    everything = type(condition)(rows(condition.prompt_embeds), rows(condition.pooled))
    adapter.forward(rows(x), rows(sigma), everything, module=reference).square().mean().backward()
    differences = {
        key: float((ddp_grads[key] - p.grad).abs().max()) for key, p in reference.named_parameters()
    }
    scale = max(float(p.grad.abs().max()) for p in reference.parameters())
    close = all(
        torch.allclose(ddp_grads[key], p.grad, rtol=1e-5, atol=1e-6 * scale)
        for key, p in reference.named_parameters()
    )
    local_only = copy.deepcopy(native)  # the gradient without the all-reduce differs: the check can fail
    adapter.forward(x, sigma, condition, module=local_only).square().mean().backward()
    local_difference = max(
        float((p.grad - ddp_grads[key]).abs().max()) for key, p in local_only.named_parameters()
    )
    result.update(
        grad_max_abs_difference=max(differences.values()),
        grad_max_abs=scale,
        grad_allclose=close,
        local_grad_max_abs_difference=local_difference,
    )
    # 2. prompt "a" on rank 0, "b" on rank 1, two samples each, global group ids
    rewards = {0: [0.0, 1.0], 1: [5.0, 7.0]}[rank]
    _, group_ids = repeat_groups(["a" if rank == 0 else "b"], 2, first_group=rank)
    processor = AdvantageProcessor(AdvantageConfig())
    advantages, _ = processor({"r": torch.tensor(rewards)}, group_ids)
    rank_local, _ = processor({"r": torch.tensor(rewards)}, torch.zeros(2, dtype=torch.int64))
    result["advantages"] = backend.gather_objects(advantages.tolist())
    result["advantages_rank_local_ids"] = backend.gather_objects(rank_local.tolist())
    # 3. DistributedSampler shards: disjoint, covering the 8 records, every epoch
    records = [{"prompt": str(i)} for i in range(8)]
    shards = {}
    for epoch in range(2):
        dataset = DatasetAcquisition(records, batch_size=2, seed=0, shuffle=True, rank=rank, world_size=world)
        mine = [i for batch in dataset.epoch(epoch) for i in batch["indices"]]
        shards[epoch] = [backend.gather_objects([mine])][0]
    result["shards"] = shards
    if backend.is_main:
        (out / "probe.json").write_text(json.dumps(result, indent=2))


def resume(out: Path, trainer: str, n: int, m: int, overrides: list[str]) -> None:
    from reference_trainer.run import train

    config = (example(trainer), "backend.kind=ddp", *overrides)
    train(load(*config, max_steps=n), out / "straight")
    train(load(*config, max_steps=m), out / "cut")
    train(load(*config, max_steps=n), out / "cut", resume="latest")


def parity(out: Path, kind: str, n: int, overrides: list[str]) -> None:
    from reference_trainer.errors import ConfigError
    from reference_trainer.run import train

    for name, path in parity_cases().items():
        for mode in PARITY_MODES:
            extra = [f"backend.kind={kind}", *overrides, *still_overrides(path, mode)]
            config = (path, *extra, *rank_split(path, 2, *extra))
            try:
                train(load(*config, max_steps=n), out / mode / name)
            except ConfigError as error:  # a plan rule of this backend: the test says which
                (out / mode / name).mkdir(parents=True, exist_ok=True)
                (out / mode / name / "refused.txt").write_text(str(error))
                break
            if (
                mode == "trained"
            ):  # the same run cut after step n − 1 (inside a cycle where it has several steps) and resumed
                train(load(*config, max_steps=n - 1), out / "cut" / name)
                train(load(*config, max_steps=n), out / "cut" / name, resume="latest")


if __name__ == "__main__":
    torch.set_num_threads(1)
    mode, out = sys.argv[1], Path(sys.argv[2])
    if mode == "probe":
        probe(out)
    elif mode == "parity":
        parity(out, sys.argv[3], int(sys.argv[4]), sys.argv[5:])
    elif mode == "straight":
        from reference_trainer.run import train

        config = (example(sys.argv[3]), "backend.kind=ddp", *sys.argv[5:])
        train(load(*config, max_steps=int(sys.argv[4])), out / "straight")
    else:
        resume(out, sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:])
    from reference_trainer.distributed import shutdown

    shutdown()
