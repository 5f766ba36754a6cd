"""Flow-GRPO SDE sampling step for rectified-flow / flow-matching models, with its Gaussian log-prob.

The deterministic probability-flow ODE of a flow-matching model, ``dx = v dt``, has no per-step
likelihood. Flow-GRPO (Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL",
arXiv 2505.05470, eq. 12) converts it into a reverse-time SDE with the same marginals, so each
denoising step becomes a Gaussian transition whose log-density can enter a PPO ratio:

    x_{t+Δt} = x_t + [ v_θ(x_t, t) + σ_t² / (2t) · (x_t + (1 − t) · v_θ(x_t, t)) ] Δt + σ_t √(−Δt) ε,
    σ_t = a · √(t / (1 − t)),       ε ~ N(0, I),   Δt < 0 (time runs from 1 = noise to 0 = data).

Reference implementation: yifan123/flow_grpo ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py``
(``sde_step_with_logprob``, ``sde_type="sde"``), which this module follows term by term; Flow-Factory
calls the same dynamics ``Flow-SDE`` (``scheduler/flow_match_euler_discrete.py``).

Notation map (code -> paper):
    x            -> x_t                    current latent, [B, ...]
    v            -> v_θ(x_t, t)            predicted velocity (ε − x_0 convention), [B, ...]
    sigma        -> t                      current noise level σ ∈ (0, 1], [B] or scalar
    sigma_next   -> t + Δt                 next noise level, < sigma
    dt           -> Δt = sigma_next − sigma (negative)
    noise_level  -> a                      the SDE noise scale (flow_grpo ``noise_level``, default 0.7)
    std_dev_t    -> σ_t = a·√(t/(1 − t))
    step_std     -> σ_t·√(−Δt)             std of the Gaussian transition
    mean         -> the drift term x_t + [...]Δt (flow_grpo ``prev_sample_mean``)
    prev_sample  -> x_{t+Δt}

Precision: everything is computed in float32 whatever the input dtype (flow_grpo: "bf16 can overflow
here"); the new sample is then cast to the input dtype (the storage dtype) and the log-prob is
evaluated on that stored value, so recomputing it at training time from the stored sample gives the
same number (Flow-Factory does the same round trip).

Log-prob reduction: the per-element Gaussian log-density is **averaged** (not summed) over all
non-batch dimensions, as flow_grpo does (``log_prob.mean(dim=tuple(range(1, ndim)))``). The ratio
``exp(logp_θ − logp_old)`` is therefore the geometric mean of the per-element ratios; this keeps it
O(1) for any latent size and is what Flow-GRPO's clip range (1e-4) is tuned for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class SDEStep:
    """Result of one Flow-SDE step. Shapes: B = batch; latents keep the input shape."""

    prev_sample: torch.Tensor  # x_{t+Δt}, [B, ...], input dtype
    log_prob: torch.Tensor  # mean over non-batch dims of log N(x_{t+Δt}; mean, step_std²), [B], fp32
    mean: torch.Tensor  # transition mean, [B, ...], fp32 (used by the KL to the reference)
    std_dev_t: torch.Tensor  # σ_t, broadcastable to [B, ...], fp32
    step_std: torch.Tensor  # σ_t·√(−Δt), broadcastable to [B, ...], fp32


def _per_sample(value: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor:
    """A scalar or [B] noise level as fp32 of shape [B, 1, 1, ...] that broadcasts against ``like``."""
    value = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if value.ndim == 0:
        value = value.expand(like.shape[0])
    if value.shape != (like.shape[0],):
        raise ValueError(f"noise level must be a scalar or shape [{like.shape[0]}], got {tuple(value.shape)}")
    return value.view(-1, *([1] * (like.ndim - 1)))


def flow_sde_std_dev(sigma: torch.Tensor, noise_level: float, sigma_max: float | None) -> torch.Tensor:
    """σ_t = a·√(σ / (1 − σ)), with σ = 1 replaced by ``sigma_max`` in the denominator only.

    At σ = 1 the formula divides by zero; flow_grpo substitutes the schedule's second sigma
    (``sigmas[1]``) inside ``1 − σ`` (``torch.where(sigma == 1, sigma_max, sigma)``). We require the
    caller to pass it explicitly when a σ of exactly 1 occurs, rather than guessing.

    Args:
        sigma: σ, broadcastable fp32 tensor, in (0, 1].
        noise_level: a > 0.
        sigma_max: the schedule's sigmas[1]; required when some σ == 1.

    Returns:
        σ_t, the shape of ``sigma``.
    """
    if not 0.0 < noise_level:
        raise ValueError(f"noise_level must be > 0 for the SDE step, got {noise_level}")
    at_one = sigma == 1.0
    if bool(at_one.any()):
        if sigma_max is None or not 0.0 < sigma_max < 1.0:
            raise ValueError(
                "sigma == 1 makes σ_t = a·√(σ/(1−σ)) infinite; pass sigma_max (the schedule's sigmas[1], "
                f"in (0, 1)) to use in the denominator as flow_grpo does, got sigma_max={sigma_max}"
            )
        denominator = 1.0 - torch.where(at_one, torch.full_like(sigma, sigma_max), sigma)
    else:
        denominator = 1.0 - sigma
    return noise_level * torch.sqrt(sigma / denominator)


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Mean over non-batch dims of log N(sample; mean, std²), in fp32. Returns [B].

    log N(x; μ, s²) = −(x − μ)² / (2 s²) − log s − log √(2π), per element.

    Args:
        sample: x, [B, ...].
        mean: μ, [B, ...].
        std: s, broadcastable to ``sample``.

    Returns:
        The per-sample mean log-density, [B] fp32.
    """
    sample, mean, std = sample.float(), mean.float(), std.float()
    per_element = -((sample - mean) ** 2) / (2.0 * std**2) - torch.log(std) - LOG_SQRT_2PI
    per_element = per_element.expand(sample.shape)  # std may be [B, 1, ...]
    return per_element.mean(dim=tuple(range(1, sample.ndim)))


def flow_sde_step(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    noise_level: float,
    *,
    sigma_max: float | None = None,
    prev_sample: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> SDEStep:
    """One Flow-SDE step x_t -> x_{t+Δt} (Flow-GRPO eq. 12) and its per-sample Gaussian log-prob.

    Args:
        v: predicted velocity v_θ(x_t, t), [B, ...] (any float dtype).
        x: current latent x_t, [B, ...], same shape as ``v``.
        sigma, sigma_next: current and next noise levels (scalar or [B]); need sigma_next < sigma.
        noise_level: the SDE scale a (> 0).
        sigma_max: the schedule's sigmas[1]; required only if some sigma == 1 (see ``flow_sde_std_dev``).
        prev_sample: when given (training: recompute the log-prob of a stored rollout), no sampling
            happens and its log-prob under the current mean is returned; gradients flow through
            ``mean`` only, never through ``prev_sample`` (it is detached).
        noise: ε to use for sampling, [B, ...]; else drawn with ``generator``.
    Returns:
        ``SDEStep``; ``prev_sample`` in ``x.dtype``, the rest fp32.
    """
    if v.shape != x.shape:
        raise ValueError(f"velocity shape {tuple(v.shape)} != latent shape {tuple(x.shape)}")
    # 1. upcast (flow_grpo: "bf16 can overflow here when compute prev_sample_mean")
    storage_dtype = x.dtype
    v32, x32 = v.float(), x.float()
    sigma = _per_sample(sigma, x32)
    sigma_next = _per_sample(sigma_next, x32)
    if bool((sigma_next >= sigma).any()) or bool((sigma <= 0).any()):
        raise ValueError("need 0 < sigma_next < sigma (time runs from noise to data)")
    # 2. Δt < 0, σ_t, and the std of the transition σ_t·√(−Δt)
    dt = sigma_next - sigma
    std_dev_t = flow_sde_std_dev(sigma, noise_level, sigma_max)
    step_std = std_dev_t * torch.sqrt(-dt)
    # 3. mean = x·(1 + σ_t²/(2t)·Δt) + v·(1 + σ_t²(1 − t)/(2t))·Δt   (= x + [v + σ_t²/(2t)(x + (1−t)v)]Δt)
    mean = (
        x32 * (1.0 + std_dev_t**2 / (2.0 * sigma) * dt)
        + v32 * (1.0 + std_dev_t**2 * (1.0 - sigma) / (2.0 * sigma)) * dt
    )
    # 4. sample x_{t+Δt} = mean + σ_t√(−Δt)·ε, stored in the input dtype
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, dtype=torch.float32, device=x.device)
        if noise.shape != x.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} != latent shape {tuple(x.shape)}")
        prev_sample = (mean + step_std * noise.float()).to(storage_dtype)
    elif prev_sample.shape != x.shape:
        raise ValueError(f"prev_sample shape {tuple(prev_sample.shape)} != latent shape {tuple(x.shape)}")
    # 5. log-prob of the stored sample (round-tripped through the storage dtype), fp32, mean over dims
    log_prob = gaussian_log_prob(prev_sample.detach(), mean, step_std)
    return SDEStep(
        prev_sample=prev_sample, log_prob=log_prob, mean=mean, std_dev_t=std_dev_t, step_std=step_std
    )


def flow_ode_step(
    v: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor | float, sigma_next: torch.Tensor | float
) -> torch.Tensor:
    """The deterministic Euler step x_{t+Δt} = x_t + v·Δt (diffusers ``FlowMatchEulerDiscreteScheduler``).

    Computed in fp32 and cast back to ``x.dtype``. There is no log-prob: an ODE step is a Dirac
    transition (Flow-Factory sets it to 0 and warns; we simply do not offer one).

    Args:
        v: predicted velocity, [B, ...].
        x: current latent x_t, [B, ...].
        sigma: current noise level (scalar or [B]).
        sigma_next: next noise level (scalar or [B]).

    Returns:
        x_{t+Δt} in ``x.dtype``, [B, ...].
    """
    x32 = x.float()
    dt = _per_sample(sigma_next, x32) - _per_sample(sigma, x32)
    return (x32 + v.float() * dt).to(x.dtype)
