"""DGPO loss: direct group preference optimisation from per-sample denoising-score-matching errors.

Reference code: Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py`` @ 01ceb4b83c0bbc55d96246fe1b6d9a3d4749ebd6:
``compute_group_dgpo_loss_allreduce`` (lines 162-193) and its caller in the training loop (lines
1123-1156: the DSM errors, the PPO-style DSM clip against ``ema_ref``, the KL). Paper: Luo et al. 2025,
"Reinforcing Diffusion Models by Direct Group Preference Optimization", arXiv 2510.08425.
Flow-Factory's ``dgpo`` trainer is the framework analogue.

For samples i with v* = ε − x_0 (ε shared by the members of a group), group G(i), |G| = K:

    d_i   = mean_d (v* − v_θ)²,   d_i^ref = mean_d (v* − v_ref)²          (ref: no gradient)
    s_G   = Σ_{i∈G} Â_i·β_dpo·(d_i − d_i^ref)/K                            (detached; the sum runs over
                                                                             the whole group, every rank)
    L_dgpo = mean_i σ(s_{G(i)})·Â_i·d_i                                    (gradient-equivalent surrogate)

with Â = clip(A, ±A_max). Optional clip (``clip_dsm``): r_i = exp(−d_i + d_i^old) against the ``ema_ref``
velocity; a sample with Â > 0 and r > 1 + ε, or Â ≤ 0 and r < 1 − ε, has d_i detached. Optional
KL: β·mean_i mean_d (v_θ − v_ref)². The canonical script's ``clip_kl`` and ``kl_cfg`` are not offered
(the tiny models run without guidance).
"""

from __future__ import annotations

import torch


def dsm_error(velocity: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """d = mean_d (v* − v)², [B]."""
    return (target - velocity).square().reshape(velocity.shape[0], -1).mean(dim=1)


def group_logits(
    delta: torch.Tensor,
    advantages: torch.Tensor,
    group_index: torch.Tensor,
    *,
    beta_dpo: float,
    group_size: int,
) -> torch.Tensor:
    """s_G per group: Σ_{i∈G} A_i·β·δ_i/K for every group index 0..max, [num_groups], detached.

    Args:
        delta: d − d_ref per sample, [N] (all the samples of every group: gather them across ranks first).
        advantages: Â per sample, [N].
        group_index: the group (0-based, dense) of each sample, [N].
        beta_dpo: β_dpo.
        group_size: K (the canonical divisor: ``num_image_per_prompt``).
    """
    term = (advantages * beta_dpo * delta.detach() / group_size).detach()
    num_groups = int(group_index.max()) + 1
    sums = torch.zeros(num_groups, dtype=term.dtype)
    return sums.scatter_add_(0, group_index, term)


def dgpo_loss(
    dsm: torch.Tensor,
    advantages: torch.Tensor,
    logits: torch.Tensor,
    *,
    kl_beta: float = 0.0,
    velocity: torch.Tensor | None = None,
    ref_velocity: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L = mean σ(s_G)·Â·d (+ β·KL). dsm, advantages (clipped), logits (s_{G(i)} per sample): [B].

    Returns the loss and metrics ``policy_loss``, ``dsm_loss``, ``group_weight_mean``, ``kl`` (β > 0), ``loss``.
    """
    if not dsm.shape == advantages.shape == logits.shape or dsm.ndim != 1:
        raise ValueError(
            f"dsm {tuple(dsm.shape)}, advantages {tuple(advantages.shape)}, logits {tuple(logits.shape)} must be [B]"
        )
    weights = torch.sigmoid(logits).detach()
    loss = (weights * advantages.detach() * dsm).mean()
    metrics = {
        "policy_loss": loss.item(),
        "dsm_loss": dsm.detach().mean().item(),
        "group_weight_mean": weights.mean().item(),
    }
    if kl_beta > 0:
        if velocity is None or ref_velocity is None:
            raise ValueError("kl_beta > 0 needs velocity and ref_velocity")
        kl = (velocity - ref_velocity.detach()).square().reshape(velocity.shape[0], -1).mean(dim=1).mean()
        loss = loss + kl_beta * kl
        metrics["kl"] = kl.item()
    metrics["loss"] = loss.item()
    return loss, metrics


def dsm_clip(
    dsm: torch.Tensor, old_dsm: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PPO-style DSM clip: r = exp(−d + d_old); clipped = A > 0 ? r > 1 + ε : r < 1 − ε; clipped
    samples' d detached. Returns (d, clipped mask [B] bool)."""
    ratio = torch.exp(-dsm + old_dsm.detach())
    should_clip = torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)
    return torch.where(should_clip, dsm.detach(), dsm), should_clip
