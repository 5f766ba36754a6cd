"""Offline Diffusion-DPO: a dataset of (prompt, chosen, rejected) pairs (dataset acquisition, no feedback).

Paper: Wallace et al. 2023, "Diffusion Model Alignment Using Direct Preference Optimization", arXiv
2311.12908, eq. 14; loss in its flow-matching form in ``reference_trainer.losses.dpo``. Reference code:
SalesforceAIResearch/DiffusionDPO ``train.py`` and diffusers
``examples/research_projects/diffusion_dpo/train_diffusion_dpo.py`` (chosen and rejected are noised
with the *same* noise and timestep; a frozen reference UNet); Flow-Factory
``trainers/offline/offline_dpo.py`` (dataset contract; the condition state is prepared once per batch
and reused by both arms, with one schedule, one noise and one reference scope).

One microbatch (``optimize_batch``), B pairs:

1. c = the cached prompt condition, prepared once and used for both arms (the records of the packaged
   dataset give one prompt per pair);
2. x_0^w, x_0^l = VAE-encoded chosen / rejected images (on demand, never cached), [B, C, H, W];
3. for k < ``num_train_timesteps``: one σ [B] and one ε [B, C, H, W] shared by both arms;
   x_σ^w, x_σ^l; the policy predicts both arms in one forward over [x^w; x^l] and the frozen
   reference does the same under one ``no_grad`` scope; the per-sample errors
   e = mean ‖v − (ε − x_0)‖² go into L_k = −log σ(−β/2·((e_θ^w − e_ref^w) − (e_θ^l − e_ref^l)));
4. L = mean_k L_k; the base back-propagates L / gradient_accumulation_steps in the ``policy`` phase.

``evaluate`` adds the same loss on the held-out pairs with fixed evaluation draws, and its metrics: the
implicit-reward accuracy (fraction of pairs with r^w > r^l) and the mean margin r^w − r^l.

Roles: ``policy`` (trainable, the base variant) and ``reference`` (a frozen snapshot of the initial
policy, used through ``functional_call``; never a variant).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

import ffdebug
from reference_trainer import evaluation
from reference_trainer.adapters.base import Condition
from reference_trainer.adapters.sampling import VelocityFn
from reference_trainer.config import DatasetTrainingArguments
from reference_trainer.contracts import DATASET, ExecutionContract
from reference_trainer.errors import require
from reference_trainer.flow_matching import Generators, check_sigma_sampling
from reference_trainer.losses.dpo import diffusion_dpo_loss, pair_errors
from reference_trainer.registry import register_trainer
from reference_trainer.trainers.base import BaseTrainer


@dataclass(frozen=True, kw_only=True)
class OfflineDPOArguments(DatasetTrainingArguments):
    """``train:`` section of an offline Diffusion-DPO run."""

    execution_contract: ClassVar[ExecutionContract] = DATASET
    beta: float = 2000.0
    """β of the DPO logit (T·ω(λ_t) folded in; Flow-Factory's online default 2000, Diffusion-DPO SD1.5 5000)."""
    num_train_timesteps: int = 1
    """(σ, ε) draws per pair, averaged inside one microstep."""
    sigma_scheme: str = "logit_normal"
    """``logit_normal`` (mean 0, std 1) or ``uniform``."""
    sigma_min: float = 0.01
    """Lower clamp of the training σ."""
    sigma_max: float = 0.99
    """Upper clamp of the training σ."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.beta > 0, "beta", f"must be > 0, got {self.beta}")
        require(
            self.num_train_timesteps >= 1,
            "num_train_timesteps",
            f"must be >= 1, got {self.num_train_timesteps}",
        )
        check_sigma_sampling(self.sigma_scheme, self.sigma_min, self.sigma_max)


@register_trainer("offline_dpo", arguments=OfflineDPOArguments)
class OfflineDPOTrainer(BaseTrainer):
    """Diffusion-DPO on a fixed preference dataset (module docstring)."""

    execution_contract: ClassVar[ExecutionContract] = DATASET
    roles: ClassVar[tuple[str, ...]] = ("policy",)
    dataset_role: ClassVar[str] = "policy"
    supervision: ClassVar[str | None] = "preference"

    def setup_roles(self) -> dict[str, str]:
        """The ``policy`` variant and the frozen ``reference`` snapshot.

        Returns:
            ``{role: variant name}``.
        """
        self.variants.declare_variant("policy")
        self.variants.add_snapshot("reference", "policy")
        return {"policy": "policy"}

    def velocity_fns(self, condition: Condition) -> tuple[VelocityFn, VelocityFn]:
        """(policy, reference) velocity functions over [chosen; rejected] for one shared condition.

        Args:
            condition: the pairs' condition (repeated for both arms inside).

        Returns:
            ``(policy, reference)``, each (x_σ, σ) -> velocity.
        """
        condition2 = Condition.cat([condition, condition])
        policy, reference = self.variants.variant("policy"), self.variants.snapshot("reference")

        def policy_velocity(x_t: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            v = self.adapter.forward(x_t, sigma, condition2, module=policy)
            ffdebug.tap("train.velocity", v)
            return v

        def reference_velocity(x_t: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            v = self.adapter.forward(x_t, sigma, condition2, parameters=reference)
            ffdebug.tap("train.velocity_ref", v)
            return v

        return policy_velocity, reference_velocity

    def optimize_batch(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """The DPO loss of one microbatch, σ and ε from one generator per record (epoch, dataset index).

        Args:
            batch: one microbatch of pairs.

        Returns:
            The loss and its metrics.
        """
        # one generator per record, seeded by its dataset index: the draws do not depend on the rank
        generators = [self.generator("offline_dpo", self.data_epoch, index) for index in batch["indices"]]
        return self.batch_loss(batch, generators)

    def evaluate(self) -> dict[str, float]:
        """The evaluation rewards of ODE samples, and the DPO loss, implicit-reward accuracy and margin on
        the held-out pairs (at θ = ref the margin is exactly 0).

        Returns:
            ``{metric: value}``.
        """
        assert self.heldout is not None
        metrics = super().evaluate()
        metrics.update(evaluation.heldout_metrics(self.heldout, self.batch_loss, self.config.eval))
        return metrics

    def batch_loss(
        self, batch: Mapping[str, Any], generator: Generators
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Steps 1-4 of the module docstring, σ and ε drawn from ``generator``.

        Args:
            batch: one microbatch of pairs.
            generator: the RNG of σ and ε.

        Returns:
            The loss and its metrics.
        """
        args: OfflineDPOArguments = self.args  # type: ignore[assignment]
        # 1. one condition state for the batch, shared by both arms
        condition = self.conditions.get(batch["prompts"])
        # 2. chosen / rejected latents, encoded on demand
        x0_w = self.adapter.encode_images(batch["chosen"])
        x0_l = self.adapter.encode_images(batch["rejected"])
        ffdebug.tap("batch.x0_chosen", x0_w)
        ffdebug.tap("batch.x0_rejected", x0_l)
        # 3. one (σ, ε) per pair and draw, shared by both arms
        losses, metric_sums = [], {}
        for k in range(args.num_train_timesteps):
            with ffdebug.step(timestep_draw=k):  # the inputs σ, ε are draws (taken with --inputs-from)
                sigma, noise = self.drawn_sigma_noise(x0_w.shape, args, generator)
                errors = pair_errors(x0_w, x0_l, sigma, noise, *self.velocity_fns(condition))
                ffdebug.tap("train.dpo_errors", torch.stack(errors))  # [4, B]: e_θ^w, e_θ^l, e_ref^w, e_ref^l
            loss_k, metrics_k = diffusion_dpo_loss(*errors, beta=args.beta)
            losses.append(loss_k)
            for key, value in metrics_k.items():
                metric_sums[key] = metric_sums.get(key, 0.0) + value / args.num_train_timesteps
        # 4. average over the draws
        loss = torch.stack(losses).mean()
        metric_sums.pop("loss")
        return loss, metric_sums
