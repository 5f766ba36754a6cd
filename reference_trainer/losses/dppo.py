"""Flow-DPPO loss: GRPO's policy gradient with a divergence trust-region mask instead of the ratio clip.

Reference code: Jayce-Ping/Flow-Factory-Draft ``src/flow_factory/trainers/dppo.py`` @ 42b71566
(``gaussian_kl_div`` and ``DPPOTrainer.optimize``, "3. Compute loss": the ratio, ``kl_new_old``, the
``violate`` / ``pos_rm`` / ``neg_rm`` / ``keep_mask`` lines and ``policy_loss``); its arguments
(``kl_mask_threshold`` default 1e-6, ``kl_mask_type`` default "x-based") in X-GenGroup/Flow-Factory
``src/flow_factory/hparams/training_args/dppo.py`` @ c5b89b17. Paper: "Flow-DPPO: Divergence Proximal
Policy Optimization for Flow Matching Models" (abstract only was available); its LLM origin is
"Rethinking the Trust Region in LLM RL" (arXiv 2602.04879). No other public Flow-DPPO code was found.

For one trained step j, sample i, with r_i = exp(log p_θ − log p_old) (unclipped), Â_i = clip(A_i, ±A_max)
and D_i = KL(π_θ ‖ π_old) of the step's Gaussian transition, measured in one of two spaces:

    x-based:  D_i = mean_d (μ_θ − μ_old)² / (2s²),   s = σ_t·√(−Δt)   (the exact Gaussian KL per element)
    v-based:  D_i = mean_d (v_θ − v_old)²                            (unscaled velocity squared error)

    drop_i = [D_i ≥ τ] ∧ ([r_i > 1 ∧ Â_i > 0] ∨ [r_i < 1 ∧ Â_i < 0])    (outside the trust region, moving further)
    keep_i = 1 − drop_i                                                 (detached; no gradient)
    L      = mean_i(−Â_i · r_i · keep_i)  (+ β·KL(π_θ ‖ π_ref), GRPO's ``losses.grpo.sde_kl``)

A dropped sample is one whose update already moved the policy by more than τ in the direction its
advantage asks for; a sample outside the region but moving back (r > 1 with Â < 0, ...) keeps its gradient,
which pulls it back. Inside the region (D < τ) every sample keeps its gradient, unlike PPO's ratio clip.

Notation map (code -> paper / Flow-Factory-Draft):
    log_prob, old_log_prob -> log p_θ, log p_old (``output.log_prob``, ``old_log_prob``)       [B]
    kl_new_old             -> D (``kl_new_old``)                                                [B]
    threshold              -> τ (``kl_mask_threshold``)     adv_clip_max -> A_max (``adv_clip_range``)
    mean, old_mean         -> μ_θ, μ_old (``next_latents_mean``)                               [B, ...]
    velocity, old_velocity -> v_θ, v_old (``velocity``)                                        [B, ...]

Differences from the Draft, by design: its KL to the reference is the unscaled mean((μ_θ − μ_ref)²) (or
the velocity form), run at ``kl_guidance_scale``; ours is GRPO's (a per-step constant factor apart; the
tiny models have no CFG). Its std for CPS dynamics (``std_dev_t`` alone) does not arise: we sample Flow-SDE.
"""

from __future__ import annotations

import torch

from reference_trainer.losses import grpo as grpo_losses


def _mean_over_dims(per_element: torch.Tensor) -> torch.Tensor:
    return per_element.flatten(1).mean(dim=1)


def gaussian_mean_kl(mean: torch.Tensor, old_mean: torch.Tensor, step_std: torch.Tensor) -> torch.Tensor:
    """x-based D = mean_dims (μ_θ − μ_old)²/(2s²): KL between N(μ_θ, s²) and N(μ_old, s²) per element. [B] fp32.

    mean, old_mean: [B, ...]; step_std: s, broadcastable to them (``SDEStep.step_std``, [B, 1, ...]).

    Args:
        mean: the policy's transition mean μ_θ, [B, ...].
        old_mean: the rollout policy's mean μ_old, [B, ...].
        step_std: the transition std s, broadcastable to ``mean``.

    Returns:
        D per sample, [B] fp32.
    """
    if mean.shape != old_mean.shape:
        raise ValueError(f"mean {tuple(mean.shape)} and old_mean {tuple(old_mean.shape)} differ")
    per_element = (mean.float() - old_mean.detach().float()) ** 2 / (2.0 * step_std.float() ** 2)
    return _mean_over_dims(per_element.expand(mean.shape))


def velocity_sq_error(velocity: torch.Tensor, old_velocity: torch.Tensor) -> torch.Tensor:
    """v-based D = mean_dims (v_θ − v_old)². [B] fp32.

    Args:
        velocity: the policy's velocity v_θ, [B, ...].
        old_velocity: the rollout policy's velocity v_old, [B, ...].

    Returns:
        D per sample, [B] fp32.
    """
    if velocity.shape != old_velocity.shape:
        raise ValueError(
            f"velocity {tuple(velocity.shape)} and old_velocity {tuple(old_velocity.shape)} differ"
        )
    return _mean_over_dims((velocity.float() - old_velocity.detach().float()) ** 2)


def trust_region_keep(
    kl_new_old: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor, threshold: float
) -> torch.Tensor:
    """keep = 1 − [D ≥ τ]·([r > 1 ∧ A > 0] ∨ [r < 1 ∧ A < 0]), fp32 [B], detached (module docstring).

    Args:
        kl_new_old: the divergence D from the rollout policy, [B].
        ratio: r = exp(log p_θ − log p_old), [B].
        advantages: A (the sign matters), [B].
        threshold: τ.

    Returns:
        The keep mask, [B] fp32 of 0 / 1, without gradient.
    """
    if not kl_new_old.shape == ratio.shape == advantages.shape:
        raise ValueError(
            f"kl_new_old {tuple(kl_new_old.shape)}, ratio {tuple(ratio.shape)} and advantages "
            f"{tuple(advantages.shape)} must all be [B]"
        )
    outside = kl_new_old.detach() >= threshold
    further = ((ratio.detach() > 1.0) & (advantages > 0)) | ((ratio.detach() < 1.0) & (advantages < 0))
    return (~(outside & further)).float()


def dppo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    kl_new_old: torch.Tensor,
    *,
    threshold: float,
    adv_clip_max: float,
    kl_beta: float = 0.0,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    kl_std: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """L = mean(−Â·r·keep) + β·KL (module docstring). All per-sample inputs [B].

    Returns the loss, the keep mask [B] and metrics: ``policy_loss``, ``ratio_mean``, ``keep_frac``,
    ``kl_new_old`` (mean D), ``approx_kl`` (½·mean Δlogp², the monitor GRPO logs), ``kl`` (with β > 0),
    ``loss``. With ``kl_beta > 0``, ``mean``, ``ref_mean`` and ``kl_std`` are required.

    Args:
        log_prob: log p_θ per sample, [B].
        old_log_prob: log p_old stored at rollout, [B].
        advantages: A, [B] (clipped to ±``adv_clip_max`` here).
        kl_new_old: the trust-region divergence D, [B].
        threshold: τ of the trust region.
        adv_clip_max: A_max.
        kl_beta: β of the KL to the reference (0: none).
        mean: the policy's transition mean, [B, ...] (with ``kl_beta > 0``).
        ref_mean: the reference's transition mean, [B, ...] (with ``kl_beta > 0``).
        kl_std: the KL's std, broadcastable to ``mean`` (with ``kl_beta > 0``).

    Returns:
        ``(loss, keep, metrics)`` as described above.
    """
    if not (log_prob.ndim == 1 and log_prob.shape == old_log_prob.shape == advantages.shape):
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} and advantages "
            f"{tuple(advantages.shape)} must all be [B]"
        )
    if not threshold > 0 or not adv_clip_max > 0:
        raise ValueError(f"threshold and adv_clip_max must be > 0, got {threshold}, {adv_clip_max}")
    if kl_beta < 0:
        raise ValueError(f"kl_beta must be >= 0, got {kl_beta}")
    log_ratio = log_prob.float() - old_log_prob.detach().float()
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().float().clamp(-adv_clip_max, adv_clip_max)
    keep = trust_region_keep(kl_new_old, ratio, adv, threshold)
    loss = (-adv * ratio * keep).mean()
    metrics = {
        "policy_loss": loss.item(),
        "ratio_mean": ratio.mean().item(),
        "keep_frac": keep.mean().item(),
        "kl_new_old": kl_new_old.detach().float().mean().item(),
        "approx_kl": 0.5 * (log_ratio**2).mean().item(),
    }
    return grpo_losses.with_sde_kl(loss, metrics, kl_beta, mean, ref_mean, kl_std), keep, metrics
