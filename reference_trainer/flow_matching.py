"""Rectified-flow / flow-matching forward process: the small primitives every loss and trainer shares.

Convention (SD3, Esser et al. 2024, arXiv 2403.03206, §2; diffusers ``FlowMatchEulerDiscreteScheduler``;
Flow-Factory and flow_grpo use the same), with σ ∈ [0, 1] the noise level (σ = t/1000 for a diffusers
timestep t):

    x_σ  = (1 − σ)·x_0 + σ·ε              (``interpolate``)
    v*   = dx_σ/dσ = ε − x_0              (``velocity_target``; the network predicts v_θ(x_σ, σ) ≈ v*)
    x̂_0  = x_σ − σ·v_θ                   (``predicted_x0``: the clean sample implied by a velocity)

Training noise levels (``sample_sigmas``): ``logit_normal`` draws σ = sigmoid(m + s·n), n ~ N(0, 1)
(SD3 §3.1 "logit-normal sampling", the default of diffusers' ``compute_density_for_timestep_sampling``),
``uniform`` draws σ ~ U(low, high). Both are then clamped to ``[low, high]`` (Flow-Factory
``timestep_range``), so σ never hits 0 or 1 exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reference_trainer.errors import require

SIGMA_SCHEMES = ("logit_normal", "uniform")


def check_sigma_sampling(scheme: str, sigma_min: float, sigma_max: float) -> None:
    """Config validation of a trainer's ``sigma_scheme`` / ``sigma_min`` / ``sigma_max`` fields (a
    ``ConfigError`` naming the field), so a bad value fails at load time, not at the first step.

    Args:
        scheme: the sampling scheme name.
        sigma_min: the lower bound of the draws.
        sigma_max: the upper bound of the draws.
    """
    require(scheme in SIGMA_SCHEMES, "sigma_scheme", f"must be one of {SIGMA_SCHEMES}, got {scheme!r}")
    require(
        0.0 <= sigma_min < sigma_max <= 1.0,
        "sigma_min",
        f"need 0 <= sigma_min < sigma_max <= 1, got {sigma_min}, {sigma_max}",
    )


def _bcast(sigma: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, 1, ...] matching ``like``."""
    if sigma.ndim != 1 or sigma.shape[0] != like.shape[0]:
        raise ValueError(f"sigma must have shape [{like.shape[0]}], got {tuple(sigma.shape)}")
    return sigma.to(like.dtype).view(-1, *([1] * (like.ndim - 1)))


def interpolate(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x_σ = (1 − σ)·x_0 + σ·ε. x0, noise: [B, ...]; sigma: [B].

    Args:
        x0: clean latents, [B, ...].
        noise: ε, [B, ...].
        sigma: σ per sample, [B].

    Returns:
        x_σ, [B, ...].
    """
    s = _bcast(sigma, x0)
    return (1.0 - s) * x0 + s * noise


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """v* = ε − x_0, [B, ...].

    Args:
        x0: clean latents, [B, ...].
        noise: ε, [B, ...].

    Returns:
        v*, [B, ...].
    """
    return noise - x0


def predicted_x0(x_t: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x̂_0 = x_σ − σ·v. x_t, v: [B, ...]; sigma: [B].

    Args:
        x_t: noised latents x_σ, [B, ...].
        v: predicted velocities, [B, ...].
        sigma: σ per sample, [B].

    Returns:
        x̂_0, [B, ...].
    """
    return x_t - _bcast(sigma, x_t) * v


Generators = torch.Generator | Sequence[torch.Generator] | None
"""One generator for a whole batch, or one per sample (row ``i`` drawn from ``generator[i]`` alone)."""


def randn_rows(shape: Sequence[int], generator: Generators) -> torch.Tensor:
    """N(0, I) of ``shape`` [B, ...]; with one generator per sample, row i comes from generator i."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.randn(tuple(shape), generator=generator)
    if len(generator) != shape[0]:
        raise ValueError(f"{len(generator)} generators for {shape[0]} rows")
    return torch.stack([torch.randn(tuple(shape[1:]), generator=g) for g in generator])


def sample_sigmas(
    n: int,
    scheme: str,
    generator: Generators,
    *,
    low: float = 0.0,
    high: float = 1.0,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
) -> torch.Tensor:
    """n training noise levels in [low, high], fp32 [n] (see module docstring).

    Args:
        n: how many noise levels.
        scheme: the sampling scheme (module docstring).
        generator: the RNG to draw from.
        low: the lower bound.
        high: the upper bound.
        logit_mean: the mean of the logit-normal scheme.
        logit_std: the std of the logit-normal scheme.

    Returns:
        σ, [n] fp32.
    """
    if not 0.0 <= low < high <= 1.0:
        raise ValueError(f"need 0 <= low < high <= 1, got low={low}, high={high}")
    if generator is not None and not isinstance(generator, torch.Generator):
        if len(generator) != n:
            raise ValueError(f"{len(generator)} generators for {n} noise levels")
        options = dict(low=low, high=high, logit_mean=logit_mean, logit_std=logit_std)
        return torch.cat([sample_sigmas(1, scheme, g, **options) for g in generator])
    if scheme == "logit_normal":
        sigma = torch.sigmoid(logit_mean + logit_std * torch.randn(n, generator=generator))
    elif scheme == "uniform":
        sigma = low + (high - low) * torch.rand(n, generator=generator)
    else:
        raise ValueError(f"sigma scheme must be one of {SIGMA_SCHEMES}, got {scheme!r}")
    return sigma.clamp(low, high)
