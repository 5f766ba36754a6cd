"""CRD (centered reward distillation) loss: match centred implicit rewards to centred external rewards.

Reference code: X-GenGroup/Flow-Factory ``src/flow_factory/trainers/crd.py`` @
396dd6e28a6f1a43d3767c950b79976e89f1a072 (``compute_decay``; ``CRDTrainer._compute_crd_loss``;
``CRDTrainer.optimize`` steps 4-7: the implicit reward, the advantage normalisation, the centring, the
``adv_clip_max / crd_beta`` scaling and the reward-adaptive KL); arguments and defaults in
``src/flow_factory/hparams/training_args/crd.py`` @ c5b89b17. Paper: "Diffusion Reinforcement Learning
via Centered Reward Distillation", arXiv 2603.14128 (not read here: only Flow-Factory's code was checked,
and Flow-Factory says its code follows "the original CRD implementation", which is not public).

For samples i of the (global) minibatch at one σ, v* = ε − x_0:

    w_θ, w_old = max(mean_d |v − v*|, 1e-5)  (fp64, no gradient; 1 without ``adaptive_logp``)
    r_θ,i  = −mean_d[(v_θ − v*)²/w_θ − (v_old − v*)²/w_old]       (implicit reward vs the old snapshot)
    a_i    = clip(clip(A_i, ±A_max)/A_max/2 + ½, 0, 1)              (normalised advantage in [0, 1])
    p      = uniform (τ < 0) | softmax over the a > 0 samples (τ = 0) | softmax(a/τ) (τ > 0)
    R^c    = a − Σ p·a,   R^c_θ = r_θ − stopgrad(Σ p·r_θ)
    ℓ      = mean (β·R^c_θ − R^c)²   or   BCE-with-logits(β·R^c_θ, σ(R^c))
    τ ≥ 0: ℓ = ½ ℓ(p) + ½ ℓ(p⁻), p⁻ the same with −a (τ > 0) or the a < 0 samples (τ = 0)
    L      = ℓ·A_max/max(β, 1e-8) + KL
    KL     = β_KL·mean kl_i,  or reward-adaptive β_KL·mean((c + a_i(1 − c))·kl_i), c = 1e-4/max(β_KL, 1e-8)
    kl_i   = mean_d (v_θ − v_ref)²   (v_ref: the frozen reference, classifier-free guided at ``kl_cfg``)

The sums over the minibatch use every rank's a and r_θ (gathered, detached); the loss is the mean over
this rank's samples. Verified against Flow-Factory line by line (the transcription test): the fp64 weights
(the r_θ is fp64 through the promotion), the uniform softmax at τ = ∞, the empty-pool fallback to uniform
at τ = 0, the ½/½ dual-direction average, and KL always added (0 when β_KL = 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_decay(step: int, start_step: int, start_value: float, slope: float, end_value: float) -> float:
    """Flow-Factory ``compute_decay``: ``start_value`` before ``start_step``, then
    min(start_value + (step − start_step)·slope, end_value)."""
    if step < start_step:
        return start_value
    return min(start_value + (step - start_step) * slope, end_value)


def parse_decay(text: str) -> tuple[int, float, float, float]:
    """``"start_step-start_value-slope-end_value"`` (Flow-Factory's string form) -> the four numbers."""
    parts = text.split("-")
    if len(parts) != 4:
        raise ValueError(f"decay must be 'start_step-start_value-slope-end_value', got {text!r}")
    start, value, slope, end = (float(p) for p in parts)
    if start != int(start) or start < 0:
        raise ValueError(f"decay start_step must be a non-negative integer, got {parts[0]!r}")
    return int(start), value, slope, end


def implicit_reward(
    velocity: torch.Tensor, old_velocity: torch.Tensor, target: torch.Tensor, *, adaptive: bool = True
) -> torch.Tensor:
    """r_θ per sample [B] (module docstring); fp64 when ``adaptive`` (as Flow-Factory's promotion)."""
    old = old_velocity.detach()
    if adaptive:
        dims = tuple(range(1, velocity.ndim))
        with torch.no_grad():
            weight_theta = (
                (velocity.double() - target.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
            )
            weight_old = (old.double() - target.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
        r = -((velocity - target) ** 2 / weight_theta - (old - target) ** 2 / weight_old)
    else:
        r = -((velocity - target) ** 2 - (old - target) ** 2)
    return r.mean(dim=tuple(range(1, r.ndim)))


def normalised_advantage(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """a = clip(clip(A, ±A_max)/A_max/2 + ½, 0, 1), [B]."""
    clipped = advantages.detach().clamp(-adv_clip_max, adv_clip_max)
    return ((clipped / adv_clip_max) / 2.0 + 0.5).clamp(0, 1)


def _pool(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if mask.sum() == 0:
        return torch.ones_like(adv) / adv.shape[0]
    return torch.softmax(adv.where(mask, torch.tensor(float("-inf"), dtype=adv.dtype)), dim=0)


def _matching(r_local, r_avg, a_local, a_avg, beta: float, loss_type: str) -> torch.Tensor:
    rc = a_local - a_avg
    rc_theta = r_local - r_avg.detach()
    if loss_type == "bce":
        return F.binary_cross_entropy_with_logits(
            beta * rc_theta, torch.sigmoid(rc.detach()), reduction="mean"
        )
    return ((beta * rc_theta - rc) ** 2).mean()


def crd_loss(
    r_local: torch.Tensor,
    r_all: torch.Tensor,
    a_local: torch.Tensor,
    a_all: torch.Tensor,
    *,
    beta: float,
    adv_clip_max: float,
    weight_temp: float = -1.0,
    loss_type: str = "mse",
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_policy, ℓ): ℓ of the module docstring and L_policy = ℓ·A_max/max(β, 1e-8).

    Args:
        r_local: r_θ of this rank's samples, [b] (with gradient).
        r_all: r_θ of every rank's samples, [N] (detached).
        a_local: a of this rank's samples, [b].
        a_all: a of every rank's samples, [N].
        beta: β (``crd_beta``).
        adv_clip_max: A_max.
        weight_temp: τ (< 0 uniform, 0 hard pools, > 0 softmax temperature).
        loss_type: "mse" or "bce".
    """
    if loss_type not in ("mse", "bce"):
        raise ValueError(f"loss_type must be 'mse' or 'bce', got {loss_type!r}")
    r_all = r_all.detach()
    if weight_temp < 0:
        p = torch.ones_like(a_all) / a_all.shape[0]  # softmax(a/∞)
        ori = _matching(r_local, (r_all * p).sum(0, keepdim=True), a_local, (a_all * p).sum(0, keepdim=True),
                        beta, loss_type)  # fmt: skip
    else:
        if weight_temp == 0:
            p, p_minus = _pool(a_all, a_all > 0.0), _pool(a_all, a_all < 0.0)
        else:
            p, p_minus = torch.softmax(a_all / weight_temp, dim=0), torch.softmax(-a_all / weight_temp, dim=0)
        plus = _matching(r_local, (r_all * p).sum(0, keepdim=True), a_local, (a_all * p).sum(0, keepdim=True),
                         beta, loss_type)  # fmt: skip
        minus = _matching(
            r_local, (r_all * p_minus).sum(0, keepdim=True), a_local, (a_all * p_minus).sum(0, keepdim=True),
            beta, loss_type,
        )  # fmt: skip
        ori = 0.5 * plus + 0.5 * minus
    return (ori * adv_clip_max / max(beta, 1e-8)).mean(), ori


def crd_kl(
    velocity: torch.Tensor,
    ref_velocity: torch.Tensor,
    a_local: torch.Tensor,
    *,
    kl_beta: float,
    reward_adaptive: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(KL loss, mean kl_i): β_KL·mean kl_i, or the reward-adaptive form (module docstring)."""
    kl_div = ((velocity - ref_velocity.detach()) ** 2).mean(dim=tuple(range(1, velocity.ndim)))
    if reward_adaptive:
        min_coef = 1e-4 / max(kl_beta, 1e-8)
        kl_loss = kl_beta * torch.mean((min_coef + a_local * (1 - min_coef)) * kl_div)
    else:
        kl_loss = kl_beta * kl_div.mean()
    return kl_loss, kl_div.mean()
