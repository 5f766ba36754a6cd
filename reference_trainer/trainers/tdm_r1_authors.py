"""TDM-R1's role phases as its authors run them (``train.variant: authors``, the default).

Source: Luo-Yihong/TDM-R1 @ cc55d8975345e565b09d9c02c2800b69ca26fe90 ``scripts/train_tdmr1_pub.py``,
``main``'s training loop; losses and notation: ``reference_trainer.losses.tdm_r1``. A mixin of
``TDMR1Trainer`` (``reference_trainer.trainers.tdm_r1``), which holds the rollout and the arguments.

The authors' loop, per training batch: M stages j drawn without replacement from 0..K−1
(``generate_shared_sampled_timesteps``, broadcast from rank 0); for each j one fake-score, one surrogate
and one generator backward, accumulated (Accelerate's ``gradient_accumulation_steps`` is
``train.gradient_accumulation_steps`` × M, with ``train.gradient_accumulation_steps =
num_batches_per_epoch`` in the shipped configs), so that each role makes one optimizer step per
accumulation window on the mean of its losses, all three from the weights the window started with.
Here one rollout iteration is one such window of one batch (one set of draws; the shipped configs
average 12 batches' draws per step, which changes the variance, not the expected gradient), and its
three role phases run in the order that keeps every loss on those weights:

1. ``generator``: needs the fake score and the surrogate as the batch found them: runs first;
2. ``fake``: needs the generator's velocity at the stage's x_j as the batch found it: that is the
   rollout's own velocity (``Trajectory.velocities``: the rollout ran the same generator at the same
   x_j, σ_j), so the updated generator is never asked;
3. ``surrogate``: needs only the teacher and the slow surrogate; then the slow surrogate's EMA with
   decay min(max, min + 0.001·global step), the global step being the number of batches before this
   one (``ema_old_decay``).

Draws, each a pure function of the counters (the authors broadcast the shared ones from rank 0):

* shared by every sample and rank, per iteration: the M stages; per stage index j, the surrogate's
  stage j_s ∝ j_s + 1 (``torch.multinomial(probs, 1)``) and the three re-noise draws u (``tau_scalar``,
  ``tau_scalar_dgpo`` twice);
* per sample (global index): the ε of the fake phase and of the generator phase, per stage;
* per group (global group id): the ε shared by a group's samples (``generate_shared_noise_for_groups``)
  of the surrogate phase and of the generator's reward query, per stage.

Not kept from the script: the generator's EMA (``ema_decay_g``; used for evaluation and saving only),
LoRA adapters (the roles are variants here: the teacher is a snapshot of the initial generator, where
the script's generator starts from a TDM LoRA over the base teacher), the joint gradient clip over every
adapter (each role's gradient is clipped on its own), the runaway clip's per-GPU batch (R is averaged
over every rank's batch, which equals the authors' on one GPU and keeps results independent of the rank
layout), and the rollout's sampler: the script rolls out with a DPM-Solver++ multistep scheduler at
``flow_shift`` 3 (σ ≈ 1, 0.90, 0.75, 0.50, 0 for 4 steps), here TDM's K-step Euler generator on the
uniform boundaries 1 − k/K (``TDMTrainer.generator_trajectory``); every stage σ_j, every re-noise
lower bound and the stored states follow the rollout's schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import ffdebug
from reference_trainer.adapters.base import Condition
from reference_trainer.flow_matching import predicted_x0

if TYPE_CHECKING:  # the rollout type lives with the trainer that mixes these phases in
    from reference_trainer.trainers.tdm_r1 import TDMR1Rollout

from reference_trainer.losses.tdm_r1 import (
    fake_score_loss,
    forward_renoise,
    generator_loss,
    renoise_sigma,
    surrogate_loss,
    surrogate_target,
)


@dataclass(frozen=True)
class SharedDraws:
    """One iteration's draws shared by every sample and rank (module docstring), K = generator steps.

    stages:          the M trained stages j, in the order drawn
    surrogate_stage: j_s per stage index, [K] (the surrogate trains at the rollout's x_{j_s + 1})
    u_fake:          u of the re-noise time τ of the fake phase and the generator's TDM terms, [K]
    u_reward:        u of the generator's surrogate query time τ', [K]
    u_surrogate:     u of the surrogate's training time, [K]
    """

    stages: tuple[int, ...]
    surrogate_stage: tuple[int, ...]
    u_fake: tuple[float, ...]
    u_reward: tuple[float, ...]
    u_surrogate: tuple[float, ...]


class AuthorsPhases:
    """The ``authors`` variant's phases (module docstring); mixed into ``TDMR1Trainer``."""

    def phase_roles(self) -> list[str]:
        """One ``generator``, one ``fake``, one ``surrogate`` optimizer step (module docstring)."""
        return ["generator", "fake", "surrogate"]

    def shared_draws(self) -> SharedDraws:
        """This iteration's ``SharedDraws``, from one generator keyed by the iteration only."""
        args = self.args
        k = args.num_generator_steps
        g = self.generator("tdm_r1", self.rollout_iteration, "shared")
        weights = torch.arange(k, dtype=torch.float32) + 1.0
        surrogate_stage, u_surrogate, u_fake, u_reward = [], [], [], []
        for _ in range(k):  # the authors' first loop: j_dgpo and tau_scalar_dgpo per stage index
            surrogate_stage.append(int(torch.multinomial(weights / weights.sum(), 1, generator=g)))
            u_surrogate.append(float(torch.rand(1, generator=g)))
        for _ in range(k):  # the second: tau_scalar, tau_scalar_dgpo per stage index
            u_fake.append(float(torch.rand(1, generator=g)))
            u_reward.append(float(torch.rand(1, generator=g)))
        stages = torch.randperm(k, generator=g)[: args.stages_per_iteration].tolist()
        return SharedDraws(
            tuple(stages), tuple(surrogate_stage), tuple(u_fake), tuple(u_reward), tuple(u_surrogate)
        )

    def optimize_authors(self, rollout: TDMR1Rollout) -> None:
        """The three phases, each the mean of its M stage losses (module docstring).

        Args:
            rollout: the ``TDMR1Rollout`` of this iteration (with the rollout's velocities).
        """
        with ffdebug.step(**self.step_tags("train")):
            draws = self.take_shared(self.shared_draws())
        losses = {
            "generator": self.authors_generator_loss,
            "fake": self.authors_fake_loss,
            "surrogate": self.authors_surrogate_loss,
        }
        for role in self.cycle_steps(self.phase_roles()):
            with ffdebug.step(**self.step_tags("train", role=role)), self.optim.phase(role) as step:
                total, sums = None, {}
                for j in draws.stages:
                    with ffdebug.step(timestep=j):
                        loss, metrics = losses[role](rollout, draws, j)
                    total = loss if total is None else total + loss
                    for key, value in metrics.items():
                        sums[key] = sums.get(key, 0.0) + value
                count = len(draws.stages)
                metrics = {key: value / count for key, value in sums.items()}
                metrics.pop("loss")
                step.backward(total / count, metrics)
            if role == "surrogate":
                decay = min(
                    self.args.surrogate_slow_decay_max,
                    self.args.surrogate_slow_decay_min + 0.001 * self.rollout_iteration,
                )
                self.variants.update_snapshot("slow_surrogate", "surrogate", decay)

    def take_shared(self, draws: SharedDraws) -> SharedDraws:
        """The shared draws as inputs (docs/trainer-taps.md), each under a ``draw`` tag naming it:
        the stage indices ``train.timestep_index`` (``stages``, ``surrogate_stage``) and the uniforms
        ``train.sigma_draw`` (``u_fake``, ``u_reward``, ``u_surrogate``); taken with ``--inputs-from``."""
        k = self.args.num_generator_steps
        taken = {}
        for name in ("stages", "surrogate_stage", "u_fake", "u_reward", "u_surrogate"):
            value = getattr(draws, name)
            stage = "train.timestep_index" if name in ("stages", "surrogate_stage") else "train.sigma_draw"
            index = stage == "train.timestep_index"
            with ffdebug.step(draw=name):
                given = self.drawn(
                    stage,
                    torch.tensor(value, dtype=torch.long if index else torch.float32),
                    within=(0, k) if index else None,
                )
            taken[name] = tuple(int(v) if index else float(v) for v in given.tolist())
        return SharedDraws(**taken)

    # ------------------------------------------------------------------ draws per sample / group
    def _sample_noise(self, rollout: TDMR1Rollout, purpose: str, j: int) -> torch.Tensor:
        """Fresh ε per sample (keyed by the global sample index), [B, C, H, W]."""
        latents = rollout.trajectory.latents
        generators = self.sample_generators(
            "tdm_r1", self.rollout_iteration, purpose, j, count=latents.shape[0]
        )
        with ffdebug.step(draw=purpose):  # an input, taken with --inputs-from
            return self.drawn(
                "train.noise", torch.stack([torch.randn(latents.shape[2:], generator=g) for g in generators])
            )

    def _group_noise(self, rollout: TDMR1Rollout, purpose: str, j: int) -> torch.Tensor:
        """ε shared by a group's samples (keyed by the global group id), [B, C, H, W]."""
        shape = rollout.trajectory.latents.shape[2:]
        noise = {}
        for group in rollout.group_ids.tolist():
            if group not in noise:
                g = self.generator("tdm_r1", self.rollout_iteration, purpose, j, "group", group)
                noise[group] = torch.randn(shape, generator=g)
        with ffdebug.step(draw=purpose):  # an input, taken with --inputs-from
            return self.drawn(
                "train.noise", torch.stack([noise[group] for group in rollout.group_ids.tolist()])
            )

    def _stage(self, rollout: TDMR1Rollout, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_j [B, C, H, W], σ_j [B], σ_{j+1} [B]) of the rollout's stage j."""
        latents, sigmas = rollout.trajectory.latents, rollout.trajectory.sigmas
        count = latents.shape[0]
        return latents[:, j].float(), sigmas[j].expand(count), sigmas[j + 1].expand(count)

    def _renoise_time(self, u: float, lower: torch.Tensor) -> torch.Tensor:
        """τ(u; lo) with this run's shift and gap (``losses.tdm_r1.renoise_sigma``), [B]."""
        return renoise_sigma(u, lower, shift=self.args.renoise_shift, gap=self.args.renoise_gap)

    @staticmethod
    def _replay(
        x_j: torch.Tensor, sigma_j: torch.Tensor, sigma_next: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The generator's one step from x_j with velocity v: (x̂_0 = x_j − σ_j·v, x̂_n = x_j − (σ_j − σ_n)·v)."""
        s_j, s_n = sigma_j.reshape(-1, 1, 1, 1), sigma_next.reshape(-1, 1, 1, 1)
        return predicted_x0(x_j, v, sigma_j), x_j - (s_j - s_n) * v

    def _cond_uncond(self, x: torch.Tensor, sigma: torch.Tensor, condition: Condition, **model):
        """The conditional and unconditional velocities of one model at (x, σ)."""
        v_cond = self.adapter.forward(x, sigma, condition, **model)
        v_uncond = self.adapter.forward(x, sigma, self.adapter.unconditional(x.shape[0]), **model)
        return v_cond, v_uncond

    # ------------------------------------------------------------------ the three losses
    def authors_fake_loss(
        self, rollout: TDMR1Rollout, draws: SharedDraws, j: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """L_F at stage j (``reference_trainer.losses.tdm_r1``), from the rollout's velocity at x_j."""
        x_j, sigma_j, sigma_next = self._stage(rollout, j)
        x0, x_next = self._replay(x_j, sigma_j, sigma_next, rollout.trajectory.velocities[:, j])
        sigma_tau = self._renoise_time(draws.u_fake[j], sigma_next)  # ``tau_list``
        x_tau, _, _ = forward_renoise(x_next, sigma_next, sigma_tau, self._sample_noise(rollout, "fake", j))
        target = (x_tau - x0) / sigma_tau.reshape(-1, 1, 1, 1)
        ffdebug.tap("train.x0", x0)
        ffdebug.tap("train.x_t", x_tau)
        condition = rollout.condition
        with torch.no_grad():
            v_real = self.adapter.forward(
                x_tau, sigma_tau, condition, parameters=self.variants.snapshot("teacher")
            )
        v_fake = self.adapter.forward(x_tau, sigma_tau, condition, module=self.variants.variant("fake"))
        ffdebug.tap("train.fake_velocity", v_fake)
        return fake_score_loss(v_fake, target, v_real)

    def authors_surrogate_loss(
        self, rollout: TDMR1Rollout, draws: SharedDraws, j: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """L_S for stage index j: the rollout's x_{j_s + 1} re-noised with the group's shared ε."""
        args = self.args
        j_s = draws.surrogate_stage[j]
        latents, sigmas = rollout.trajectory.latents, rollout.trajectory.sigmas
        count = latents.shape[0]
        x_next, sigma_next = latents[:, j_s + 1].float(), sigmas[j_s + 1].expand(count)
        lower = sigma_next.clamp_min(args.surrogate_sigma_min)
        sigma_tau = self._renoise_time(draws.u_surrogate[j], lower)
        noise = self._group_noise(rollout, "surrogate", j)
        x_tau, alpha, beta = forward_renoise(x_next, sigma_next, sigma_tau, noise)
        target = surrogate_target(x_next, noise, sigma_next, sigma_tau, alpha, beta)
        ffdebug.tap("train.surrogate_x_t", x_tau)
        condition = rollout.condition
        v_surrogate = self.adapter.forward(
            x_tau, sigma_tau, condition, module=self.variants.variant("surrogate")
        )
        with torch.no_grad():
            teacher, slow = self.variants.snapshot("teacher"), self.variants.snapshot("slow_surrogate")
            v_reference = self.adapter.forward(x_tau, sigma_tau, condition, parameters=teacher)
            v_slow = self.adapter.forward(x_tau, sigma_tau, condition, parameters=slow)
        ffdebug.tap("train.surrogate_velocity", v_surrogate)
        ffdebug.tap("train.reference_velocity", v_reference)
        backend = self.backend
        return surrogate_loss(
            v_surrogate,
            v_reference,
            v_slow,
            target,
            rollout.advantages,
            rollout.group_index,
            group_size=args.group_size,
            beta_dpo=args.surrogate_preference_beta,
            clip_range=args.surrogate_clip_range,
            runaway_threshold=args.surrogate_reference_threshold,
            reference_beta=args.surrogate_reference_beta,
            time_weight=(j_s + 1) / args.num_generator_steps if args.time_weight else 1.0,
            batch_mean=lambda value: float(backend.gather_rows(value.reshape(1)).mean()),
        )

    def authors_generator_loss(
        self, rollout: TDMR1Rollout, draws: SharedDraws, j: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """L_G at stage j: x̂_0 with gradient; teacher, fake score and surrogate under ``no_grad``."""
        args = self.args
        x_j, sigma_j, sigma_next = self._stage(rollout, j)
        condition = rollout.condition
        v = self.adapter.forward(x_j, sigma_j, condition, module=self.variants.variant("generator"))
        x0, x_next = self._replay(x_j, sigma_j, sigma_next, v)
        x_next = x_next.detach()
        ffdebug.tap("train.x0", x0)
        trunc = args.trunc_steps if args.trunc_steps is not None else args.num_generator_steps
        with torch.no_grad():
            sigma_tau = self._renoise_time(draws.u_fake[j], sigma_next)  # ``tau_list``, as the fake phase
            x_tau, _, _ = forward_renoise(
                x_next, sigma_next, sigma_tau, self._sample_noise(rollout, "generator", j)
            )
            teacher = self.variants.snapshot("teacher")
            v_cond, v_uncond = self._cond_uncond(x_tau, sigma_tau, condition, parameters=teacher)
            v_guided = v_uncond + args.real_guidance_scale * (v_cond - v_uncond)
            v_fake = self.adapter.forward(x_tau, sigma_tau, condition, module=self.variants.variant("fake"))
            x0_guided, x0_cond, x0_uncond, x0_fake = (
                predicted_x0(x_tau, velocity, sigma_tau) for velocity in (v_guided, v_cond, v_uncond, v_fake)
            )
            reward = None
            if j < trunc:
                lower = sigma_next.clamp_min(args.reward_sigma_min)
                sigma_r = torch.maximum(
                    self._renoise_time(draws.u_reward[j], lower), lower
                )  # ``tau_list_dgpo``
                x_r, _, _ = forward_renoise(
                    x_next, sigma_next, sigma_r, self._group_noise(rollout, "reward", j)
                )
                v_surrogate = self.adapter.guided_forward(
                    x_r,
                    sigma_r,
                    condition,
                    guidance_scale=args.surrogate_guidance_scale,
                    module=self.variants.variant("surrogate"),
                )
                v_reference = self.adapter.forward(x_r, sigma_r, condition, parameters=teacher)
                reward = (predicted_x0(x_r, v_surrogate, sigma_r), predicted_x0(x_r, v_reference, sigma_r))
                ffdebug.tap("train.x0_surrogate", reward[0])
        ffdebug.tap("train.x_t", x_tau)
        ffdebug.tap("train.x0_real", x0_guided)
        ffdebug.tap("train.x0_fake", x0_fake)
        return generator_loss(
            x0,
            x0_guided,
            x0_cond,
            x0_uncond,
            x0_fake,
            reward,
            tdm_weight=args.tdm_weight,
            cfg_reward_scale=args.cfg_reward_scale,
            huber_c=args.huber_c if args.huber_c > 0 else None,
        )
