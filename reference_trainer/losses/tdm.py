"""TDM losses: the conditional re-noise of a generator stage, the fake score's importance-weighted,
SNR-capped x̂_0 loss, and the generator's pseudo-Huber loss on a revised x̂_0.

Paper: Luo et al. 2025, "Learning Few-Step Diffusion Models by Trajectory Distribution Matching",
arXiv 2503.06674. Reference code: Luo-Yihong/TDM ``train_tdm_demo.py`` @ 2f938bf05ed668605d10670a8239a6265d4bcd7b
(``Predictor.add_noise`` / ``obtain_mixed_noise`` lines 1036-1057; the fake-score loss lines 1095-1137;
the generator loss lines 1140-1192; ``compute_snr`` lines 103-126). The reference is written for a
DDPM ε-prediction model (x_t = α_t x_0 + σ_t ε); here the same formulas are written for rectified flow,
α = 1 − σ, with x̂_0 = x_σ − σ·v and the implied noise ε̂ = x_σ + (1 − σ)·v.

Conditional re-noise (``add_noise``, ``obtain_mixed_noise``). A generator stage runs from σ_s (its
input x_s) to σ_m (the next boundary). From the generator's x̂_0 and ε̂ at x_s, the deterministic ODE
state at σ_m is x_m = α_m x̂_0 + σ_m ε̂. For σ_t ∈ [σ_m, σ_s] the state is pushed forward to σ_t by the
conditional Gaussian of the forward process, keeping the trajectory's noise:

    x_t   = (α_t/α_m)·x_m + β·n,           β² = σ_t² − (α_t σ_m / α_m)²,   n ~ N(0, I)
    ε_mix = ((α_t σ_m / α_m)·ε̂ + β·n) / σ_t          (the effective unit noise of x_t)

Fake score (lines 1095-1137): fit to the generator's x̂_0 at x_t, importance-weighted and SNR-capped:

    w     = exp(−½·mean ε_mix²) / exp(−½·mean n²)      (clipped at ``importance_clip``; the
                                                          reference does not clip, Flow-Factory clips at 20)
    L_fake = mean_b [ mean_dims (x̂_0^fake − sg(x̂_0))² · min(SNR_t, γ) · w ],   SNR_t = (α_t/σ_t)²

Generator (lines 1140-1192): the revised x̂_0 moves the generator's prediction by the real − fake score
difference (and the teacher's guidance direction when its CFG scale s > 1):

    x̂_0^cfg = x̂_0^real + (s − 1)(x̂_0^real − x̂_0^uncond)
    x̃_0    = sg(x̂_0) + (x̂_0^real − x̂_0^fake) + (s − 1)(x̂_0^real − x̂_0^uncond)
    λ       = mean_dims |x̂_0 − x̂_0^cfg|             (detached, per sample)
    L_G     = mean [(√((x̂_0 − x̃_0)² + c²) − c) / λ]   (pseudo-Huber, c = 1e-3; or MSE / λ)

Notation map (code -> paper / reference): sigma_stage -> σ of ``timesteps_g``; sigma_mid -> σ of
``timesteps_mid``; sigma_t -> σ of ``timesteps``; x0 -> ``model_latents``; eps_hat -> ``model_eps``;
x0_real / x0_fake / x0_uncond -> ``sd_latents`` / ``fake_latents`` / ``sd_latents_uncond``;
revised -> ``coop_samples``; normaliser -> ``weighting_factor``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _bcast(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.reshape(-1, *([1] * (like.ndim - 1))).to(like.dtype)


@dataclass(frozen=True)
class Renoised:
    """One conditional re-noise (module doc): x_t [B, ...], the noise n and ε_mix [B, ...]."""

    x_t: torch.Tensor
    noise: torch.Tensor
    mixed_noise: torch.Tensor


def conditional_renoise(
    x0: torch.Tensor,
    eps_hat: torch.Tensor,
    sigma_mid: torch.Tensor,
    sigma_t: torch.Tensor,
    noise: torch.Tensor,
) -> Renoised:
    """x_t = (α_t/α_m)·x_m + β·n with x_m = α_m x̂_0 + σ_m ε̂ (module doc), α = 1 − σ.

    Args:
        x0: the generator's x̂_0, [B, ...].
        eps_hat: its implied noise ε̂, [B, ...].
        sigma_mid: σ_m per sample (the stage's end), [B], in [0, 1).
        sigma_t: σ_t per sample, [B], with σ_m ≤ σ_t < 1.
        noise: n, [B, ...].

    Returns:
        ``Renoised(x_t, noise, mixed_noise)``.
    """
    if (
        not bool((sigma_t >= sigma_mid).all())
        or not bool((sigma_mid >= 0).all())
        or not bool((sigma_t < 1).all())
    ):
        raise ValueError(f"need 0 <= sigma_mid <= sigma_t < 1, got {sigma_mid.tolist()}, {sigma_t.tolist()}")
    alpha_mid, alpha_t = 1.0 - sigma_mid, 1.0 - sigma_t
    carried = alpha_t * sigma_mid / alpha_mid  # the trajectory noise's scale at σ_t
    beta = (sigma_t.square() - carried.square()).clamp_min(0.0).sqrt()
    x_mid = _bcast(alpha_mid, x0) * x0 + _bcast(sigma_mid, x0) * eps_hat
    x_t = _bcast(alpha_t / alpha_mid, x0) * x_mid + _bcast(beta, x0) * noise
    mixed = (_bcast(carried, x0) * eps_hat + _bcast(beta, x0) * noise) / _bcast(sigma_t, x0)
    return Renoised(x_t, noise, mixed)


def importance_weights(mixed_noise: torch.Tensor, noise: torch.Tensor, clip: float) -> torch.Tensor:
    """w = exp(−½·mean ε_mix²) / exp(−½·mean n²) per sample, at most ``clip`` (module doc).

    Args:
        mixed_noise: ε_mix, [B, ...].
        noise: n, [B, ...].
        clip: the upper bound of w (> 0).

    Returns:
        w, [B] fp32.
    """
    dims = tuple(range(1, noise.ndim))
    log_w = -0.5 * mixed_noise.float().square().mean(dim=dims) + 0.5 * noise.float().square().mean(dim=dims)
    return log_w.exp().clamp(max=clip)


def capped_snr(sigma_t: torch.Tensor, gamma: float) -> torch.Tensor:
    """min(SNR_t, γ) with SNR_t = (α_t/σ_t)², α = 1 − σ (``compute_snr`` and line 1132).

    Args:
        sigma_t: σ_t per sample, [B], in (0, 1).
        gamma: the cap γ.

    Returns:
        min(SNR_t, γ), [B] fp32.
    """
    snr = ((1.0 - sigma_t.float()) / sigma_t.float()).square()
    return snr.clamp(max=gamma)


def tdm_fake_loss(
    x0_fake: torch.Tensor, x0: torch.Tensor, snr_weight: torch.Tensor, importance: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """L_fake = mean_b [mean_dims (x̂_0^fake − sg(x̂_0))² · min(SNR, γ) · w] (module doc).

    Args:
        x0_fake: the fake score's x̂_0 at x_t, [B, ...] (with gradient to the fake score).
        x0: the generator's x̂_0, [B, ...] (detached here).
        snr_weight: min(SNR_t, γ), [B].
        importance: w, [B].

    Returns:
        The scalar loss and metrics ``loss``, ``importance_mean``, ``snr_weight_mean``.
    """
    if x0_fake.shape != x0.shape:
        raise ValueError(f"x0_fake {tuple(x0_fake.shape)} and x0 {tuple(x0.shape)} differ")
    dims = tuple(range(1, x0.ndim))
    per_sample = (x0_fake.float() - x0.detach().float()).square().mean(dim=dims)
    loss = (per_sample * snr_weight.float() * importance.float()).mean()
    metrics = {
        "loss": loss.item(),
        "importance_mean": importance.float().mean().item(),
        "snr_weight_mean": snr_weight.float().mean().item(),
    }
    return loss, metrics


def revised_x0_loss(
    x0: torch.Tensor,
    revised: torch.Tensor,
    anchor: torch.Tensor,
    *,
    huber_c: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """mean [ρ(x̂_0 − sg(x̃_0)) / λ], λ = mean_dims |x̂_0 − x̂_0^cfg| (detached), ρ the pseudo-Huber
    √(d² + c²) − c, or d² when ``huber_c`` is None (module doc).

    Args:
        x0: the generator's x̂_0 with its graph, [B, ...].
        revised: the revised target x̃_0, [B, ...] (detached here).
        anchor: x̂_0^cfg, the guided teacher prediction λ is measured to, [B, ...].
        huber_c: c of the pseudo-Huber loss, or None for the squared error.

    Returns:
        The scalar loss and metrics ``loss``, ``normaliser_mean``.
    """
    if not x0.shape == revised.shape == anchor.shape:
        raise ValueError(
            f"x0 {tuple(x0.shape)}, revised {tuple(revised.shape)}, anchor {tuple(anchor.shape)} differ"
        )
    dims = tuple(range(1, x0.ndim))
    normaliser = (x0.detach().double() - anchor.double()).abs().mean(dim=dims, keepdim=True)
    if not bool((normaliser > 0).all()):
        raise ValueError("TDM generator loss: x̂_0 equals the teacher's guided x̂_0 (normaliser 0)")
    diff = x0.float() - revised.detach().float()
    error = diff.square() if huber_c is None else (diff.square() + huber_c**2).sqrt() - huber_c
    loss = (error / normaliser).mean().float()
    return loss, {"loss": loss.item(), "normaliser_mean": normaliser.mean().item()}


def tdm_generator_loss(
    x0: torch.Tensor,
    x0_real: torch.Tensor,
    x0_fake: torch.Tensor,
    x0_uncond: torch.Tensor | None = None,
    *,
    guidance_scale: float = 1.0,
    huber_c: float | None = 1e-3,
) -> tuple[torch.Tensor, dict[str, float]]:
    """L_G with x̃_0 = sg(x̂_0) + (x̂_0^real − x̂_0^fake) + (s − 1)(x̂_0^real − x̂_0^uncond) (module doc).

    Args:
        x0: the generator's x̂_0 with its graph, [B, ...].
        x0_real: the teacher's conditional x̂_0 at x_t, [B, ...].
        x0_fake: the fake score's x̂_0 at x_t, [B, ...].
        x0_uncond: the teacher's unconditional x̂_0 (needed when s > 1), [B, ...].
        guidance_scale: s (1 = no guidance term).
        huber_c: c of the pseudo-Huber loss, or None for the squared error.

    Returns:
        The scalar loss and metrics ``loss``, ``normaliser_mean``, ``score_gap_abs_mean``.
    """
    with torch.no_grad():
        guidance = torch.zeros_like(x0_real)
        if guidance_scale != 1.0:
            if x0_uncond is None:
                raise ValueError("TDM generator loss: guidance_scale != 1 needs x0_uncond")
            guidance = (guidance_scale - 1.0) * (x0_real - x0_uncond)
        revised = x0.detach() + (x0_real - x0_fake) + guidance
        anchor = x0_real + guidance
    loss, metrics = revised_x0_loss(x0, revised, anchor, huber_c=huber_c)
    metrics["score_gap_abs_mean"] = (x0_real - x0_fake).abs().mean().item()
    return loss, metrics
