"""SFT for flow matching: velocity MSE on a dataset of demonstrations (dataset acquisition, no feedback).

Rectified-flow / flow-matching regression (SD3, Esser et al. 2024, arXiv 2403.03206, eq. 1-3; loss in
``reference_trainer.losses.sft``). Reference code: diffusers ``examples/dreambooth/
train_dreambooth_lora_sd3.py`` (logit-normal σ, ``target = noise - model_input``); Flow-Factory
``trainers/offline/sft.py`` (dataset contract, ``num_train_timesteps`` draws averaged inside one
microstep, one backward per microstep, explicit integer ``gradient_accumulation_steps``).

One microbatch (``optimize_batch``), notation as in the paper:

1. c    = the cached prompt condition (the only cached thing; the image is encoded on demand);
2. x_0  = VAE-encoded target image, [B, C, H, W] (no gradient);
3. for k < ``num_train_timesteps``: σ ~ logit-normal clamped to [sigma_min, sigma_max], ε ~ N(0, I),
   x_σ = (1 − σ)x_0 + σε, v_θ = transformer(x_σ, σ, c), L_k = mean ‖v_θ − (ε − x_0)‖²;
4. L = mean_k L_k; the base back-propagates L / gradient_accumulation_steps in the ``policy`` phase.

All randomness comes from ``self.generator("sft", data_epoch, record index)``, one generator per record,
so a resumed run draws the same σ and ε as the uninterrupted one, whatever rank holds the record. The
draws are the run's inputs (docs/trainer-taps.md "Inputs"): ``batch.sample_ids``, ``train.sigma`` [B] and
``train.noise`` [B, C, H, W] per draw k (tag ``timestep_draw=k``), taken from a target by ``--inputs-from``. ``evaluate`` adds ``heldout.loss``, the same loss on the
held-out demonstrations with the fixed evaluation draws.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

import ffdebug
from reference_trainer import evaluation
from reference_trainer.config import DatasetTrainingArguments
from reference_trainer.contracts import DATASET, ExecutionContract
from reference_trainer.errors import require
from reference_trainer.flow_matching import (
    Generators,
    check_sigma_sampling,
    interpolate,
)
from reference_trainer.losses.sft import flow_matching_loss
from reference_trainer.registry import register_trainer
from reference_trainer.trainers.base import BaseTrainer


@dataclass(frozen=True, kw_only=True)
class SFTArguments(DatasetTrainingArguments):
    """``train:`` section of an SFT run."""

    execution_contract: ClassVar[ExecutionContract] = DATASET
    num_train_timesteps: int = 1
    """σ draws per sample, averaged inside one microstep (Flow-Factory ``num_train_timesteps``)."""
    sigma_scheme: str = "logit_normal"
    """``logit_normal`` (SD3 default, mean 0 std 1) or ``uniform``."""
    sigma_min: float = 0.01
    """Lower clamp of the training σ (Flow-Factory ``timestep_range`` 0.99 keeps σ off the ends)."""
    sigma_max: float = 0.99
    """Upper clamp of the training σ."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.num_train_timesteps >= 1,
            "num_train_timesteps",
            f"must be >= 1, got {self.num_train_timesteps}",
        )
        check_sigma_sampling(self.sigma_scheme, self.sigma_min, self.sigma_max)


@register_trainer("sft", arguments=SFTArguments)
class SFTTrainer(BaseTrainer):
    """Velocity-MSE finetuning of the transformer on (prompt, image) demonstrations."""

    execution_contract: ClassVar[ExecutionContract] = DATASET
    roles: ClassVar[tuple[str, ...]] = ("policy",)
    dataset_role: ClassVar[str] = "policy"
    supervision: ClassVar[str | None] = "demonstration"

    def optimize_batch(self, batch: Mapping[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """The flow-matching loss of one microbatch, σ and ε from one generator per record (epoch, dataset index).

        Args:
            batch: one microbatch of demonstrations.

        Returns:
            The loss and its metrics.
        """
        # one generator per record, seeded by its dataset index: the draws do not depend on the rank
        generators = [self.generator("sft", self.data_epoch, index) for index in batch["indices"]]
        return self.batch_loss(batch, generators)

    def evaluate(self) -> dict[str, float]:
        """The evaluation rewards of ODE samples, and the velocity MSE on the held-out demonstrations.

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
            batch: one microbatch of demonstrations.
            generator: the RNG of σ and ε.

        Returns:
            The loss and its metrics.
        """
        args: SFTArguments = self.args  # type: ignore[assignment]
        # 1-2. condition (cached) and target latents (encoded on demand)
        condition = self.conditions.get(batch["prompts"])
        x0 = self.adapter.encode_images(batch["image"])  # [B, C, H, W]
        ffdebug.tap("batch.x0", x0)
        # 3. one flow-matching term per σ draw
        losses = []
        for k in range(args.num_train_timesteps):
            with ffdebug.step(timestep_draw=k):  # the inputs σ, ε are draws (taken with --inputs-from)
                sigma, noise = self.drawn_sigma_noise(x0.shape, args, generator)  # [B], [B, C, H, W]
                x_t = interpolate(x0, noise, sigma)
                v_pred = self.adapter.forward(x_t, sigma, condition)
                ffdebug.tap("train.velocity", v_pred)
            loss_k, _ = flow_matching_loss(v_pred, noise, x0)
            losses.append(loss_k)
        # 4. average over the σ draws (the base scales by 1/gradient_accumulation_steps)
        loss = torch.stack(losses).mean()
        return loss, {"fm_loss": loss.item()}
