"""Flow-DPPO: Flow-GRPO with a divergence trust-region mask in place of the PPO ratio clip.

Code: Jayce-Ping/Flow-Factory-Draft ``src/flow_factory/trainers/dppo.py`` @ 42b71566 (``DPPOTrainer``, a
subclass of its ``GRPOTrainer``, as here); arguments as X-GenGroup/Flow-Factory
``src/flow_factory/hparams/training_args/dppo.py`` @ c5b89b17. The maths is in
``reference_trainer.losses.dppo``.

One rollout iteration is GRPO's (``trainers.grpo``): the same rollout, rewards, advantages, shuffled
minibatches and trained steps. Per trained step j of samples ``index``:

1. the policy's transition: v_θ, log p_θ [b] and mean μ_θ (with gradients);
2. the rollout policy's v_old (stored by the sampler) and its mean μ_old (recomputed, no graph);
3. D = KL(π_θ ‖ π_old) per sample: x-based mean_dims (μ_θ − μ_old)²/(2s²), or v-based mean_dims (v_θ − v_old)²;
4. keep = ¬(D ≥ τ ∧ the ratio moved the way the advantage pushes); L = mean(−Â·r·keep) (+ GRPO's KL).

With one optimizer step per rollout iteration θ = θ_old throughout (D = 0, the mask keeps everything);
the mask acts from the second minibatch of an iteration on (``gradient_steps_per_iteration`` ≥ 2).

Roles and snapshots are GRPO's: ``policy`` (trainable); ``reference`` (a frozen snapshot of the initial
policy, only when ``kl_beta > 0``). Taps (besides GRPO's): ``rollout.velocity``, ``train.mean``,
``train.mean_old`` (x-based) or ``train.velocity`` / ``train.velocity_old`` (v-based),
``train.log_ratio`` (log p_θ − log p_old), ``train.kl_new_old`` (D), ``train.keep`` (the mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch

import ffdebug
from reference_trainer.contracts import GENERATION_REWARD, ExecutionContract
from reference_trainer.errors import require
from reference_trainer.losses import dppo as dppo_losses
from reference_trainer.registry import register_trainer
from reference_trainer.trainers.grpo import GRPOArguments, GRPOSamples, GRPOTrainer


@dataclass(frozen=True, kw_only=True)
class DPPOArguments(GRPOArguments):
    """``train:`` section of a Flow-DPPO run: GRPO's fields less ``clip_range``, plus the trust region.

    Defaults: Flow-Factory ``hparams/training_args/dppo.py`` (``kl_mask_threshold`` 1e-6,
    ``kl_mask_type`` "x-based").
    """

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    clip_range: float = field(default=GRPOArguments.clip_range, init=False, repr=False)
    """Not a DPPO field: there is no ratio clip (setting it in a config is an unknown-field error)."""
    kl_mask_threshold: float = 1.0e-6
    """τ: a sample whose per-step D = KL(π_θ ‖ π_old) is ≥ τ and that moves further is masked."""
    kl_mask_type: Literal["x-based", "v-based"] = "x-based"
    """Space of D: "x-based" the Gaussian KL of the transition means, "v-based" the velocity squared error."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.kl_mask_threshold > 0,
            "kl_mask_threshold",
            f"must be > 0, got {self.kl_mask_threshold}",
        )
        require(
            self.kl_mask_type in ("x-based", "v-based"),
            "kl_mask_type",
            f"must be 'x-based' or 'v-based', got {self.kl_mask_type!r}",
        )


@register_trainer("dppo", arguments=DPPOArguments)
class DPPOTrainer(GRPOTrainer):
    """Flow-DPPO (module docstring)."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    roles: ClassVar[tuple[str, ...]] = ("policy",)
    uses_rollout_velocities: ClassVar[bool] = True

    def step_loss(
        self, samples: GRPOSamples, index: torch.Tensor, j: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The DPPO loss of samples ``index`` at denoising step j (module docstring, steps 1-4).

        Args:
            samples: this iteration's samples.
            index: the samples of the microbatch, [b].
            j: the denoising step.

        Returns:
            The loss and its metrics.
        """
        args = self.args
        v, step, sde_args = self.policy_step(samples, index, j)
        v_old, old = self.rollout_step(samples, index, j, sde_args)
        if args.kl_mask_type == "x-based":
            ffdebug.tap("train.mean", step.mean)
            ffdebug.tap("train.mean_old", old.mean)
            kl_new_old = dppo_losses.gaussian_mean_kl(step.mean, old.mean, step.step_std)
        else:
            ffdebug.tap("train.velocity", v)
            ffdebug.tap("train.velocity_old", v_old)
            kl_new_old = dppo_losses.velocity_sq_error(v, v_old)
        old_log_prob = samples.trajectory.log_probs[index, j]
        ffdebug.tap("train.log_ratio", step.log_prob - old_log_prob)
        ffdebug.tap("train.kl_new_old", kl_new_old)
        ref_mean = self.reference_mean(samples, index, j, sde_args) if args.kl_beta > 0 else None
        loss, keep, metrics = dppo_losses.dppo_loss(
            step.log_prob,
            old_log_prob,
            samples.advantages[index],
            kl_new_old,
            threshold=args.kl_mask_threshold,
            adv_clip_max=args.adv_clip_max,
            kl_beta=args.kl_beta,
            mean=step.mean,
            ref_mean=ref_mean,
            kl_std=self.kl_std(step),
        )
        ffdebug.tap("train.keep", keep)
        return loss, metrics
