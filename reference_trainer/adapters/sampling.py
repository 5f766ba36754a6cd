"""The flow-matching sampling loop shared by the built-in adapters' ``inference``.

Flow-GRPO sampling (yifan123/flow_grpo ``flow_grpo/diffusers_patch/sd3_pipeline_with_logprob.py``):
start from x_{σ_0 = 1} ~ N(0, I) and, for j = 0..T−1, predict v_θ(x_j, σ_j) and take one Flow-SDE step
(``reference_trainer.sde.flow_sde_step``) to σ_{j+1}, recording the per-step log-prob; with
``noise_level == 0`` take deterministic Euler (ODE) steps and record no log-probs. All randomness comes
from the one ``generator`` passed in, in a fixed order (initial noise, then one draw per step), so a
trajectory is a pure function of (weights, condition, schedule, generator seed). With one generator
per sample (a sequence), sample i's initial noise and step noise come from generator i alone: its
trajectory does not depend on which other samples share its batch or rank (docs/cli.md "Several processes").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from reference_trainer.adapters.base import SamplingInputs, Trajectory
from reference_trainer.flow_matching import randn_rows
from reference_trainer.sde import flow_ode_step, flow_sde_step

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def sample_trajectory(
    velocity: VelocityFn,
    *,
    batch_size: int,
    latent_shape: tuple[int, int, int],
    sigmas: torch.Tensor,
    noise_level: float,
    generator: torch.Generator | Sequence[torch.Generator],
    given: SamplingInputs | None = None,
) -> Trajectory:
    """Integrate from noise to data along ``sigmas`` [T + 1] (1 -> 0).

    ``velocity(x [B, C, H, W], sigma [B]) -> v [B, C, H, W]``. Returns latents [B, T + 1, C, H, W]
    and, for the SDE, log-probs [B, T] (fp32), with the noise drawn (or ``given``: then no draw).
    """
    shape = (batch_size, *latent_shape)
    per_sample = not isinstance(generator, torch.Generator)

    def draw(j: int | None) -> torch.Tensor:
        if given is not None:
            source = given.noise if j is None else given.sde_noise
            if source is None:
                raise ValueError("the given sampling inputs have no SDE noise for an SDE rollout")
            picked = source if j is None else source[:, j]
            if tuple(picked.shape) != shape:
                raise ValueError(f"given noise of shape {tuple(picked.shape)}, the rollout needs {shape}")
            return picked.float()
        if per_sample:
            return randn_rows(shape, generator)
        return torch.randn(shape, generator=generator, dtype=torch.float32)

    x = draw(None)
    noise, steps_noise = x, []
    latents, log_probs, velocities = [x], [], []
    sigma_max = float(sigmas[1]) if len(sigmas) > 2 else None  # flow_grpo's stand-in for 1 − σ at σ = 1
    for j in range(len(sigmas) - 1):
        sigma = sigmas[j].expand(batch_size)
        sigma_next = sigmas[j + 1].expand(batch_size)
        v = velocity(x, sigma)
        velocities.append(v.float())
        if noise_level > 0:
            eps = draw(j)
            steps_noise.append(eps)
            step = flow_sde_step(v, x, sigma, sigma_next, noise_level, sigma_max=sigma_max, noise=eps)
            x = step.prev_sample
            log_probs.append(step.log_prob)
        else:
            x = flow_ode_step(v, x, sigma, sigma_next)
        latents.append(x)
    return Trajectory(
        latents=torch.stack(latents, dim=1),
        log_probs=torch.stack(log_probs, dim=1) if log_probs else None,
        sigmas=sigmas,
        velocities=torch.stack(velocities, dim=1),
        noise=noise,
        sde_noise=torch.stack(steps_noise, dim=1) if steps_noise else None,
    )
