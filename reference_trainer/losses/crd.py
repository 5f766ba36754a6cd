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
    p      = uniform (τ < 0) | softmax over the a > ½ samples (τ = 0) | softmax(a/τ) (τ > 0), within
             the sample's prompt group G(i)
    R^c    = a − Σ_{G(i)} p·a,   R^c_θ = r_θ − stopgrad(Σ_{G(i)} p·r_θ)
    ℓ      = mean (β·R^c_θ − R^c)²   or   BCE-with-logits(β·R^c_θ, σ(R^c))
    τ ≥ 0: ℓ = ½ ℓ(p) + ½ ℓ(p⁻), p⁻ the same with −a (τ > 0) or the a < ½ samples (τ = 0)
    L      = ℓ·A_max/max(β, 1e-8) + KL
    KL     = β_KL·mean kl_i,  or reward-adaptive β_KL·mean((c + a_i(1 − c))·kl_i), c = 1e-4/max(β_KL, 1e-8)
    kl_i   = mean_d (v_θ − v_ref)²   (v_ref: the frozen reference, classifier-free guided at ``kl_cfg``)

The sums over a group use every rank's a and r_θ (gathered, detached); the loss is the mean over this
rank's samples. Two departures from Flow-Factory, both for the paper's within-prompt premise: its code
centres over the whole gathered minibatch, which holds several prompt groups whenever there are two
ranks or one minibatch per iteration; and its τ = 0 pools test a > 0 / a < 0 on a ∈ [0, 1], so that the
negative pool is always empty; here they split at a = ½ (A = 0). Verified against Flow-Factory line by line (the transcription test): the fp64 weights
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
    """softmax(a) over the masked samples, or uniform when the mask is empty (Flow-Factory's fallback)."""
    if mask.sum() == 0:
        return torch.ones_like(adv) / adv.shape[0]
    return torch.softmax(adv.where(mask, torch.tensor(float("-inf"), dtype=adv.dtype)), dim=0)


def group_weights(a: torch.Tensor, weight_temp: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(p, p⁻) of one prompt group's normalised advantages a [K] (module docstring); p⁻ None for τ < 0.

    τ = 0 splits at a = ½, the sign of the advantage A (Flow-Factory's docs: "positive pool (adv > 0) vs
    negative pool (adv < 0)"; its code tests a > 0 / a < 0 on a ∈ [0, 1], which leaves the negative pool
    always empty: that is not kept).
    """
    if weight_temp < 0:
        return torch.ones_like(a) / a.shape[0], None  # softmax(a/∞)
    if weight_temp == 0:
        return _pool(a, a > 0.5), _pool(a, a < 0.5)
    return torch.softmax(a / weight_temp, dim=0), torch.softmax(-a / weight_temp, dim=0)


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
    groups_local: torch.Tensor | None = None,
    groups_all: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_policy, ℓ): ℓ of the module docstring and L_policy = ℓ·A_max/max(β, 1e-8).

    The averages Σ p·a and Σ p·r_θ are taken within each sample's prompt group (the paper's centring;
    the samples of a group must all be in ``*_all``); without group ids, over all the samples as one
    group (Flow-Factory's centring over the gathered minibatch).

    Args:
        r_local: r_θ of this rank's samples, [b] (with gradient).
        r_all: r_θ of every rank's samples, [N] (detached).
        a_local: a of this rank's samples, [b].
        a_all: a of every rank's samples, [N].
        beta: β (``crd_beta``).
        adv_clip_max: A_max.
        weight_temp: τ (< 0 uniform, 0 hard pools split at a = ½, > 0 softmax temperature).
        loss_type: "mse" or "bce".
        groups_local: the prompt group of each of this rank's samples, [b].
        groups_all: the prompt group of every rank's samples, [N].
    """
    if loss_type not in ("mse", "bce"):
        raise ValueError(f"loss_type must be 'mse' or 'bce', got {loss_type!r}")
    if (groups_local is None) != (groups_all is None):
        raise ValueError("groups_local and groups_all go together")
    if groups_all is None:
        groups_all = torch.zeros(len(a_all), dtype=torch.long)
        groups_local = torch.zeros(len(a_local), dtype=torch.long)
    r_all = r_all.detach()
    a_avg, r_avg = {}, {}  # per group: (plus, minus) averages
    for group in groups_all.unique().tolist():
        rows = groups_all == group
        p, p_minus = group_weights(a_all[rows], weight_temp)
        pools = (p,) if p_minus is None else (p, p_minus)
        a_avg[group] = [(a_all[rows] * q).sum() for q in pools]
        r_avg[group] = [(r_all[rows] * q).sum() for q in pools]
    missing = set(groups_local.tolist()) - set(a_avg)
    if missing:
        raise ValueError(
            f"groups {sorted(missing)} of this rank's samples are not among every rank's samples"
        )
    pools = len(next(iter(a_avg.values())))
    parts = []
    for k in range(pools):
        a_mean = torch.stack([a_avg[g][k] for g in groups_local.tolist()])
        r_mean = torch.stack([r_avg[g][k] for g in groups_local.tolist()])
        parts.append(_matching(r_local, r_mean, a_local, a_mean, beta, loss_type))
    ori = parts[0] if pools == 1 else 0.5 * parts[0] + 0.5 * parts[1]
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
