"""DiffusionNFT loss: negative-aware finetuning on the forward process, with implicit ±velocities.

Reference code: NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` (read in the fork
pkuhxy/DiffusionNFT @ 619456aabc96a9203baa525d6bcb24f0f4560117, lines 911-973: advantage clip,
normalisation, ``positive_prediction`` / ``implicit_negative_prediction``, the adaptive weights, the
policy loss and the KL; ``return_decay`` lines 172-192). NVlabs/DiffusionNFT itself is not in the
stored source index; Flow-Factory's ``nft`` trainer is the framework analogue.

For samples i at noise level σ (x_t = (1 − σ)x_0 + σε), with v_θ the policy's velocity (with gradient)
and v_old the sampling ("old") policy's (detached):

    Â   = clip(A, ±A_max);   r = clip(Â / A_max / 2 + ½, 0, 1)           (reward-normalised, in [0, 1])
    v⁺  = β·v_θ + (1 − β)·v_old,        v⁻ = (1 + β)·v_old − β·v_θ    (implicit positive / negative)
    x̂±  = x_t − σ·v±
    w±  = max(mean_d |x̂± − x_0|, 1e-5)                                 (fp64, no gradient)
    ℓ_i = (r·mean_d (x̂⁺ − x_0)²/w⁺ + (1 − r)·mean_d (x̂⁻ − x_0)²/w⁻) / β
    L   = A_max · mean_i ℓ_i  +  β_KL · mean_i mean_d (v_θ − v_ref)²       (fp64, as NVlabs' promotion)

Notation map (code -> NVlabs): velocity -> ``forward_prediction``; old_velocity -> ``old_prediction``;
ref_velocity -> ``ref_forward_prediction``; beta -> ``config.beta``; kl_beta -> ``config.train.beta``;
adv_clip_max -> ``config.train.adv_clip_max``. (NVlabs' optional ``adv_mode`` variants are not offered.)
"""

from __future__ import annotations

import torch


def _mean_dims(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1).mean(dim=1)


def old_decay(step: int, flat: int, uprate: float, uphold: float) -> float:
    """NVlabs ``return_decay``: 0 before ``flat`` steps, then min((step − flat)·uprate, uphold).

    A pure function of the optimizer step, so a resumed run updates the old snapshot identically.
    (NVlabs ``decay_type`` 1 = (0, 0.001, 0.5), 2 = (75, 0.0075, 0.999), 0 = (0, 0, 0).)
    """
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)


def normalised_advantage(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r = clip(clip(A, ±A_max) / A_max / 2 + ½, 0, 1), [B] fp32."""
    adv = advantages.detach().float().clamp(-adv_clip_max, adv_clip_max)
    return ((adv / adv_clip_max) / 2.0 + 0.5).clamp(0.0, 1.0)


def adaptive_x0_error(x0_hat: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """mean_d (x̂ − x_0)² / w with w = max(mean_d |x̂ − x_0|, 1e-5) in fp64, no gradient. [B] fp64.

    As NVlabs: the fp32 squared error is divided elementwise by the fp64 weight, so the result (and the
    loss) is fp64.
    """
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        weight = (x0_hat.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
    return ((x0_hat - x0) ** 2 / weight).mean(dim=dims)


def nft_loss(
    velocity: torch.Tensor,
    old_velocity: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    sigma: torch.Tensor,
    advantages: torch.Tensor,
    *,
    beta: float,
    adv_clip_max: float,
    kl_beta: float = 0.0,
    ref_velocity: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L of the module docstring. velocity, old_velocity, x_t, x0: [B, ...]; sigma, advantages: [B].

    Returns the loss and metrics ``policy_loss``, ``unweighted_policy_loss``, ``old_deviate``
    (mean (v_θ − v_old)²), ``kl`` (with ``kl_beta > 0``), ``loss``.
    """
    if not velocity.shape == old_velocity.shape == x_t.shape == x0.shape:
        raise ValueError(
            f"velocity {tuple(velocity.shape)}, old_velocity {tuple(old_velocity.shape)}, x_t "
            f"{tuple(x_t.shape)} and x0 {tuple(x0.shape)} must match"
        )
    if not beta > 0 or not adv_clip_max > 0 or kl_beta < 0:
        raise ValueError(
            f"need beta > 0, adv_clip_max > 0, kl_beta >= 0; got {beta}, {adv_clip_max}, {kl_beta}"
        )
    r = normalised_advantage(advantages, adv_clip_max)
    v_old = old_velocity.detach()
    positive = beta * velocity + (1.0 - beta) * v_old
    negative = (1.0 + beta) * v_old - beta * velocity
    s = sigma.to(x_t.dtype).view(-1, *([1] * (x_t.ndim - 1)))
    positive_loss = adaptive_x0_error(x_t - s * positive, x0)
    negative_loss = adaptive_x0_error(x_t - s * negative, x0)
    per_sample = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
    loss = (per_sample * adv_clip_max).mean()
    metrics = {
        "policy_loss": loss.item(),
        "unweighted_policy_loss": per_sample.mean().item(),
        "old_deviate": ((velocity.detach() - v_old) ** 2).mean().item(),
    }
    if kl_beta > 0:
        if ref_velocity is None:
            raise ValueError("kl_beta > 0 needs ref_velocity")
        kl = _mean_dims((velocity - ref_velocity.detach()) ** 2).mean()
        loss = loss + kl_beta * kl
        metrics["kl"] = kl.item()
    metrics["loss"] = loss.item()
    return loss, metrics
