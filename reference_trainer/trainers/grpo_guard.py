"""GRPO-Guard: Flow-GRPO whose PPO clip acts on a normalised, step-consistent log-ratio (RatioNorm).

Paper: Wang et al. 2025, "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via
Regulated Clipping", arXiv 2510.22319. Code: X-GenGroup/Flow-Factory ``src/flow_factory/trainers/grpo.py``
@ a0b2bc5a, ``GRPOGuardTrainer`` (a subclass of its ``GRPOTrainer``, as here). The maths, its
derivation and what could not be verified are in ``reference_trainer.losses.grpo_guard``.

One rollout iteration is GRPO's (``trainers.grpo``): the same rollout, rewards, advantages, shuffled
minibatches and trained steps. What changes, per trained step j of samples ``index``:

1. the policy's transition x_j -> x_{j+1}: log p_θ [b] and mean μ_θ [b, C, H, W] (with gradients);
2. the rollout policy's mean μ_old, recomputed from the velocity the sampler stored (Flow-Factory stores
   ``next_latents_mean`` instead; the same value: the mean is an elementwise function of v, x_j, σ);
3. log r̃ = (log p_θ − log p_old)·s + mean_dims(μ_θ − μ_old)²/(2s), s = σ_t·√(−Δt) [b];
4. GRPO's PPO clip on r̃ = exp(log r̃), weighted by 1/|Δt_j| (the paper's gradient reweighting, from the
   official flow_grpo script; ``dt_reweighting: false`` is Flow-Factory's form without it) (+ GRPO's
   optional KL to the reference).

Roles and snapshots are GRPO's: ``policy`` (trainable); ``reference`` (a frozen snapshot of the initial
policy, only when ``kl_beta > 0``). Taps (besides GRPO's ``rollout.*``, ``reward``, ``advantage``,
``loss.policy``, ``grad_norm.policy``): ``rollout.velocity``, ``train.mean``, ``train.mean_old``,
``train.log_ratio`` (log r̃), each per trained step and microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

import ffdebug
from reference_trainer.contracts import GENERATION_REWARD, ExecutionContract
from reference_trainer.losses import grpo_guard as guard_losses
from reference_trainer.registry import register_trainer
from reference_trainer.trainers.grpo import GRPOArguments, GRPOSamples, GRPOTrainer


@dataclass(frozen=True, kw_only=True)
class GRPOGuardArguments(GRPOArguments):
    """``train:`` section of a GRPO-Guard run: GRPO's fields (``GRPOArguments``) and the reweighting.

    Flow-Factory's ``grpo-guard`` uses GRPO's training arguments unchanged; ``clip_range`` ε now bounds
    the normalised ratio r̃. The transition is always the Flow-SDE (Flow-Factory ``guidance/algorithms.md``:
    the guard "is only compatible with Flow-GRPO dynamics"), which is the only SDE this trainer samples.
    """

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    dt_reweighting: bool = True
    """The paper's second component: each step's policy loss divided by |Δt_j| = σ_j − σ_{j+1}, which
    equalises the gradient over noise levels (the official flow_grpo ``scripts/train_sd3_GRPO_Guard.py``
    @ 2e2f712e, under ``config.rationorm``: ``policy_loss = policy_loss / (sqrt_dt.mean()**2)``); false:
    Flow-Factory's ``grpo-guard``, which has RatioNorm only."""


@register_trainer("grpo_guard", arguments=GRPOGuardArguments)
class GRPOGuardTrainer(GRPOTrainer):
    """GRPO-Guard (module docstring)."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    roles: ClassVar[tuple[str, ...]] = ("policy",)
    uses_rollout_velocities: ClassVar[bool] = True

    def step_loss(
        self, samples: GRPOSamples, index: torch.Tensor, j: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The GRPO-Guard loss of samples ``index`` at denoising step j (module docstring, steps 1-4).

        Args:
            samples: this iteration's samples.
            index: the samples of the microbatch, [b].
            j: the denoising step.

        Returns:
            The loss and its metrics.
        """
        args = self.args
        _, step, sde_args = self.policy_step(samples, index, j)
        _, old = self.rollout_step(samples, index, j, sde_args)
        log_ratio = guard_losses.normalised_log_ratio(
            step.log_prob,
            samples.trajectory.log_probs[index, j],
            step.mean,
            old.mean,
            step.step_std,
        )
        ffdebug.tap("train.mean", step.mean)
        ffdebug.tap("train.mean_old", old.mean)
        ffdebug.tap("train.log_ratio", log_ratio)
        ref_mean = self.reference_mean(samples, index, j, sde_args) if args.kl_beta > 0 else None
        return guard_losses.grpo_guard_loss(
            log_ratio,
            samples.advantages[index],
            clip_range=args.clip_range,
            adv_clip_max=args.adv_clip_max,
            kl_beta=args.kl_beta,
            mean=step.mean,
            ref_mean=ref_mean,
            kl_std=self.kl_std(step),
            step_weight=self.step_weight(samples, j),
        )

    def step_weight(self, samples: GRPOSamples, j: int) -> float:
        """1/|Δt_j| = 1/(σ_j − σ_{j+1}) with ``dt_reweighting``, else 1 (``GRPOGuardArguments``)."""
        if not self.args.dt_reweighting:
            return 1.0
        sigmas = samples.trajectory.sigmas
        return 1.0 / float(sigmas[j] - sigmas[j + 1])
