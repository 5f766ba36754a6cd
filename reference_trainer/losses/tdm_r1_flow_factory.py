"""TDM-R1 losses as Flow-Factory reads them (``train.variant: flow_factory``): the surrogate reward
model's clipped group preference, and the generator's reward terms.

Paper: "TDM-R1: Reinforcing Few-Step Diffusion Models with Non-Differentiable Reward" (arXiv
2603.07700). The authors' own algorithm (their ``scripts/train_tdmr1_pub.py``) is
``reference_trainer.losses.tdm_r1``, the default; this module is Flow-Factory's re-interpretation
(X-GenGroup/Flow-Factory @ 15932582d7f0eec90c77406b9dda5cd4da7fd9b5,
``src/flow_factory/trainers/distillation/tdm_r1.py``: ``_surrogate_boundary_loss``,
``_clip_outside_trust_region``, ``_clip_runaway_surrogate``, ``_time_weight``,
``_generator_boundary_loss``, ``_guidance_reward_direction``, ``_surrogate_reward_direction``; the
group preference of ``distillation/group_preference.py`` ``group_preference_loss``, legacy form, which
is DGPO's loss: ``reference_trainer.losses.dgpo``).

Surrogate. On a forward-noised boundary state x_t (target velocity v* = ε − x_b), per sample the DSM
values d_s (surrogate), d_ref (frozen reference) and d_slow (the slow surrogate copy); advantages
Â = clip(A, ±A_max):

    trust clip   r = exp(d_slow − d_s); Â > 0 ? r > 1 + ε : r < 1 − ε  → d_s detached   (= DGPO's DSM clip)
    runaway clip improved = Â > 0 ? d_s < d_ref : d_s > d_ref; improved ∧ (d_s − d_ref)² > τ → detached
    s_G          = Σ_{i∈G} Â_i·β·(d_s − d_ref)_i / K                                  (detached)
    L_S          = w_b · [ mean σ(s_{G(i)})·Â_i·d̃_s,i + β_ref·mean (d_s − d_ref)² ],   w_b = (b + 1)/K

Generator. With the TDM terms x̂_0 (the generator's, with gradient), x̂_0^real, x̂_0^fake at x_t:

    L_G = ρ(x̂_0 ; x̂_0 + (x̂_0^real − x̂_0^fake), x̂_0^real)                     (TDM, no coefficient)
        + w · ρ(x̂_0 ; x̂_0 + c_r·(x̂_0^cond − x̂_0^uncond), x̂_0^real)           (guidance reward, when s > 1)
        + (1 − w) · ρ(x̂_0 ; x̂_0 + (x̂_0^sur − x̂_0^real), x̂_0^sur)             (surrogate reward)

with ρ(x̂_0; x̃_0, anchor) = ``losses.tdm.revised_x0_loss`` and c_r = ``cfg_reward_scale`` (Flow-Factory
divides the guided − conditional difference by s − 1: the same c_r·(cond − uncond)).
"""

from __future__ import annotations

import torch

from reference_trainer.losses.dgpo import dgpo_loss, dsm_clip, group_logits
from reference_trainer.losses.tdm import revised_x0_loss


def runaway_clip(
    dsm: torch.Tensor, ref_dsm: torch.Tensor, advantages: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Detach d_s where it already improved past the reference by more than τ (module doc).

    Args:
        dsm: d_s, [B].
        ref_dsm: d_ref, [B].
        advantages: Â, [B].
        threshold: τ.

    Returns:
        ``(d_s with the clipped rows detached, clipped mask [B] bool)``.
    """
    improved = torch.where(advantages > 0, dsm < ref_dsm, dsm > ref_dsm)
    clipped = improved & ((dsm - ref_dsm).square() > threshold)
    return torch.where(clipped, dsm.detach(), dsm), clipped


def surrogate_loss(
    dsm: torch.Tensor,
    ref_dsm: torch.Tensor,
    slow_dsm: torch.Tensor,
    advantages: torch.Tensor,
    group_index: torch.Tensor,
    *,
    group_size: int,
    beta: float,
    clip_range: float,
    runaway_threshold: float,
    reference_beta: float,
    time_weight: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L_S (module doc). All [B]; ``time_weight`` is w_b per sample (constant within a group).

    Returns:
        The scalar loss and metrics ``loss``, ``trust_clip_ratio``, ``runaway_clip_ratio``,
        ``reference_penalty``, ``value_delta``, ``preference_gap`` = mean Â·(d_s − d_ref) (< 0: the
        surrogate denoises the preferred samples better than the reference, the others worse).
    """
    ref_dsm, slow_dsm = ref_dsm.detach(), slow_dsm.detach()
    if clip_range > 0:
        values, trust = dsm_clip(dsm, slow_dsm, advantages, clip_range)
    else:
        values, trust = dsm, torch.zeros_like(dsm, dtype=torch.bool)
    values, runaway = runaway_clip(values, ref_dsm, advantages, runaway_threshold)
    logits = group_logits(dsm - ref_dsm, advantages, group_index, beta_dpo=beta, group_size=group_size)
    preference, _ = dgpo_loss(values * time_weight, advantages, logits[group_index])
    penalty = ((dsm - ref_dsm).square() * time_weight).mean()
    loss = preference + reference_beta * penalty
    metrics = {
        "loss": loss.item(),
        "trust_clip_ratio": trust.float().mean().item(),
        "runaway_clip_ratio": runaway.float().mean().item(),
        "reference_penalty": (dsm - ref_dsm).square().mean().item(),
        "value_delta": (dsm - ref_dsm).mean().item(),
        "preference_gap": (advantages * (dsm - ref_dsm)).mean().item(),
    }
    return loss, metrics


def generator_reward_loss(
    x0: torch.Tensor,
    x0_real: torch.Tensor,
    x0_fake: torch.Tensor,
    x0_surrogate: torch.Tensor,
    *,
    tdm_weight: float,
    guidance_direction: torch.Tensor | None,
    huber_c: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L_G = TDM + w·guidance reward + (1 − w)·surrogate reward (module doc).

    Args:
        x0: the generator's x̂_0 with its graph, [B, ...].
        x0_real: the reference's x̂_0 at x_t, [B, ...].
        x0_fake: the fake score's x̂_0, [B, ...].
        x0_surrogate: the surrogate's x̂_0, [B, ...].
        tdm_weight: w.
        guidance_direction: c_r·(x̂_0^cond − x̂_0^uncond), or None (no guidance reward).
        huber_c: the pseudo-Huber c, or None for the squared error.

    Returns:
        The scalar loss and metrics ``loss``, ``tdm_loss``, ``guidance_reward_loss``, ``surrogate_reward_loss``.
    """
    base = x0.detach()
    tdm, _ = revised_x0_loss(x0, base + (x0_real - x0_fake), x0_real, huber_c=huber_c)
    guidance = torch.zeros(())
    if guidance_direction is not None:
        guidance, _ = revised_x0_loss(x0, base + guidance_direction, x0_real, huber_c=huber_c)
    surrogate, _ = revised_x0_loss(x0, base + (x0_surrogate - x0_real), x0_surrogate, huber_c=huber_c)
    loss = tdm + tdm_weight * guidance + (1.0 - tdm_weight) * surrogate
    metrics = {
        "loss": loss.item(),
        "tdm_loss": tdm.item(),
        "guidance_reward_loss": float(guidance.detach()),
        "surrogate_reward_loss": surrogate.item(),
    }
    return loss, metrics
