"""GRPO-Guard loss: GRPO's PPO clip on a *normalised* per-step log-ratio (RatioNorm).

Paper: Wang et al. 2025, "GRPO-Guard: Mitigating Implicit Over-Optimization in Flow Matching via
Regulated Clipping", arXiv 2510.22319. Code followed term by term: X-GenGroup/Flow-Factory
``src/flow_factory/trainers/grpo.py`` @ a0b2bc5a, ``GRPOGuardTrainer.optimize`` (lines 500-510: the
"Reweighted ratio" and the PPO-style clipped loss), with the Flow-SDE log-prob of
``src/flow_factory/scheduler/flow_match_euler_discrete.py`` (lines 364-371: mean over non-batch dims).

Why a normalisation. For one trained step j both policies' transitions are Gaussians with the same
std s = σ_t·√(−Δt) (σ_t = η·√(σ/(1 − σ)), ``sde.flow_sde_step``), means μ_θ and μ_old. The stored
sample is x' = μ_old + s·z with z ~ N(0, I) the rollout noise. With the log-prob averaged over the D
non-batch elements, log p(x' | μ) = mean_d[−(x' − μ)²/(2s²)] − log s − log √(2π), so with δ = μ_θ − μ_old:

    (x' − μ_old)² − (x' − μ_θ)² = s²z² − (s·z − δ)² = 2·s·z·δ − δ²
    Δlogp = log p_θ − log p_old = mean_d(z·δ)/s − mse/(2s²),        mse = mean_d(δ²)
    log r̃ := Δlogp·s + mse/(2s) = mean_d(δ·z)                                         (RatioNorm)

The raw Δlogp has, over the rollout noise, mean −mse/(2s²) < 0 (the "left-shifted" ratio the paper
describes: positive-advantage samples rarely reach 1 + ε) and a spread ∝ 1/s that differs across steps.
The normalised log r̃ = mean_d(δ·z) is centred at 0 for every step, and its gradient
∇_θ log r̃ = mean_d(z·∇_θ μ_θ) no longer carries the step-dependent 1/s: multiplying by s *is* a
per-step gradient re-weighting (Flow-Factory ``guidance/algorithms.md`` §GRPO-Guard: "aligns with the
time-step-dependent loss re-weighting strategy introduced in TempFlow-GRPO"). Then, as in GRPO
(``losses.grpo.ppo_clip_loss``), with r̃ = exp(log r̃) and Â = clip(A, ±A_max):

    L = mean_i max(−Â_i·r̃_i, −Â_i·clip(r̃_i, 1 − ε, 1 + ε))  (+ β·KL to the reference, as GRPO)

What was followed and what could not be verified:
* Followed: Flow-Factory's guard branch exactly: ``scale = sqrt(−dt)·std_dev_t``,
  ``mse = (μ_θ − μ_old).flatten(1).pow(2).mean(1)``, ``ratio = exp((logp − logp_old)·scale + mse/(2·scale))``,
  GRPO's clip on that ratio. Flow-Factory keeps ``dt``/``std_dev_t`` as [B, 1, ...] against [B] log-probs,
  so its ratio broadcasts to [B, 1, ..., B]; with the one σ per step its loop uses, every row equals the
  per-sample value and the mean is unchanged. We keep per-sample [B] tensors.
* Not verified: the paper's separate "gradient reweighting" across noise conditions. Its method section
  was not readable here (only the abstract: "a gradient reweighting strategy equalizes policy gradients
  over noise conditions"). A third-party implementation reports a per-step loss weight δ_t = 1/Δt
  ("Eq. 12"); Flow-Factory applies no weight beyond the s inside the ratio, and neither do we.
* The KL term is GRPO's (``losses.grpo.sde_kl``); Flow-Factory's guard branch uses the unscaled
  mean((μ_θ − μ_ref)²) ("x-based"), a per-step constant factor 2s² (or 2σ_t²) away.

Notation map (code -> paper / Flow-Factory):
    log_prob, old_log_prob -> log p_θ, log p_old of the stored x_{j+1}, mean over dims        [B]
    mean, old_mean         -> μ_θ (with gradients), μ_old (rollout policy, ``next_latents_mean``) [B, ...]
    step_std               -> s = σ_t·√(−Δt) (``scale_factor``)                            [B] or [B, 1, ...]
    noise                  -> z = (x_{j+1} − μ_old)/s                                           [B, ...]
"""

from __future__ import annotations

import torch

from reference_trainer.losses import grpo as grpo_losses


def _per_sample_std(step_std: torch.Tensor, batch: int) -> torch.Tensor:
    """s as [B] fp32: a [B, 1, ...] (``SDEStep.step_std``), [B] or scalar std, one value per sample."""
    std = step_std.float()
    if std.ndim == 0:
        return std.expand(batch)
    if std.shape[0] != batch or std[0].numel() != 1:
        raise ValueError(
            f"step_std {tuple(step_std.shape)} must hold one std per sample of a batch of {batch}"
        )
    return std.reshape(batch)


def normalised_log_ratio(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    step_std: torch.Tensor,
) -> torch.Tensor:
    """log r̃ = (log p_θ − log p_old)·s + mse/(2s), mse = mean_dims (μ_θ − μ_old)² (module docstring). [B] fp32.

    Gradients flow through ``log_prob`` and ``mean``; ``old_log_prob`` and ``old_mean`` are detached.

    Args:
        log_prob: log p_θ per sample, [B].
        old_log_prob: log p_old, [B].
        mean: the policy's transition mean μ_θ, [B, ...].
        old_mean: the rollout policy's mean μ_old, [B, ...].
        step_std: the transition std s, broadcastable to ``mean``.

    Returns:
        log r̃ per sample, [B] fp32.
    """
    if not (log_prob.ndim == 1 and log_prob.shape == old_log_prob.shape):
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)} and old_log_prob {tuple(old_log_prob.shape)} must be [B]"
        )
    if mean.shape != old_mean.shape or mean.shape[0] != log_prob.shape[0]:
        raise ValueError(f"mean {tuple(mean.shape)} and old_mean {tuple(old_mean.shape)} must be [B, ...]")
    s = _per_sample_std(step_std, log_prob.shape[0])
    mse = (mean.float() - old_mean.detach().float()).flatten(1).pow(2).mean(dim=1)
    return (log_prob.float() - old_log_prob.detach().float()) * s + mse / (2.0 * s)


def noise_form_log_ratio(mean: torch.Tensor, old_mean: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The same log r̃ written as mean_dims((μ_θ − μ_old)·z), z the rollout noise of x' = μ_old + s·z. [B] fp32.

    Equal to ``normalised_log_ratio`` up to rounding (the derivation in the module docstring).

    Args:
        mean: the policy's transition mean μ_θ, [B, ...].
        old_mean: the rollout policy's mean μ_old, [B, ...].
        noise: z with x' = μ_old + s·z, [B, ...].

    Returns:
        log r̃ per sample, [B] fp32.
    """
    if not mean.shape == old_mean.shape == noise.shape:
        raise ValueError(
            f"mean {tuple(mean.shape)}, old_mean {tuple(old_mean.shape)} and noise {tuple(noise.shape)} differ"
        )
    return ((mean.float() - old_mean.detach().float()) * noise.detach().float()).flatten(1).mean(dim=1)


def grpo_guard_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
    kl_beta: float = 0.0,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    kl_std: torch.Tensor | None = None,
    step_weight: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L = w·mean max(−Â·r̃, −Â·clip(r̃, 1 ± ε)) + β·KL, r̃ = exp(``log_ratio``) (``normalised_log_ratio``).

    log_ratio, advantages: [B]. With ``kl_beta > 0``, ``mean``, ``ref_mean`` and ``kl_std`` are
    required (GRPO's KL, ``losses.grpo.sde_kl``). Metrics as ``losses.grpo.ppo_clip_loss`` (on r̃, before
    w). w is the paper's gradient reweighting 1/|Δt_j| of the step (the official script,
    ``policy_loss = policy_loss / (sqrt_dt.mean()**2)``), 1 for Flow-Factory's form.

    Args:
        log_ratio: log r̃ per sample, [B].
        advantages: A, [B].
        clip_range: ε of the clip on r̃.
        adv_clip_max: A_max of the advantage clip.
        kl_beta: β (0: no KL term).
        mean: the policy's transition mean, [B, ...].
        ref_mean: the reference's transition mean, [B, ...].
        kl_std: the KL's std, broadcastable to ``mean``.
        step_weight: w, the policy term's weight.

    Returns:
        The scalar loss and its metrics.
    """
    # GRPO's clip applied to log r̃: ppo_clip_loss forms exp(log_prob − old_log_prob) = exp(log r̃ − 0)
    policy, metrics = grpo_losses.grpo_loss(
        log_ratio, torch.zeros_like(log_ratio), advantages, clip_range=clip_range, adv_clip_max=adv_clip_max
    )
    return grpo_losses.with_sde_kl(step_weight * policy, metrics, kl_beta, mean, ref_mean, kl_std), metrics
