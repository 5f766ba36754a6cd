"""Flow-GRPO loss: PPO clipped surrogate on the SDE-step log-prob ratio, plus an optional KL to the reference.

Flow-GRPO (Liu et al. 2025, arXiv 2505.05470, eq. 6-7 and §4.1); reference code yifan123/flow_grpo
``scripts/train_sd3.py`` (the loss block inside the training loop). For one trained denoising step j:

    r_i   = exp(log p_θ(x_{j+1} | x_j) − log p_old(x_{j+1} | x_j))          importance ratio
    Â_i   = clip(A_i, −A_max, A_max)                                          (flow_grpo ``adv_clip_max``)
    L_pg  = mean_i max(−Â_i·r_i, −Â_i·clip(r_i, 1 − ε, 1 + ε))                 (PPO-clip, ε = ``clip_range``)
    L     = L_pg + β·KL

Notation map (code -> paper):
    log_prob      -> log p_θ, per sample, the fp32 mean-over-dims log-prob of ``sde.flow_sde_step``  [B]
    old_log_prob  -> log p_old, stored at rollout (detached)                                      [B]
    advantages    -> A_i from ``AdvantageProcessor``                                              [B]
    clip_range    -> ε        adv_clip_max -> A_max        kl_beta -> β

KL (``sde_kl``): both policies' transitions are Gaussians with the same std s = σ_t·√(−Δt), so
KL(p_θ ‖ p_ref) = ‖μ_θ − μ_ref‖² / (2s²) exactly (Flow-GRPO paper, the KL paragraph of §4.1). We take
the mean over non-batch dims (the same reduction as the log-prob) and then over the batch.
flow_grpo's code divides by 2·σ_t² (``std_dev_t``), i.e. omits Δt (its issue #78): pass
``std=std_dev_t`` to reproduce that, ``std=step_std`` for the exact Gaussian KL. The reference mean must
be computed under ``no_grad`` and the policy mean *with* gradients, else the KL term silently
contributes nothing to the update (Flow-Factory issues #122-#124).
"""

from __future__ import annotations

import torch


def ppo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L_pg = mean max(−Â·r, −Â·clip(r, 1 ± ε)). All inputs [B]; returns a scalar and metrics.

    Metrics: ``ratio_mean``, ``clipfrac`` (fraction with |r − 1| > ε, flow_grpo's definition),
    ``approx_kl`` = ½·mean((log p_θ − log p_old)²) (flow_grpo's monitor, not part of the loss).

    Args:
        log_prob: log p_θ per sample, [B] (with gradients).
        old_log_prob: log p_old stored at rollout, [B] (detached here).
        advantages: A, [B] (detached, clipped to ±``adv_clip_max``).
        clip_range: ε > 0.
        adv_clip_max: A_max > 0.

    Returns:
        The scalar L_pg and metrics ``policy_loss``, ``ratio_mean``, ``clipfrac``, ``approx_kl``.
    """
    if not (log_prob.shape == old_log_prob.shape == advantages.shape and log_prob.ndim == 1):
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} and advantages "
            f"{tuple(advantages.shape)} must all be [B]"
        )
    if not clip_range > 0 or not adv_clip_max > 0:
        raise ValueError(f"clip_range and adv_clip_max must be > 0, got {clip_range}, {adv_clip_max}")
    log_ratio = log_prob.float() - old_log_prob.detach().float()
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().float().clamp(-adv_clip_max, adv_clip_max)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    metrics = {
        "policy_loss": loss.item(),
        "ratio_mean": ratio.mean().item(),
        "clipfrac": ((ratio - 1.0).abs() > clip_range).float().mean().item(),
        "approx_kl": 0.5 * (log_ratio**2).mean().item(),
    }
    return loss, metrics


def sde_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL between N(μ_θ, s²) and N(μ_ref, s²) per element = (μ_θ − μ_ref)²/(2s²); mean over all dims.

    mean, ref_mean: [B, ...] (the ``SDEStep.mean`` of policy and reference); std broadcastable (s or σ_t).

    Args:
        mean: the policy's transition mean μ_θ, [B, ...] (with gradients).
        ref_mean: the reference's mean μ_ref, [B, ...] (detached here).
        std: the denominator's std, broadcastable to ``mean``.

    Returns:
        The scalar KL (mean over dims, then over the batch), fp32.
    """
    if mean.shape != ref_mean.shape:
        raise ValueError(f"policy mean {tuple(mean.shape)} and reference mean {tuple(ref_mean.shape)} differ")
    per_element = (mean.float() - ref_mean.detach().float()) ** 2 / (2.0 * std.float() ** 2)
    return per_element.expand(mean.shape).mean(dim=tuple(range(1, mean.ndim))).mean()


def grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
    kl_beta: float = 0.0,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    kl_std: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L = L_pg + β·KL (module docstring). With ``kl_beta > 0``, ``mean``, ``ref_mean`` and ``kl_std`` are required.

    Args:
        log_prob: log p_θ per sample, [B].
        old_log_prob: log p_old stored at rollout, [B].
        advantages: A, [B].
        clip_range: ε of the PPO clip.
        adv_clip_max: A_max of the advantage clip.
        kl_beta: β (0: no KL term).
        mean: the policy's transition mean, [B, ...].
        ref_mean: the reference's transition mean, [B, ...].
        kl_std: the KL's std (``SDEStep.step_std`` for the exact KL, ``std_dev_t`` for flow_grpo's form).

    Returns:
        The scalar loss and the metrics of ``ppo_clip_loss`` plus ``kl`` (with β > 0) and ``loss``.
    """
    loss, metrics = ppo_clip_loss(
        log_prob, old_log_prob, advantages, clip_range=clip_range, adv_clip_max=adv_clip_max
    )
    if kl_beta < 0:
        raise ValueError(f"kl_beta must be >= 0, got {kl_beta}")
    return with_sde_kl(loss, metrics, kl_beta, mean, ref_mean, kl_std), metrics


def with_sde_kl(
    loss: torch.Tensor,
    metrics: dict[str, float],
    kl_beta: float,
    mean: torch.Tensor | None,
    ref_mean: torch.Tensor | None,
    kl_std: torch.Tensor | None,
) -> torch.Tensor:
    """``loss`` + β·``sde_kl`` when β > 0 (``mean``, ``ref_mean``, ``kl_std`` then required); records
    ``kl`` (β > 0) and the total as ``loss`` in ``metrics``."""
    if kl_beta > 0:
        if mean is None or ref_mean is None or kl_std is None:
            raise ValueError("kl_beta > 0 needs mean, ref_mean and kl_std")
        kl = sde_kl(mean, ref_mean, kl_std)
        loss = loss + kl_beta * kl
        metrics["kl"] = kl.item()
    metrics["loss"] = loss.item()
    return loss
