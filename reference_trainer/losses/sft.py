"""Supervised flow-matching loss: velocity MSE.

Rectified flow / conditional flow matching (Liu et al. 2022, arXiv 2209.03003; Lipman et al. 2022,
arXiv 2210.02747; SD3, Esser et al. 2024, eq. 1-3): with x_σ = (1 − σ)x_0 + σε,

    L = E_{x_0, ε, σ} [ w(σ) · ‖v_θ(x_σ, σ) − (ε − x_0)‖² ]

Reference code: diffusers ``examples/dreambooth/train_dreambooth_lora_sd3.py`` (``target = noise -
model_input``; per-sample ``mean`` of the weighted squared error, then the batch mean), as vendored by
flow_grpo; Flow-Factory ``trainers/offline/sft.py`` (per-sample fp32 MSE, mean over the batch).

Notation map: v_pred -> v_θ(x_σ, σ) [B, ...]; noise -> ε [B, ...]; x0 -> x_0 [B, ...];
weights -> w(σ) [B] (default 1).

Reduction: squared error averaged over the non-batch dims (‖·‖² / D), in fp32, then a (weighted) mean
over the batch. A gradient-accumulated step therefore matches one large batch when microbatches have
equal size and the caller divides by the number of microbatches.
"""

from __future__ import annotations

import torch

from reference_trainer.flow_matching import velocity_target


def per_sample_velocity_error(v_pred: torch.Tensor, v_target: torch.Tensor) -> torch.Tensor:
    """e_i = mean over non-batch dims of (v_pred − v_target)², fp32. [B, ...] -> [B].

    Args:
        v_pred: predicted velocities, [B, ...].
        v_target: target velocities, [B, ...] (same shape).

    Returns:
        e, [B] fp32.
    """
    if v_pred.shape != v_target.shape:
        raise ValueError(
            f"prediction {tuple(v_pred.shape)} and target {tuple(v_target.shape)} differ in shape"
        )
    return ((v_pred.float() - v_target.float()) ** 2).mean(dim=tuple(range(1, v_pred.ndim)))


def flow_matching_loss(
    v_pred: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """L = mean_i w_i · mean_dims (v_θ − (ε − x_0))². Returns a scalar and ``{"loss": ...}``.

    Args:
        v_pred: predicted velocities v_θ(x_σ, σ), [B, ...].
        noise: ε, [B, ...].
        x0: clean latents x_0, [B, ...].
        weights: w(σ) per sample, [B]; ``None`` = 1.

    Returns:
        The scalar loss and ``{"loss": ...}``.
    """
    errors = per_sample_velocity_error(v_pred, velocity_target(x0.float(), noise.float()))
    if weights is not None:
        if weights.shape != errors.shape:
            raise ValueError(f"weights must be [B] = {tuple(errors.shape)}, got {tuple(weights.shape)}")
        errors = errors * weights.float()
    loss = errors.mean()
    return loss, {"loss": loss.item()}
