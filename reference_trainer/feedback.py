"""Runtime-reward feedback: the arguments and the scoring call shared by ``generation+runtime_reward`` trainers.

GRPO and online DPO (contract ``GENERATION_REWARD``) roll out P prompts × K samples in contiguous
groups (``data.repeat_groups``), decode the final latents, score the images with the configured
rewards and turn the rewards into group-relative advantages; only what they do with the advantages
differs (a PPO-clip ratio vs best/worst pairs). ``GenerationRewardArguments`` holds the fields that
describe the shared part, validated once; ``RewardFeedback`` is the scoring:

1. r_k = reward k of every decoded image, [B] fp32 (``RewardProcessor``: finite, one value per input);
2. r = Σ_k w_k·r_k, the logged total (``reward_mean``, ``reward_std`` with ddof = 0, ``reward.<name>``),
   with the weights w_k of ``advantage.weights`` (1 when not listed);
3. A = ``AdvantageProcessor``({r_k}, group ids), [B] fp32 (``reference_trainer.advantages``).

It taps ``reward`` (r) and ``advantage`` (A) for ffdebug. Under several processes the advantages are
group-normalised over every rank's samples and the metrics are over all of them (``reward_mean`` of
the whole rollout iteration, not of rank 0's share).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

import ffdebug
from reference_trainer.advantages import AdvantageConfig, AdvantageProcessor, gather_rows
from reference_trainer.config import RewardSpec, RolloutSize, TrainingArguments, require_unique_rewards
from reference_trainer.contracts import GENERATION_REWARD, ExecutionContract
from reference_trainer.errors import require
from reference_trainer.rewards import RewardProcessor


@dataclass(frozen=True, kw_only=True)
class GenerationRewardArguments(TrainingArguments):
    """Arguments shared by generation + runtime-reward trainers (GRPO, online DPO)."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    group_size: int = 4
    """K: samples per prompt, one advantage group (sample i is in group i // K)."""
    prompts_per_iteration: int = 2
    """P: distinct prompts per rollout iteration (rank-local); B = P·K samples."""
    num_inference_steps: int = 4
    """T: denoising steps of a rollout."""
    noise_level: float = 0.7
    """a: the Flow-SDE noise scale of the rollout (flow_grpo ``noise_level``); 0 = deterministic ODE."""
    rewards: tuple[RewardSpec, ...] = (RewardSpec(name="brightness"),)
    """Rewards computed on the decoded images (``reference-trainer list``)."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """How rewards become advantages (group normalisation, aggregation, weights)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.group_size >= 2,
            "group_size",
            f"must be >= 2 (advantages are group-relative), got {self.group_size}",
        )
        require(
            self.prompts_per_iteration >= 1,
            "prompts_per_iteration",
            f"must be >= 1, got {self.prompts_per_iteration}",
        )
        require(self.noise_level >= 0, "noise_level", f"must be >= 0, got {self.noise_level}")
        # the SDE step at σ_0 = 1 divides by 1 − σ; flow_grpo uses the schedule's σ_1 there (sde.py)
        min_steps = 2 if self.noise_level > 0 else 1
        require(
            self.num_inference_steps >= min_steps,
            "num_inference_steps",
            f"must be >= {min_steps} with noise_level={self.noise_level}, got {self.num_inference_steps}",
        )
        require(len(self.rewards) >= 1, "rewards", "needs at least one reward")
        require_unique_rewards(self.rewards)
        names = [spec.name for spec in self.rewards]
        for name in self.advantage.weights:
            require(
                name in names, f"advantage.weights.{name}", f"is not a configured reward; rewards: {names}"
            )

    def rollout_size(self) -> RolloutSize:
        """P·K Flow-SDE trajectories of T steps each."""
        return RolloutSize(
            (
                ("train.prompts_per_iteration", self.prompts_per_iteration),
                ("train.group_size", self.group_size),
            ),
            ("train.num_inference_steps", self.num_inference_steps),
        )


class RewardFeedback:
    """Decoded images -> (advantages [B] fp32, metrics); steps 1-3 of the module docstring."""

    def __init__(self, args: GenerationRewardArguments) -> None:
        self.weights = args.advantage.weights
        self.reward_processor = RewardProcessor(args.rewards)
        self.advantage_processor = AdvantageProcessor(args.advantage)

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], group_ids: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        rewards = self.reward_processor(images, prompts, group_ids)
        total = sum(float(self.weights.get(name, 1.0)) * values for name, values in rewards.items())
        ffdebug.tap("reward", total)
        advantages, advantage_metrics = self.advantage_processor(rewards, group_ids)
        ffdebug.tap("advantage", advantages)
        everyone = gather_rows(total)
        metrics = {
            "reward_mean": float(everyone.mean()),
            "reward_std": float(everyone.std(unbiased=False)),
        }
        metrics.update(
            {f"reward.{name}": float(gather_rows(values).mean()) for name, values in rewards.items()}
        )
        metrics.update(advantage_metrics)
        return advantages, metrics
