"""DiffusionOPD loss: the per-step Gaussian KL between the student's and a frozen teacher's transitions
along the student's own rollout.

Project: ali-vilab/DiffusionOPD ("On-Policy Distillation of Diffusion Models"). Transcribed from
Flow-Factory's ``diffusion-opd`` (Jayce-Ping/Flow-Factory-Draft @ 2946cb28d86d112ce1cfbc89fef25c9617203a01,
``src/flow_factory/trainers/opd/trainer.py``: ``_precompute_teacher_targets`` (pass 1) and the student
pass of ``_distill`` (pass 2); the per-sample reduction ``compute_structured_distillation_loss`` of ``trainers/opd/common.py``, and the
scheduler's ``get_kl_divergence_denominator``). For the stored rollout state x_j, the student's and the
teacher's one-step transition means μ_S, μ_T (the ``xt`` target) and the transition std s_j of the
student's Flow-SDE step (s_j² = σ_t²·(−Δt), Flow-SDE; 1 for the ODE):

    KL(N(μ_S, s_j²) ‖ N(μ_T, s_j²)) = ½·‖μ_S − μ_T‖² / s_j²
    L = mean_{i, j} mean_dims ½·(μ_S − sg(μ_T))² / s_j²

This is exactly GRPO's KL to its reference (``losses.grpo.sde_kl``) with the teacher as the reference.
The Flow-Factory scheduler documents the loss as ``0.5 * ||mu_S - mu_T||^2 / denom``; its reduction
(``compute_structured_distillation_loss``) omits the ½, a constant factor of 2 (an lr rescale) that
``tests/trainer/test_train_diffusion_opd.py`` pins. Flow-Factory's optional ``self_normalize`` and the
``v`` / ``x0`` target spaces are not offered here.
"""

from __future__ import annotations

import torch

from reference_trainer.losses.grpo import sde_kl


def opd_loss(
    student_mean: torch.Tensor, teacher_mean: torch.Tensor, step_std: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """L = mean ½·(μ_S − sg(μ_T))² / s² (module doc).

    Args:
        student_mean: μ_S with its graph, [B, ...].
        teacher_mean: μ_T (detached here), [B, ...].
        step_std: s per sample, [B] (or broadcastable to the means); 1 for the ODE.

    Returns:
        The scalar loss and metrics ``loss``, ``mean_gap_abs``.
    """
    std = step_std.reshape(-1, *([1] * (student_mean.ndim - 1))) if step_std.ndim == 1 else step_std
    if not bool((std > 0).all()):
        raise ValueError("DiffusionOPD loss: the transition std must be > 0")
    loss = sde_kl(student_mean, teacher_mean, std)
    gap = (student_mean.detach() - teacher_mean.detach()).abs().mean().item()
    return loss, {"loss": loss.item(), "mean_gap_abs": gap}
