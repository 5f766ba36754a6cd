"""TDM-R1 losses as its authors wrote them: the fake score, the surrogate reward model, the generator.

Paper: "TDM-R1: Reinforcing Few-Step Diffusion Models with Non-Differentiable Reward" (arXiv
2603.07700). Transcribed from the authors' training script, Luo-Yihong/TDM-R1 @
cc55d8975345e565b09d9c02c2800b69ca26fe90, ``scripts/train_tdmr1_pub.py``: the helpers ``convert`` /
``inv_convert``, the group loss ``compute_group_dgpo_loss_allreduce`` and, in ``main``, the three role
steps inside ``for j in tqdm(sampled_timesteps, ...)`` ("TDM-Style Fake Score Training", "DGPO-style
Training of Surrogate Reward", "TDM-R1 Training of few-step generator"). Each formula below quotes the
script's line it restates. Flow-Factory's re-reading of the algorithm is
``reference_trainer.losses.tdm_r1_flow_factory``.

Notation (σ = t/1000 of the authors' timesteps; the authors' sampling schedule and SD3 are flow
matching, x_σ = (1 − σ)·x_0 + σ·ε, v = ε − x_0):

    s(u) = 3u / (1 + 2u), s⁻¹(σ) = σ / (3 − 2σ)              ``convert`` / ``inv_convert`` with s = 3
    τ(u; lo) = s(u·(1 − (s⁻¹(lo) + g)) + s⁻¹(lo) + g)        re-noise time above lo, u ~ U(0, 1), g = 0.02
    α = (1 − σ_τ)/(1 − σ_n),  β = √(σ_τ² − (σ_n·α)²)        the forward re-noise of a state at σ_n
    x_τ = α·x_n + β·ε                                        ``xtau = model_xnext * alpha + beta * noise_diffuse``

Fake score ("TDM-Style Fake Score Training"), at the generator's own one-step state x̂_n = x_j − (σ_j − σ_n)·v_G:

    v* = (x_τ − x̂_0)/σ_τ,  L_F = mean (v* − v_F)² + 0.02·mean (v_real − v_F)²
                                        ``accelerator.backward(loss_fake + 0.02 * loss_reg_fake)``

Surrogate reward model ("DGPO-style Training of Surrogate Reward"), at the rollout's stored x_{j+1} re-noised with ε shared by
the group's samples: the target of the authors' derivation (η = 0, a vanishing step)

    v* = −x_n/(1 − σ_n) + ε/β·(σ_τ + σ_n²·α/(1 − σ_n))
    d_s, d_slow, d_ref = mean_d (v* − v)² per sample (surrogate, slow copy, frozen reference)
    trust clip   r = exp(d_slow − d_s); Â > 0 ? r > 1 + ε : r < 1 − ε → d_s detached      (DGPO's)
    R            = mean (v_s − v_ref)²  (one number for the whole batch)
    runaway clip R > τ_R ∧ (Â > 0 ? d_s < d_ref : d_s > d_ref) → d_s detached
    s_G          = Σ_{i∈G} Â_i·β_dpo·(d_s − d_ref)_i / K  (detached)
    L_S          = w_j·[mean σ(s_{G(i)})·Â_i·d_s,i + β·R],  w_j = (j_s + 1)/N, j_s drawn ∝ j_s + 1
        ``accelerator.backward(t_weight * (dgpo_loss.mean() + config.train.beta * loss_reg_dgpo))``,
        ``should_clip_ref = (loss_reg_dgpo > reg_threshold) & torch.where(...)``,
        ``t_weight = (j_dgpo + 1) / config.sample.num_steps``, ``probs = weights / weights.sum()``

Generator ("TDM-R1 Training of few-step generator"), x̂_0 = x_j − σ_j·v_G with gradient, at x_τ (fresh ε) and x_τ' (the reward
time, ε shared by the group):

    x̂_0^cfg   = the teacher guided at scale s_real (4.5)                 the normaliser λ = mean|x̂_0 − x̂_0^cfg|
    e_cfg     = (x̂_0 − sg(x̂_0 + c_r·(x̂_0^cond − x̂_0^uncond)))²          c_r = 3.5, the CFG "reward"
    e_kl      = (x̂_0 − sg(x̂_0 + (x̂_0^cond − x̂_0^fake)))²                the teacher unguided
    e_rew     = (x̂_0 − sg(x̂_0 + (x̂_0^sur − x̂_0^ref)))²                  at x_τ': surrogate guided at s_rl,
                                                                          reference unguided; λ' = mean|x̂_0 − x̂_0^sur|
    j < trunc:  L_G = w·c·mean ρ(e_cfg)/λ + (1 − w)·mean ρ(e_rew)/λ' + mean ρ(e_kl)/λ
    otherwise:  L_G = w·mean ρ(e_cfg + e_kl)/λ

        ``cfg_revised_x0 = (model_x0 + 3.5 * (real_cond_x0 - real_uncond_x0)).detach()``,
        ``kl_revised_x0 = (model_x0 + 1 * (real_cond_x0 - fake_x0)).detach()``,
        ``loss = config.train.tdm_weight * loss_cfg_reward + (1 - config.train.tdm_weight) * loss_reward + loss_kl``

ρ(e) = e, or the pseudo-Huber √(e + c_h²) − c_h; the factor c = 3.5 under the pseudo-Huber form and 1
under the squared one (``loss_cfg_reward = 3.5 * torch.mean(...)`` in the ``use_huber`` branch only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from reference_trainer.losses.dgpo import dgpo_loss, dsm_clip, dsm_error, group_logits

HUBER_CFG_FACTOR = 3.5
"""The factor of the CFG-reward term under the pseudo-Huber form only (``loss_cfg_reward = 3.5 *
torch.mean(...)``): a literal in the script, not tied to c_r."""
FAKE_TEACHER_WEIGHT = 0.02
"""The weight of the fake score's pull to the teacher's velocity (``loss_fake + 0.02 * loss_reg_fake``)."""


def shift_time(u: torch.Tensor, shift: float) -> torch.Tensor:
    """s(u) = shift·u / (1 + (shift − 1)·u) (``convert``, in σ units)."""
    return shift * u / (1.0 + (shift - 1.0) * u)


def unshift_time(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """s⁻¹(σ) = σ / (shift − (shift − 1)·σ) (``inv_convert``, in σ units)."""
    return sigma / (shift - (shift - 1.0) * sigma)


def renoise_sigma(u: float, lower: torch.Tensor, *, shift: float, gap: float) -> torch.Tensor:
    """τ(u; lo) of the module doc: uniform in the unshifted time above s⁻¹(lo) + gap, then shifted.

    Args:
        u: the draw, in [0, 1).
        lower: lo per sample, [B].
        shift: the time shift (3).
        gap: the unshifted gap above lo (0.02, the authors' ``+ 20`` of 1000).

    Returns:
        σ_τ per sample, [B].
    """
    low = unshift_time(lower, shift) + gap
    return shift_time(u * (1.0 - low) + low, shift)


def forward_renoise(
    x_next: torch.Tensor, sigma_next: torch.Tensor, sigma_tau: torch.Tensor, noise: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x_τ = α·x_n + β·ε with α = (1 − σ_τ)/(1 − σ_n), β = √(σ_τ² − (σ_n α)²) (module doc).

    Args:
        x_next: x_n, [B, ...].
        sigma_next: σ_n, [B].
        sigma_tau: σ_τ > σ_n, [B].
        noise: ε, [B, ...].

    Returns:
        ``(x_tau, alpha, beta)``, α and β broadcastable to x_n.
    """
    shape = (-1,) + (1,) * (x_next.ndim - 1)
    s_n, s_tau = sigma_next.reshape(shape), sigma_tau.reshape(shape)
    alpha = (1.0 - s_tau) / (1.0 - s_n)
    beta = (s_tau**2 - (s_n * alpha) ** 2) ** 0.5
    return x_next * alpha + beta * noise, alpha, beta


def surrogate_target(
    x_next: torch.Tensor,
    noise: torch.Tensor,
    sigma_next: torch.Tensor,
    sigma_tau: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """v* = −x_n/(1 − σ_n) + ε/β·(σ_τ + σ_n²·α/(1 − σ_n)) (``target_v_dgpo``), [B, ...]."""
    shape = (-1,) + (1,) * (x_next.ndim - 1)
    s_n, s_tau = sigma_next.reshape(shape), sigma_tau.reshape(shape)
    return -x_next / (1.0 - s_n) + noise / beta * (s_tau + s_n**2 * alpha / (1.0 - s_n))


def fake_score_loss(
    v_fake: torch.Tensor, v_target: torch.Tensor, v_real: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """L_F = mean (v* − v_F)² + 0.02·mean (v_real − v_F)² (module doc).

    Args:
        v_fake: the fake score's velocity with its graph, [B, ...].
        v_target: v* = (x_τ − x̂_0)/σ_τ, [B, ...].
        v_real: the teacher's (unguided) velocity, [B, ...].

    Returns:
        The scalar loss and metrics ``loss``, ``dsm_loss``, ``teacher_gap``.
    """
    dsm = (v_target.detach() - v_fake).square().mean()
    gap = (v_real.detach() - v_fake).square().mean()
    loss = dsm + FAKE_TEACHER_WEIGHT * gap
    return loss, {"loss": loss.item(), "dsm_loss": dsm.item(), "teacher_gap": gap.item()}


def surrogate_loss(
    v_surrogate: torch.Tensor,
    v_reference: torch.Tensor,
    v_slow: torch.Tensor,
    v_target: torch.Tensor,
    advantages: torch.Tensor,
    group_index: torch.Tensor,
    *,
    group_size: int,
    beta_dpo: float,
    clip_range: float,
    runaway_threshold: float,
    reference_beta: float,
    time_weight: float,
    batch_mean: Callable[[torch.Tensor], float] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L_S of the module doc.

    Args:
        v_surrogate: the surrogate's velocity with its graph, [B, ...].
        v_reference: the frozen reference's velocity, [B, ...].
        v_slow: the slow surrogate copy's velocity, [B, ...].
        v_target: v*, [B, ...].
        advantages: Â (clipped), [B].
        group_index: dense group of each sample (whole groups), [B].
        group_size: K.
        beta_dpo: β_dpo of the group logit.
        clip_range: ε of the trust clip (the script has no off switch: at 0 every sample whose ratio
            moved in its advantage's direction is detached).
        runaway_threshold: τ_R of the runaway clip on R.
        reference_beta: β of the penalty β·R.
        time_weight: w_j.
        batch_mean: how R's value becomes one number for the batch of every rank (the authors: per GPU
            batch); None = this batch's mean. The penalty's gradient is this rank's mean either way.

    Returns:
        The scalar loss and metrics ``loss``, ``trust_clip_ratio``, ``runaway_clip_ratio``,
        ``reference_penalty`` (R), ``value_delta`` = mean (d_s − d_ref), ``preference_gap`` =
        mean Â·(d_s − d_ref).
    """
    dsm = dsm_error(v_surrogate, v_target.detach())
    ref_dsm = dsm_error(v_reference.detach(), v_target.detach())
    slow_dsm = dsm_error(v_slow.detach(), v_target.detach())
    values, trust = dsm_clip(dsm, slow_dsm, advantages, clip_range)  # the script has no off switch
    penalty = dsm_error(v_surrogate.float(), v_reference.detach().float()).mean()  # R
    batch_penalty = float(penalty.detach()) if batch_mean is None else batch_mean(penalty.detach())
    improved = torch.where(advantages > 0, values < ref_dsm, values > ref_dsm)
    runaway = improved & (batch_penalty > runaway_threshold)
    values = torch.where(runaway, values.detach(), values)
    logits = group_logits(values - ref_dsm, advantages, group_index, beta_dpo=beta_dpo, group_size=group_size)
    preference, _ = dgpo_loss(values, advantages, logits[group_index])
    loss = time_weight * (preference + reference_beta * penalty)
    delta = (dsm - ref_dsm).detach()
    metrics = {
        "loss": loss.item(),
        "trust_clip_ratio": trust.float().mean().item(),
        "runaway_clip_ratio": runaway.float().mean().item(),
        "reference_penalty": batch_penalty,
        "value_delta": delta.mean().item(),
        "preference_gap": (advantages * delta).mean().item(),
    }
    return loss, metrics


def _normalised(error: torch.Tensor, normaliser: torch.Tensor, huber_c: float | None) -> torch.Tensor:
    """mean ρ(e)/λ (ρ of the module doc), in float64 as the authors' double normaliser makes it."""
    rho = error if huber_c is None else (error + huber_c**2).sqrt() - huber_c
    return (rho / normaliser).mean()


def _normaliser(x0: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """λ = mean over each sample's elements of |x̂_0 − anchor| (float64, detached), [B, 1, ...]."""
    dims = tuple(range(1, x0.ndim))
    normaliser = (x0.detach().double() - anchor.double()).abs().mean(dim=dims, keepdim=True)
    if not bool((normaliser > 0).all()):
        raise ValueError("TDM-R1 generator loss: x̂_0 equals its anchor (normaliser 0)")
    return normaliser


def generator_loss(
    x0: torch.Tensor,
    x0_guided: torch.Tensor,
    x0_cond: torch.Tensor,
    x0_uncond: torch.Tensor,
    x0_fake: torch.Tensor,
    reward: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    tdm_weight: float,
    cfg_reward_scale: float,
    huber_c: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L_G of the module doc.

    Args:
        x0: the generator's x̂_0 with its graph, [B, ...].
        x0_guided: the teacher's x̂_0 guided at s_real, at x_τ, [B, ...].
        x0_cond, x0_uncond: the teacher's conditional and unconditional x̂_0 at x_τ, [B, ...].
        x0_fake: the fake score's x̂_0 at x_τ, [B, ...].
        reward: ``(x̂_0^sur, x̂_0^ref)`` at x_τ' for a stage j < trunc, else None (no reward terms).
        tdm_weight: w.
        cfg_reward_scale: c_r.
        huber_c: c_h of the pseudo-Huber form, or None for the squared error.

    Returns:
        The scalar loss and metrics ``loss``, ``tdm_loss``, ``cfg_reward_loss``, ``kl_loss``,
        ``surrogate_reward_loss`` (0 past trunc), ``normaliser_mean``.
    """
    base = x0.detach()
    normaliser = _normaliser(x0, x0_guided)
    e_cfg = (base + cfg_reward_scale * (x0_cond - x0_uncond) - x0).square()
    e_kl = (base + (x0_cond - x0_fake) - x0).square()
    tdm = _normalised(e_cfg + e_kl, normaliser, huber_c)
    cfg = (HUBER_CFG_FACTOR if huber_c is not None else 1.0) * _normalised(e_cfg, normaliser, huber_c)
    kl = _normalised(e_kl, normaliser, huber_c)
    surrogate = torch.zeros((), dtype=torch.float64)
    if reward is None:
        loss = tdm_weight * tdm
    else:
        x0_surrogate, x0_reference = reward
        e_reward = (base + (x0_surrogate - x0_reference) - x0).square()
        surrogate = _normalised(e_reward, _normaliser(x0, x0_surrogate), huber_c)
        loss = tdm_weight * cfg + (1.0 - tdm_weight) * surrogate + kl
    metrics = {
        "loss": loss.item(),
        "tdm_loss": tdm.item(),
        "cfg_reward_loss": cfg.item(),
        "kl_loss": kl.item(),
        "surrogate_reward_loss": surrogate.item(),
        "normaliser_mean": normaliser.mean().item(),
    }
    return loss.float(), metrics
