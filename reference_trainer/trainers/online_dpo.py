"""Online Diffusion-DPO: generate groups, pair the best and worst sample of each group by reward, DPO loss.

Loss: Wallace et al. 2023, "Diffusion Model Alignment Using Direct Preference Optimization", arXiv
2311.12908, eq. 14, in its flow-matching form (``reference_trainer.losses.dpo``). Online pairing:
yifan123/flow_grpo ``scripts/train_sd3_dpo.py`` and Flow-Factory ``trainers/dpo.py`` (generation +
runtime reward; pairs = best / worst advantage within each group, formed at the start of ``optimize``;
defaults ``beta 2000``, ``num_train_timesteps 1``, logit-normal σ).

One rollout iteration:

1. ``sample``: draw P prompts, repeat each K times (contiguous groups); roll out from the current
   policy (Flow-SDE with ``noise_level > 0``, else the ODE), keep the final latents x_0 [B, C, H, W];
   decode, compute rewards and group-normalised advantages (``feedback.RewardFeedback``);
2. ``optimize``: in every group take w = argmax A, l = argmin A (a group whose advantages are all
   equal has no preference and is skipped); the pair shares its prompt, hence its condition. Then
   ``gradient_steps_per_iteration`` optimizer steps of the ``policy`` role, each with fresh (σ, ε)
   shared by both arms of a pair: L = −log σ(−β/2·((e_θ^w − e_ref^w) − (e_θ^l − e_ref^l))).

Roles: ``policy`` (trainable, the base variant) and ``reference`` (a frozen snapshot of the initial
policy, used through ``functional_call``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

import ffdebug
from reference_trainer.adapters.base import Condition
from reference_trainer.contracts import GENERATION_REWARD, ExecutionContract
from reference_trainer.data import repeat_groups
from reference_trainer.errors import require
from reference_trainer.feedback import GenerationRewardArguments, RewardFeedback
from reference_trainer.flow_matching import check_sigma_sampling
from reference_trainer.losses.dpo import diffusion_dpo_loss, pair_errors
from reference_trainer.registry import register_trainer
from reference_trainer.taps import tap_rollout_inputs
from reference_trainer.trainers.base import BaseTrainer


@dataclass(frozen=True, kw_only=True)
class OnlineDPOArguments(GenerationRewardArguments):
    """``train:`` section of an online Diffusion-DPO run.

    Rollout, reward and advantage fields (``group_size`` K, ``num_inference_steps`` T, ``noise_level``
    a, 0 = ODE, ``rewards``, ``advantage``): see ``GenerationRewardArguments``; the pair of a group is
    its arg-max / arg-min advantage.
    """

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    prompts_per_iteration: int = 4
    """P: distinct prompts (= at most P pairs) per rollout iteration (rank-local)."""
    gradient_steps_per_iteration: int = 1
    """Optimizer steps per rollout iteration, each on all pairs with fresh (σ, ε)."""
    beta: float = 2000.0
    """β of the DPO logit (Flow-Factory ``dpo`` default 2000)."""
    sigma_scheme: str = "logit_normal"
    """Training σ: ``logit_normal`` (mean 0, std 1) or ``uniform``."""
    sigma_min: float = 0.01
    """Lower clamp of the training σ."""
    sigma_max: float = 0.99
    """Upper clamp of the training σ (Flow-Factory ``timestep_range`` 0.99)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.gradient_steps_per_iteration >= 1,
            "gradient_steps_per_iteration",
            f"must be >= 1, got {self.gradient_steps_per_iteration}",
        )
        require(self.beta > 0, "beta", f"must be > 0, got {self.beta}")
        check_sigma_sampling(self.sigma_scheme, self.sigma_min, self.sigma_max)


@dataclass(frozen=True)
class OnlineDPOSamples:
    """One rollout iteration: B = P·K generated samples."""

    condition: Condition  # [B, ...]
    x0: torch.Tensor  # final latents [B, C, H, W]
    group_ids: torch.Tensor  # [B]
    advantages: torch.Tensor  # [B] fp32


def best_worst_pairs(advantages: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices (chosen [N], rejected [N]) of the arg-max / arg-min advantage of every group whose
    advantages are not all equal, groups in order of first appearance (ties: the first index).

    Args:
        advantages: A per sample, [B].
        group_ids: the group of each sample, [B].

    Returns:
        ``(chosen, rejected)`` sample indices, [N] each (N = 0 when no group has a spread).
    """
    chosen, rejected = [], []
    for gid in dict.fromkeys(group_ids.tolist()):
        members = (group_ids == gid).nonzero().flatten()
        values = advantages[members]
        if bool(values.max() > values.min()):
            chosen.append(members[values.argmax()])
            rejected.append(members[values.argmin()])
    if not chosen:  # every group tied
        empty = torch.empty(0, dtype=torch.long)
        return empty, empty
    return torch.stack(chosen), torch.stack(rejected)


@register_trainer("online_dpo", arguments=OnlineDPOArguments)
class OnlineDPOTrainer(BaseTrainer):
    """Online Diffusion-DPO (module docstring)."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    roles: ClassVar[tuple[str, ...]] = ("policy",)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.feedback = RewardFeedback(self.args)

    def setup_roles(self) -> dict[str, str]:
        """The ``policy`` variant and the frozen ``reference`` snapshot.

        Returns:
            ``{role: variant name}``.
        """
        self.variants.declare_variant("policy")
        self.variants.add_snapshot("reference", "policy")
        return {"policy": "policy"}

    # ---------------------------------------------------------------- acquisition + feedback
    def sample(self) -> OnlineDPOSamples:
        """Rollout, rewards and advantages of one iteration (module docstring).

        Returns:
            The ``OnlineDPOSamples`` of this iteration.
        """
        args: OnlineDPOArguments = self.args  # type: ignore[assignment]
        prompts = self.rollout_prompts(args.prompts_per_iteration, args.group_size)
        first_group = self.backend.rank * args.prompts_per_iteration  # global group ids
        repeated, group_ids = repeat_groups(prompts, args.group_size, first_group)
        condition = self.conditions.get(repeated)
        trajectory = self.adapter.inference(
            condition,
            num_steps=args.num_inference_steps,
            noise_level=args.noise_level,
            generator=self.sample_generators("rollout", self.rollout_iteration, count=len(repeated)),
            module=self.variants.variant("policy"),
            given=self.rollout_given(args.num_inference_steps, args.noise_level),
        )
        tap_rollout_inputs(self.adapter, repeated, trajectory, num_steps_field="train.num_inference_steps")
        x0 = trajectory.final
        ffdebug.tap("rollout.latents", trajectory.latents)
        if trajectory.log_probs is not None:
            ffdebug.tap("rollout.log_prob", trajectory.log_probs)
        images = self.adapter.decode_latents(x0)
        advantages, self.cycle_metrics = self.feedback(images, repeated, group_ids)
        return OnlineDPOSamples(condition, x0, group_ids, advantages)

    # ---------------------------------------------------------------- optimisation
    def optimize(self, samples: OnlineDPOSamples) -> None:
        """The DPO steps on the best / worst pairs of the iteration (module docstring).

        Args:
            samples: what ``sample`` returned.
        """
        args: OnlineDPOArguments = self.args  # type: ignore[assignment]
        chosen, rejected = best_worst_pairs(samples.advantages, samples.group_ids)
        # groups never span ranks, so pairs are formed locally; the loss is the mean over every rank's
        # pairs: this rank's mean weighted by its share (DDP averages the ranks' gradients)
        pairs, world = self.backend.sum(len(chosen)), self.backend.world_size
        self.cycle_metrics["pairs"] = float(pairs)
        if pairs == 0:  # every group tied on every rank: no preference, no optimizer step this iteration
            return
        weight = len(chosen) * world / pairs
        if len(chosen) == 0:  # a rank without pairs still joins the step's gradient reduction, weight 0
            chosen = rejected = torch.zeros(1, dtype=torch.long)
        x0_w, x0_l = samples.x0[chosen], samples.x0[rejected]
        condition = samples.condition.select(chosen)  # chosen and rejected share the group's prompt
        condition2 = Condition.cat([condition, condition])
        policy, reference = self.variants.variant("policy"), self.variants.snapshot("reference")
        for s in self.cycle_steps(range(args.gradient_steps_per_iteration)):
            # one generator per pair, seeded by its global group id: the draws do not depend on the rank
            generator = [
                self.generator("online_dpo", self.rollout_iteration, s, int(g))
                for g in samples.group_ids[chosen]
            ]
            with ffdebug.step(**self.step_tags("train")), self.optim.phase("policy") as phase:
                sigma, noise = self.drawn_sigma_noise(x0_w.shape, args, generator)  # ε shared by both arms
                errors = pair_errors(
                    x0_w,
                    x0_l,
                    sigma,
                    noise,
                    lambda x_t, s2: self.adapter.forward(x_t, s2, condition2, module=policy),
                    lambda x_t, s2: self.adapter.forward(x_t, s2, condition2, parameters=reference),
                )
                ffdebug.tap("train.dpo_errors", torch.stack(errors))
                loss, metrics = diffusion_dpo_loss(*errors, beta=args.beta)
                metrics.pop("loss")
                phase.backward(loss * weight, metrics)
