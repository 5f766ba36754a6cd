"""Helpers shared by the reference-trainer framework tests (not a test module; the algorithm tests use trainer_utils.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
GRPO_CONFIG = REPO / "examples/grpo/full/sd3_tiny/default.yaml"


def load(config: Path | str = GRPO_CONFIG, *overrides: str, max_steps: int | None = None):
    from reference_trainer.config import load_config

    return load_config(config, overrides=overrides, max_steps=max_steps)


def metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def state_digest(module: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (names and bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def clone_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


@torch.no_grad()
def eval_reward(trainer, samples_per_prompt: int = 4, seed: int = 1234) -> float:
    """Mean training reward of the current policy on every configured prompt, with fixed noise."""
    prompts = list(trainer.prompts.prompts)
    repeated = [prompt for prompt in prompts for _ in range(samples_per_prompt)]
    condition = trainer.conditions.get(repeated)
    trajectory = trainer.adapter.inference(
        condition,
        num_steps=trainer.args.num_inference_steps,
        noise_level=trainer.args.noise_level,
        generator=torch.Generator().manual_seed(seed),
        module=trainer.variants.variant("policy"),
    )
    images = trainer.adapter.decode_latents(trajectory.final)
    group_ids = torch.arange(len(prompts)).repeat_interleave(samples_per_prompt)
    rewards = trainer.feedback.reward_processor(images, repeated, group_ids)
    return float(sum(values for values in rewards.values()).mean())
