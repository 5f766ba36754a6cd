"""AWM (advantage-weighted matching) loss: PPO clip on a flow-matching "log-prob", with KL and EMA-KL.

Reference code: scxue/advantage_weighted_matching ``advantage_weighted_matching/scripts/train_sd3_awm.py``
@ be5137232e33a21b449ed65a533211d0deb97ed8: ``compute_log_prob_awm`` (lines 210-252: the fp64 velocity
error and its weighting) and the training step (lines 1289-1354: advantage clip, ``loss_type``
``sum_first`` / ``exp_first`` ratio, PPO clip, KL, EMA-KL). Flow-Factory's ``awm`` trainer is the
framework analogue.

For S trained noise levels σ_s and B samples, with x_t = (1 − σ)x_0 + σε and v* = ε − x_0:

    e        = mean_d (v_θ(x_t) − v*)²                           (fp64)
    ℓ        = −e · w(σ):  uniform 1 | t σ | t**2 σ²
               huber:  −(√(e + 1e-10) − 1e-5)·σ
               ghuber: −((e + 1e-10)^p − (1e-10)^p)·σ/p           (p = ``ghuber_power``)
    sum_first: r_b = exp(mean_s ℓ_θ − mean_s ℓ_old)  [B];   exp_first: r_sb = exp(ℓ_θ − ℓ_old)  [S, B]
    Â        = clip(A, ±A_max);   L_pg = mean max(−Â·r, −Â·clip(r, 1 ± ε))
    L        = L_pg + β·mean (v_θ − v_ref)² + β_ema·mean (v_θ − v_ema)²

ℓ_old is the same ℓ of the old (sampling) policy at the *same* (σ, ε). The canonical script adds the
EMA-KL only inside its ``beta > 0`` branch; here the two weights are independent (Flow-Factory's form;
equal whenever β > 0). Only the canonical ``Uniform`` KL weighting is offered (not ``ELBO``).

Notation map (code -> canonical): velocity -> ``model_output`` (``noise_pred.double()``), log_prob ->
``log_prob``, kl_beta -> ``config.train.beta``, ema_kl_beta -> ``config.train.ema_beta``.
"""

from __future__ import annotations

from typing import Literal

import torch

WEIGHTINGS = ("uniform", "t", "t**2", "huber", "ghuber")


def awm_log_prob(
    velocity: torch.Tensor,
    noise: torch.Tensor,
    x0: torch.Tensor,
    sigma: torch.Tensor,
    *,
    weighting: str = "uniform",
    ghuber_power: float = 0.25,
) -> torch.Tensor:
    """ℓ of the module docstring, [B] fp64. velocity, noise, x0: [B, ...]; sigma: [B]."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    log_prob = -((velocity.double() - (noise.double() - x0.double())) ** 2)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    t = sigma.view(-1)
    if weighting == "t":
        log_prob = log_prob * t
    elif weighting == "t**2":
        log_prob = log_prob * t**2
    elif weighting == "huber":
        log_prob = -(torch.sqrt(-log_prob + 1e-10) - 1e-5) * t
    elif weighting == "ghuber":
        floor = torch.tensor(1e-10, dtype=log_prob.dtype).pow(ghuber_power)
        log_prob = -(torch.pow(-log_prob + 1e-10, ghuber_power) - floor) * t / ghuber_power
    return log_prob


def elbo_kl_weight(sigma: torch.Tensor) -> torch.Tensor:
    """1/(2·s²), s = √(σ/(1 − min(σ, 0.99)))·0.7: the original's ``ELBO`` KL weight per row (scxue/
    advantage_weighted_matching @ be513723 ``train_sd3_awm.py``: ``std_dev_t = torch.sqrt(sigma / (1 -
    torch.clamp(sigma, 0, 0.99)))*0.7``, ``kl_loss = ((model_output - model_output_ref) ** 2).mean(...) /
    (2 * std_dev_t ** 2)``). σ: [R]; returns [R]."""
    std = (sigma / (1.0 - sigma.clamp(0.0, 0.99))).sqrt() * 0.7
    return 1.0 / (2.0 * std**2)


def awm_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
    loss_type: Literal["sum_first", "exp_first"] = "sum_first",
    velocity: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    ref_velocity: torch.Tensor | None = None,
    ema_kl_beta: float = 0.0,
    ema_velocity: torch.Tensor | None = None,
    kl_row_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L of the module docstring. log_prob, old_log_prob: [S, B]; advantages: [B]; velocities [S, B, ...]
    (rows term-major, [S·B, ...]); ``kl_row_weight``: a weight per row of the KL terms, [S·B] (None: 1).

    Returns the loss and metrics ``policy_loss``, ``ratio_mean``, ``clip_frac``, ``kl`` / ``ema_kl``
    (with their β > 0), ``loss``.
    """
    if log_prob.ndim != 2 or log_prob.shape != old_log_prob.shape or advantages.shape != log_prob.shape[1:]:
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)} and old_log_prob {tuple(old_log_prob.shape)} must be [S, B], "
            f"advantages {tuple(advantages.shape)} [B]"
        )
    if not clip_range > 0 or not adv_clip_max > 0 or kl_beta < 0 or ema_kl_beta < 0:
        raise ValueError("need clip_range > 0, adv_clip_max > 0, kl_beta >= 0, ema_kl_beta >= 0")
    adv = advantages.detach().clamp(-adv_clip_max, adv_clip_max)
    if loss_type == "sum_first":
        ratio = torch.exp(log_prob.mean(dim=0) - old_log_prob.mean(dim=0).detach())
    elif loss_type == "exp_first":
        ratio = torch.exp(log_prob.reshape(-1) - old_log_prob.reshape(-1).detach())
        adv = adv.unsqueeze(0).repeat(log_prob.shape[0], 1).view(-1)
    else:
        raise ValueError(f"loss_type must be 'sum_first' or 'exp_first', got {loss_type!r}")
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.mean(torch.maximum(unclipped, clipped))
    metrics = {
        "policy_loss": loss.item(),
        "ratio_mean": ratio.mean().item(),
        "clip_frac": (torch.abs(ratio.detach() - 1.0) > clip_range).float().mean().item(),
    }
    for name, beta, other in (("kl", kl_beta, ref_velocity), ("ema_kl", ema_kl_beta, ema_velocity)):
        if beta > 0:
            if velocity is None or other is None:
                raise ValueError(f"{name} with beta > 0 needs velocity and its partner velocity")
            rows = ((velocity.double() - other.detach().double()) ** 2).reshape(len(velocity), -1).mean(dim=1)
            kl = rows.mean() if kl_row_weight is None else (kl_row_weight.double() * rows).mean()
            loss = loss + beta * kl
            metrics[name] = kl.item()
    metrics["loss"] = loss.item()
    return loss, metrics
