"""Diffusion-DPO loss (Wallace et al. 2023, "Diffusion Model Alignment Using Direct Preference
Optimization", arXiv 2311.12908, eq. 14), in its flow-matching / velocity form.

Paper (ε-prediction), for a preferred x^w and a rejected x^l noised with the same t:

    L = −log σ( −β/2 · [ (‖ε^w − ε_θ(x^w_t)‖² − ‖ε^w − ε_ref(x^w_t)‖²)
                         − (‖ε^l − ε_θ(x^l_t)‖² − ‖ε^l − ε_ref(x^l_t)‖²) ] )

(the paper's T·ω(λ_t) is folded into β, as the reference code does). Flow-matching form: the
network predicts the velocity and the regression target is v* = ε − x_0, so each ‖ε − ε_θ‖² becomes
e = ‖v_θ − v*‖² (flow_grpo ``scripts/train_sd3_dpo.py``; Flow-Factory ``trainers/common/dpo_objective.py``).

Reference code: SalesforceAIResearch/DiffusionDPO ``train.py`` and diffusers
``examples/research_projects/diffusion_dpo/train_diffusion_dpo.py``: ``model_losses = (pred -
target).pow(2).mean(dim=[1,2,3])``; ``model_diff = w − l``; ``ref_diff = w − l``; ``inside_term =
-0.5 * beta_dpo * (model_diff - ref_diff)``; ``loss = -logsigmoid(inside_term).mean()``;
``implicit_acc = (inside_term > 0).mean()``.

Notation map (code -> paper):
    e_theta_w, e_theta_l  -> ‖v*^w − v_θ(x^w_t)‖², ‖v*^l − v_θ(x^l_t)‖²  (mean over non-batch dims)  [B]
    e_ref_w, e_ref_l      -> the same for the frozen reference (no gradient)                        [B]
    beta                  -> β (Flow-Factory default 2000; Diffusion-DPO SD1.5: 5000)
    inside                -> −β/2 · Δ,  Δ = (e_θ^w − e_ref^w) − (e_θ^l − e_ref^l)

The two arms of a pair must share the noise ε and the noise level σ (the caller's job: the same
``noise``/``sigma`` tensors are used for both); conditioning may differ (offline DPO).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from reference_trainer.flow_matching import interpolate, velocity_target
from reference_trainer.losses.sft import per_sample_velocity_error


def diffusion_dpo_loss(
    e_theta_w: torch.Tensor,
    e_theta_l: torch.Tensor,
    e_ref_w: torch.Tensor,
    e_ref_l: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L = mean −log σ(−β/2 · ((e_θ^w − e_ref^w) − (e_θ^l − e_ref^l))). All inputs [B] per-sample errors.

    Metrics: ``implicit_acc`` (fraction with inside > 0, i.e. the policy prefers w more than the
    reference does), ``reward_w`` / ``reward_l`` (mean implicit rewards −β/2·(e_θ − e_ref)), ``margin``.

    Args:
        e_theta_w: the policy's per-sample velocity error on the chosen arm, [B].
        e_theta_l: the policy's per-sample velocity error on the rejected arm, [B].
        e_ref_w: the reference's error on the chosen arm, [B] (detached here).
        e_ref_l: the reference's error on the rejected arm, [B] (detached here).
        beta: β > 0.

    Returns:
        The scalar loss and the metrics above plus ``loss``.
    """
    if not (e_theta_w.shape == e_theta_l.shape == e_ref_w.shape == e_ref_l.shape and e_theta_w.ndim == 1):
        raise ValueError("Diffusion-DPO errors must all be [B] tensors of the same shape")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    reward_w = -0.5 * beta * (e_theta_w.float() - e_ref_w.detach().float())
    reward_l = -0.5 * beta * (e_theta_l.float() - e_ref_l.detach().float())
    inside = reward_w - reward_l  # = −β/2 · Δ
    loss = -F.logsigmoid(inside).mean()
    metrics = {
        "loss": loss.item(),
        "implicit_acc": (inside > 0).float().mean().item(),
        "reward_w": reward_w.mean().item(),
        "reward_l": reward_l.mean().item(),
        "margin": inside.mean().item(),
    }
    return loss, metrics


def diffusion_dpo_velocity_loss(
    v_theta_w: torch.Tensor,
    v_theta_l: torch.Tensor,
    v_ref_w: torch.Tensor,
    v_ref_l: torch.Tensor,
    v_target_w: torch.Tensor,
    v_target_l: torch.Tensor,
    *,
    beta: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The same loss from velocities [B, ...]: e = mean over non-batch dims of (v − v*)², fp32.

    Args:
        v_theta_w: the policy's velocities on the chosen arm, [B, ...].
        v_theta_l: the policy's velocities on the rejected arm, [B, ...].
        v_ref_w: the reference's velocities on the chosen arm, [B, ...].
        v_ref_l: the reference's velocities on the rejected arm, [B, ...].
        v_target_w: the regression target v* = ε − x_0 of the chosen arm, [B, ...].
        v_target_l: the target of the rejected arm, [B, ...].
        beta: β > 0.

    Returns:
        As ``diffusion_dpo_loss``.
    """
    return diffusion_dpo_loss(
        per_sample_velocity_error(v_theta_w, v_target_w),
        per_sample_velocity_error(v_theta_l, v_target_l),
        per_sample_velocity_error(v_ref_w, v_target_w),
        per_sample_velocity_error(v_ref_l, v_target_l),
        beta=beta,
    )


def pair_errors(
    x0_w: torch.Tensor,
    x0_l: torch.Tensor,
    sigma: torch.Tensor,
    noise: torch.Tensor,
    policy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    reference: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e_θ^w, e_θ^l, e_ref^w, e_ref^l), each [B], for pairs that share σ [B] and ε [B, ...].

    ``policy`` / ``reference`` map (x_σ [2B, ...], σ [2B]) to velocities [2B, ...] for the stacked
    batch [chosen; rejected] (both arms in one forward; the caller binds the condition, repeated
    twice). The reference runs in one ``no_grad`` scope.

    Args:
        x0_w: clean chosen latents, [B, ...].
        x0_l: clean rejected latents, [B, ...].
        sigma: the noise level of each pair, [B].
        noise: ε of each pair, [B, ...] (shared by both arms).
        policy: (x_σ, σ) -> velocity with gradients.
        reference: (x_σ, σ) -> velocity, run under ``no_grad``.

    Returns:
        ``(e_θ^w, e_θ^l, e_ref^w, e_ref^l)``, each [B] fp32.
    """
    if x0_w.shape != x0_l.shape or noise.shape != x0_w.shape:
        raise ValueError(
            f"chosen {tuple(x0_w.shape)}, rejected {tuple(x0_l.shape)}, noise {tuple(noise.shape)} differ"
        )
    b = x0_w.shape[0]
    x0 = torch.cat([x0_w, x0_l])  # [2B, ...]: chosen first, then rejected
    noise2, sigma2 = torch.cat([noise, noise]), torch.cat([sigma, sigma])
    x_t = interpolate(x0, noise2, sigma2)
    target = velocity_target(x0, noise2)
    v_theta = policy(x_t, sigma2)
    with torch.no_grad():
        v_ref = reference(x_t, sigma2)
    e_theta = per_sample_velocity_error(v_theta, target)  # [2B]
    e_ref = per_sample_velocity_error(v_ref, target)
    return e_theta[:b], e_theta[b:], e_ref[:b], e_ref[b:]
