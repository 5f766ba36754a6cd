"""TDM: distil a multi-step flow model into a K-step generator by trajectory distribution matching.

Paper: Luo et al. 2025, "Learning Few-Step Diffusion Models by Trajectory Distribution Matching",
arXiv 2503.06674. Canonical code: Luo-Yihong/TDM ``train_tdm_demo.py`` (data-free: prompts only; a
LoRA generator and a LoRA fake score, both started from the teacher; two optimizers, the generator's at
lr / 5, both with Adam betas (0, 0.95), lines 780-795; one fake-score update per generator update,
line 1140). Flow-Factory's ``tdm`` (``trainers/distillation/tdm.py``) makes the fake : generator ratio a
TTUR setting as in DMD2. Losses, in flow-matching form: ``reference_trainer.losses.tdm``.

Roles:
    generator  trainable variant (the base): a deterministic K-step Euler sampler on the uniform
               boundaries σ_k = 1 − k/K (``num_generator_steps`` = K); stage k runs from σ_k to σ_{k+1}
    fake       trainable variant (a copy of the initial weights): the score of the generator's stages
    teacher    frozen snapshot of the initial weights (the "real score"; never a variant)

One rollout iteration (``sample`` then ``optimize``); every optimizer step is one role phase:

1. ``sample``: P prompts and one K-step generator trajectory each, without gradient; every ODE
   boundary x_0 .. x_K is kept (``Trajectory.latents``);
2. each phase draws, per sample, a stage k ~ U{0..K−1}, σ_t ~ U(max(σ_{k+1}, σ_min), σ_k − margin)
   (the reference's ``use_separate``: σ_t inside the stage) and n ~ N(0, I); the generator replays
   stage k at x_k → x̂_0, ε̂; x_t is the conditional re-noise of its ODE state at σ_{k+1} to σ_t;
3. ``fake_updates_per_generator_update`` ``fake`` phases (generator under ``no_grad``): the
   importance-weighted, SNR-capped x̂_0 loss of the fake score at x_t;
4. one ``generator`` phase (x̂_0 with gradient; teacher and fake score under ``no_grad``): the
   pseudo-Huber loss to the revised x̂_0 (the teacher's CFG direction when ``real_guidance_scale`` > 1).

All randomness comes from ``self.sample_generators("tdm", rollout_iteration, ...)``, one generator per
sample: a resumed run is bit-identical to the uninterrupted one. ``evaluate`` measures the
distillation: MMD² and per-noise MSE between the K-step generator's samples and the teacher's
``eval.num_inference_steps``-step ODE samples from the same noise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

import ffdebug
from reference_trainer import evaluation
from reference_trainer.adapters.base import Condition, Trajectory
from reference_trainer.config import RolloutSize, TrainingArguments
from reference_trainer.contracts import GENERATION_NO_FEEDBACK, ExecutionContract
from reference_trainer.errors import require
from reference_trainer.flow_matching import predicted_x0, randn_rows
from reference_trainer.losses.tdm import (
    capped_snr,
    conditional_renoise,
    importance_weights,
    tdm_fake_loss,
    tdm_generator_loss,
)
from reference_trainer.registry import register_trainer
from reference_trainer.trainers.base import BaseTrainer


@dataclass(frozen=True, kw_only=True)
class TDMArguments(TrainingArguments):
    """``train:`` section of a TDM run."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_NO_FEEDBACK
    prompts_per_iteration: int = 4
    """P: generator trajectories (one per prompt) of each rollout iteration."""
    num_generator_steps: int = 4
    """K: the generator's ODE steps (the reference's 4-step student)."""
    fake_updates_per_generator_update: int = 1
    """Fake-score optimizer steps before each generator step (reference 1; Flow-Factory TTUR 5)."""
    sigma_min: float = 0.02
    """Lower bound of σ_t (the reference's ``max(20, t_mid)`` of 1000 timesteps)."""
    stage_margin: float = 0.01
    """σ_t stays below the stage's start σ_k by this much (the reference's ``t_g − 10``)."""
    snr_cap: float = 5.0
    """γ of the fake loss's min(SNR_t, γ) (reference line 1132)."""
    importance_clip: float = 20.0
    """Upper bound of the importance ratio (Flow-Factory ``tdm_importance_clip``; the reference: none)."""
    huber_c: float = 1e-3
    """c of the generator's pseudo-Huber loss; 0 = squared error (reference ``--use_huber`` off)."""
    real_guidance_scale: float = 1.0
    """CFG scale s of the teacher in the revised x̂_0; 1 = no guidance (reference ``--cfg``)."""

    def rollout_size(self) -> RolloutSize:
        """P trajectories of K + 1 boundaries per rollout iteration."""
        return RolloutSize(
            (("train.prompts_per_iteration", self.prompts_per_iteration),),
            ("train.num_generator_steps", self.num_generator_steps),
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("prompts_per_iteration", "num_generator_steps", "fake_updates_per_generator_update"):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require(0.0 < self.sigma_min < 1.0, "sigma_min", f"must be in (0, 1), got {self.sigma_min}")
        require(0.0 < self.stage_margin < 1.0, "stage_margin", f"must be in (0, 1), got {self.stage_margin}")
        require(self.snr_cap > 0.0, "snr_cap", f"must be > 0, got {self.snr_cap}")
        require(self.importance_clip > 0.0, "importance_clip", f"must be > 0, got {self.importance_clip}")
        require(self.huber_c >= 0.0, "huber_c", f"must be >= 0, got {self.huber_c}")
        require(
            self.real_guidance_scale >= 1.0,
            "real_guidance_scale",
            f"must be >= 1, got {self.real_guidance_scale}",
        )


@dataclass(frozen=True)
class TDMRollout:
    """One rollout iteration: P conditions and their generator trajectories (K + 1 boundaries)."""

    condition: Condition
    trajectory: Trajectory


@dataclass(frozen=True)
class StageDraw:
    """One phase's draws (module docstring, step 2): stage k, its σ_k / σ_{k+1} / σ_t and n, per sample."""

    x_stage: torch.Tensor
    sigma_stage: torch.Tensor
    sigma_mid: torch.Tensor
    sigma_t: torch.Tensor
    noise: torch.Tensor


@register_trainer("tdm", arguments=TDMArguments)
class TDMTrainer(BaseTrainer):
    """TDM (module docstring)."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_NO_FEEDBACK
    roles: ClassVar[tuple[str, ...]] = ("generator", "fake")

    def setup_roles(self) -> dict[str, str]:
        """The ``generator`` (the base) and ``fake`` variants, and the frozen ``teacher`` snapshot.

        Returns:
            ``{role: variant name}``.
        """
        self.variants.declare_variant("generator")
        self.variants.declare_variant("fake")
        self.variants.add_snapshot("teacher", "generator")
        return {"generator": "generator", "fake": "fake"}

    def phase_roles(self) -> list[str]:
        """The roles of one rollout iteration's optimizer steps: F ``fake``, then ``generator``."""
        return ["fake"] * self.args.fake_updates_per_generator_update + ["generator"]

    # ---------------------------------------------------------------- acquisition
    @torch.no_grad()
    def sample(self) -> TDMRollout:
        """P prompts and their K-step generator trajectories (module docstring, step 1).

        Returns:
            The ``TDMRollout``.
        """
        args: TDMArguments = self.args  # type: ignore[assignment]
        prompts = self.rollout_prompts(args.prompts_per_iteration, 1)
        condition = self.conditions.get(prompts)
        generators = self.sample_generators("tdm", self.rollout_iteration, "z", count=len(prompts))
        z = self.rollout_noise(prompts, randn_rows((len(prompts), *self.adapter.latent_shape), generators))
        trajectory = self.generator_trajectory(z, condition)
        ffdebug.tap("rollout.latents", trajectory.latents)
        return TDMRollout(condition, trajectory)

    def rollout_noise(self, prompts: list[str], z: torch.Tensor) -> torch.Tensor:
        """The rollout's inputs: the prompts' token ids, z (drawn: the target's with ``--inputs-from``)
        and the generator's boundaries (derived from ``train.num_generator_steps``), tapped in the
        contract's order; returns the z to use, [P, C, H, W]."""
        ids = self.adapter.prompt_token_ids(list(prompts)) if ffdebug.enabled() else None
        if ids is not None:
            ffdebug.tap("rollout.prompt_ids", ids)
        z = self.drawn("rollout.noise", z)
        steps = self.args.num_generator_steps
        ffdebug.tap(
            "rollout.timesteps",
            self.boundaries(),
            derived_from=f"train.num_generator_steps={steps} (uniform)",
        )
        return z

    def boundaries(self) -> torch.Tensor:
        """σ_0 = 1 > σ_1 > ... > σ_K = 0, uniform (the reference's uniform timesteps T − k·T/K), [K + 1]."""
        return torch.linspace(1.0, 0.0, self.args.num_generator_steps + 1)

    def generator_trajectory(self, z: torch.Tensor, condition: Condition) -> Trajectory:
        """The K-step generator: x_{k+1} = x_k + (σ_{k+1} − σ_k)·v_G(x_k, σ_k) from x_0 = z, i.e. the
        reference's ``generate_new`` re-noise of x̂_0 with its own predicted noise (the same update).

        Args:
            z: the noise, [P, C, H, W].
            condition: the prompts' conditions.

        Returns:
            The ``Trajectory`` (latents [P, K + 1, C, H, W], the boundaries, the velocities
            [P, K, C, H, W]).
        """
        sigmas = self.boundaries()
        generator = self.variants.variant("generator")
        x, latents, velocities = z, [z], []
        for k in range(len(sigmas) - 1):
            sigma = torch.full((x.shape[0],), float(sigmas[k]))
            v = self.adapter.forward(x, sigma, condition, module=generator)
            x = x + float(sigmas[k + 1] - sigmas[k]) * v
            latents.append(x)
            velocities.append(v.float())
        return Trajectory(torch.stack(latents, dim=1), None, sigmas, torch.stack(velocities, dim=1))

    def draw_stage(self, rollout: TDMRollout, phase: int) -> StageDraw:
        """Stage k, σ_t and n per sample for phase ``phase`` (module docstring, step 2).

        Args:
            rollout: this iteration's trajectories.
            phase: the phase's index in the iteration.

        Returns:
            The ``StageDraw``.
        """
        args: TDMArguments = self.args  # type: ignore[assignment]
        latents, sigmas = rollout.trajectory.latents, rollout.trajectory.sigmas
        count, steps = latents.shape[0], latents.shape[1] - 1
        stages, fractions, noises = [], [], []
        for g in self.sample_generators("tdm", self.rollout_iteration, phase, "stage", count=count):
            stages.append(int(torch.randint(steps, (1,), generator=g)))
            fractions.append(torch.rand(1, generator=g))
            noises.append(torch.randn(latents.shape[2:], generator=g))
        # the draws are inputs (docs/trainer-taps.md): the stage index, σ_t, ε, each taken with --inputs-from
        k = self.drawn("train.timestep_index", torch.tensor(stages), within=(0, steps))
        sigma_stage, sigma_mid = sigmas[k], sigmas[k + 1]
        low = sigma_mid.clamp_min(args.sigma_min)
        high = sigma_stage - args.stage_margin
        if not bool((high > low).all()):
            raise ValueError(
                "train.stage_margin, train.sigma_min: leave no σ_t inside a generator stage of σ schedule "
                f"{[round(float(s), 4) for s in sigmas]}; lower them or train.num_generator_steps"
            )
        sigma_t = self.drawn("train.sigma", low + torch.cat(fractions) * (high - low))
        x_stage = latents[torch.arange(count), k].float()
        return StageDraw(
            x_stage, sigma_stage, sigma_mid, sigma_t, self.drawn("train.noise", torch.stack(noises))
        )

    def generator_prediction(
        self, draw: StageDraw, condition: Condition
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The generator's stage replay: (x̂_0, ε̂) = (x_k − σ_k v, x_k + (1 − σ_k) v), v = v_G(x_k, σ_k).

        Args:
            draw: the stage draws.
            condition: the prompts' conditions.

        Returns:
            ``(x0, eps_hat)``, each [P, C, H, W].
        """
        generator = self.variants.variant("generator")
        v = self.adapter.forward(draw.x_stage, draw.sigma_stage, condition, module=generator)
        sigma = draw.sigma_stage.reshape(-1, 1, 1, 1)
        return predicted_x0(draw.x_stage, v, draw.sigma_stage), draw.x_stage + (1.0 - sigma) * v

    # ---------------------------------------------------------------- optimisation
    def optimize(self, rollout: TDMRollout) -> None:
        """One optimizer step of its role per phase (module docstring, steps 2-4).

        Args:
            rollout: what ``sample`` returned.
        """
        for index, role in self.cycle_steps(list(enumerate(self.phase_roles()))):
            with ffdebug.step(**self.step_tags("train", role=role)), self.optim.phase(role) as step:
                draw = self.draw_stage(rollout, index)  # inside the block: its draws carry its tags
                if role == "fake":
                    loss, metrics = self.fake_loss(draw, rollout.condition)
                else:
                    loss, metrics = self.generator_loss(draw, rollout.condition)
                metrics.pop("loss")
                step.backward(loss, metrics)

    def fake_loss(self, draw: StageDraw, condition: Condition) -> tuple[torch.Tensor, dict[str, float]]:
        """The fake score's importance-weighted, SNR-capped x̂_0 loss at x_t (module doc, step 3).

        Args:
            draw: the stage draws.
            condition: the prompts' conditions.

        Returns:
            The loss and its metrics.
        """
        args: TDMArguments = self.args  # type: ignore[assignment]
        with torch.no_grad():
            x0, eps_hat = self.generator_prediction(draw, condition)
            renoised = conditional_renoise(x0, eps_hat, draw.sigma_mid, draw.sigma_t, draw.noise)
        ffdebug.tap("train.x0", x0)
        ffdebug.tap("train.x_t", renoised.x_t)
        weights = importance_weights(renoised.mixed_noise, renoised.noise, args.importance_clip)
        ffdebug.tap("train.importance", weights)
        fake = self.variants.variant("fake")
        v_fake = self.adapter.forward(renoised.x_t, draw.sigma_t, condition, module=fake)
        x0_fake = predicted_x0(renoised.x_t, v_fake, draw.sigma_t)
        ffdebug.tap("train.x0_fake", x0_fake)
        return tdm_fake_loss(x0_fake, x0, capped_snr(draw.sigma_t, args.snr_cap), weights)

    def generator_loss(self, draw: StageDraw, condition: Condition) -> tuple[torch.Tensor, dict[str, float]]:
        """The generator's pseudo-Huber loss to the revised x̂_0 (module doc, step 4).

        Args:
            draw: the stage draws.
            condition: the prompts' conditions.

        Returns:
            The loss and its metrics.
        """
        args: TDMArguments = self.args  # type: ignore[assignment]
        x0, eps_hat = self.generator_prediction(draw, condition)  # with gradient to the generator
        ffdebug.tap("train.x0", x0)
        with torch.no_grad():
            x_t = conditional_renoise(
                x0.detach(), eps_hat.detach(), draw.sigma_mid, draw.sigma_t, draw.noise
            ).x_t
            x0_real, x0_uncond = self.teacher_predictions(x_t, draw.sigma_t, condition)
            v_fake = self.adapter.forward(x_t, draw.sigma_t, condition, module=self.variants.variant("fake"))
            x0_fake = predicted_x0(x_t, v_fake, draw.sigma_t)
        ffdebug.tap("train.x_t", x_t)
        ffdebug.tap("train.x0_real", x0_real)
        ffdebug.tap("train.x0_fake", x0_fake)
        return tdm_generator_loss(
            x0,
            x0_real,
            x0_fake,
            x0_uncond,
            guidance_scale=args.real_guidance_scale,
            huber_c=args.huber_c if args.huber_c > 0 else None,
        )

    def teacher_predictions(
        self, x_t: torch.Tensor, sigma: torch.Tensor, condition: Condition
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The teacher's conditional x̂_0, and its unconditional one when ``real_guidance_scale`` > 1.

        Args:
            x_t: re-noised latents, [P, C, H, W].
            sigma: σ_t per sample, [P].
            condition: the prompts' conditions.

        Returns:
            ``(x0_real, x0_uncond or None)``.
        """
        teacher = self.variants.snapshot("teacher")
        x0_real = predicted_x0(x_t, self.adapter.forward(x_t, sigma, condition, parameters=teacher), sigma)
        if self.args.real_guidance_scale == 1.0:
            return x0_real, None
        uncond = self.adapter.unconditional(x_t.shape[0])
        v_uncond = self.adapter.forward(x_t, sigma, uncond, parameters=teacher)
        return x0_real, predicted_x0(x_t, v_uncond, sigma)

    def evaluate(self) -> dict[str, float]:
        """The K-step generator against its teacher, on the fixed evaluation noise:

        * ``reward.*``: evaluation rewards of the generator's K-step samples;
        * ``teacher_mmd``: MMD² between them and the teacher's ``eval.num_inference_steps``-step ODE
          samples from the same noise (RBF bandwidth: their median squared distance);
        * ``teacher_paired_mse``: mean squared per-noise gap between the two.

        Returns:
            ``{metric: value}``.
        """
        eval_config = self.config.eval
        prompts, group_ids = evaluation.eval_prompts(eval_config)
        condition = self.conditions.get(prompts)
        z = evaluation.eval_noise(eval_config, len(prompts), self.adapter.latent_shape)
        x = self.generator_trajectory(z, condition).latents[:, -1]
        x_teacher = self.adapter.inference(
            condition,
            num_steps=eval_config.num_inference_steps,
            noise_level=0.0,
            generator=evaluation.eval_generator(eval_config),  # the same first draw: the same noise
            parameters=self.variants.snapshot("teacher"),
        ).final
        metrics = evaluation.reward_metrics(self.adapter, eval_config, x, prompts, group_ids)
        metrics["teacher_mmd"] = evaluation.mmd(x, x_teacher, evaluation.median_sq_distance(x_teacher))
        metrics["teacher_paired_mse"] = float((x - x_teacher).square().mean())
        return metrics
