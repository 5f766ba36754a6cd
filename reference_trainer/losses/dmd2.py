"""DMD2 losses: the generator's distribution-matching loss and the fake score's denoising loss.

DMD (Yin et al. 2023, "One-step Diffusion with Distribution Matching Distillation", arXiv 2311.18828,
eq. 7-8) and DMD2 (Yin et al. 2024, "Improved Distribution Matching Distillation for Fast Image
Synthesis", arXiv 2405.14867); reference code tianweiy/DMD2 ``main/sd_guidance.py``
(``compute_distribution_matching_loss``, ``compute_loss_fake``). Data-free, GAN-free form, in x_0 space
with flow-matching scores, as Flow-Factory's ``dmd2`` trainer (``trainers/distillation/dmd2.py``).

Generator (distribution matching). The generator output x is re-noised to x_σ; the frozen teacher
("real score") and the trainable "fake score" each predict a clean sample x̂_0^real, x̂_0^fake. The
KL gradient ∇_x KL(p_fake ‖ p_real) is proportional to s_fake − s_real ∝ x̂_0^fake − x̂_0^real, and
DMD normalises it per sample by the mean distance to the teacher's prediction (DMD eq. 8):

    p_real = x − x̂_0^real,   p_fake = x − x̂_0^fake
    g      = (p_real − p_fake) / mean_dims |p_real|          (= (x̂_0^fake − x̂_0^real) / mean|x − x̂_0^real|)
    L_DM   = ½ · mean (x − sg(x − g))²                        (value ½·mean g²; ∂L/∂x = g / numel)

so one gradient step on the generator moves x along −g: towards the teacher, away from the fake
score. The reference code applies ``torch.nan_to_num(grad)``; here inputs must be finite (else an
error), and a sample whose normaliser is exactly 0 (x equals the teacher's prediction; the direction
is 0/0) gets g = 0 explicitly and is counted in ``zero_normaliser``, rather than masking every
non-finite value.

Fake score (denoising). The fake score is fit to the *current* generator distribution by ordinary
flow matching on detached generator samples (DMD2 trains its fake UNet with the ε-MSE on detached
latents; Flow-Factory uses the flow-matching velocity MSE):

    L_fake = mean ‖v_fake(x_σ) − (ε − sg(x))‖²,   x_σ = (1 − σ)·sg(x) + σ·ε

Notation map (code -> paper): x_gen -> x = G_θ(z) [B, ...]; x0_real -> x̂_0 from μ_real (teacher);
x0_fake -> x̂_0 from μ_fake; grad -> the normalised DMD gradient g.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from reference_trainer.losses.sft import flow_matching_loss


def dmd_generator_loss(
    x_gen: torch.Tensor, x0_real: torch.Tensor, x0_fake: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """L_DM = ½·mean (x − sg(x − g))² with g = (p_real − p_fake)/mean|p_real| per sample (module doc).

    x_gen: generator output with grad, [B, ...]; x0_real, x0_fake: score predictions (detached here), [B, ...].

    Args:
        x_gen: the generator output x = G_θ(z) with its graph, [B, ...].
        x0_real: the teacher's (real score's) x̂_0 prediction, [B, ...]; detached here.
        x0_fake: the fake score's x̂_0 prediction, [B, ...]; detached here.

    Returns:
        The scalar loss L_DM and metrics ``loss``, ``dmd_grad_abs_mean``, ``normaliser_mean``,
        ``zero_normaliser`` (the count of samples whose normaliser is 0).
    """
    if not x_gen.shape == x0_real.shape == x0_fake.shape:
        raise ValueError(
            f"x_gen {tuple(x_gen.shape)}, x0_real {tuple(x0_real.shape)}, x0_fake {tuple(x0_fake.shape)} differ"
        )
    for name, tensor in (("x_gen", x_gen), ("x0_real", x0_real), ("x0_fake", x0_fake)):
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"DMD generator loss: {name} has non-finite values")
    dims = tuple(range(1, x_gen.ndim))
    with torch.no_grad():
        x = x_gen.detach().double()  # the reference code computes the direction in float64
        p_real = x - x0_real.double()
        p_fake = x - x0_fake.double()
        normaliser = p_real.abs().mean(dim=dims, keepdim=True)
        zero = normaliser == 0
        grad = torch.where(
            zero, torch.zeros_like(p_real), (p_real - p_fake) / torch.where(zero, 1.0, normaliser)
        )
        target = (x - grad).float()
    loss = 0.5 * F.mse_loss(x_gen.float(), target, reduction="mean")
    metrics = {
        "loss": loss.item(),
        "dmd_grad_abs_mean": grad.abs().mean().item(),
        "normaliser_mean": normaliser.mean().item(),
        "zero_normaliser": int(zero.sum().item()),
    }
    return loss, metrics


def fake_score_loss(
    v_fake: torch.Tensor, noise: torch.Tensor, x_gen: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """L_fake = mean ‖v_fake − (ε − sg(x))‖² (module doc). All [B, ...]; x_gen is detached here.

    Args:
        v_fake: the fake score's velocity at x_σ, [B, ...].
        noise: ε used to build x_σ, [B, ...].
        x_gen: the generator samples x, [B, ...] (detached).

    Returns:
        The scalar loss and ``{"loss": ...}``.
    """
    return flow_matching_loss(v_fake, noise, x_gen.detach())
