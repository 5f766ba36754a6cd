"""DMD2: distil a multi-step flow model into a one-step generator by distribution matching (data-free).

Papers: Yin et al. 2023, "One-step Diffusion with Distribution Matching Distillation", arXiv
2311.18828 (DMD, eq. 7-8); Yin et al. 2024, "Improved Distribution Matching Distillation for Fast
Image Synthesis", arXiv 2405.14867 (DMD2: no regression loss, two time-scale updates). Canonical code:
tianweiy/DMD2 ``main/sd_guidance.py`` (losses) and ``main/train_sd.py`` (the generator is updated every
``dfake_gen_update_ratio`` guidance updates). This is Flow-Factory's data-free, GAN-free ``dmd2``
(``trainers/distillation/dmd2.py``): flow-matching scores, x_0-space DMD direction, one physical
optimizer with two role groups. Losses: ``reference_trainer.losses.dmd2``.

Roles:
    generator  trainable variant (the base: the adapter's transformer); one step x = z − v_G(z, σ=1, c)
    fake       trainable variant (a copy of the initial weights): the score of the generator's outputs
    teacher    frozen snapshot of the initial weights (the "real score"; never a variant)

One rollout iteration (``sample`` then ``optimize``); every optimizer step is one role phase:

1. ``sample``: for each of the ``fake_updates_per_generator_update`` + 1 phases, P prompts (their
   cached conditions) and fresh noise z ~ N(0, I) [P, C, H, W];
2. ``fake_updates_per_generator_update`` ``fake`` phases: x = G(z) without gradient; σ ~ U(σ_min,
   σ_max), ε; x_σ = (1 − σ)x + σε; L_fake = mean ‖v_fake(x_σ) − (ε − x)‖²;
3. one ``generator`` phase: x = G(z) with gradient; x_σ from the detached x; x̂_0^real from the teacher
   (classifier-free guided when ``real_guidance_scale`` > 1), x̂_0^fake from the fake score (never
   guided, DMD2 asserts ``fake_guidance_scale == 1``), both without gradient;
   L_DM = ½·mean (x − sg(x − g)),  g = (x̂_0^fake − x̂_0^real)/mean|x − x̂_0^real|.

All randomness comes from ``self.sample_generators("dmd2", rollout_iteration, phase, ...)``, one generator
per sample (by its global index): a resumed run is bit-identical to the uninterrupted one, and the draws
do not depend on the rank layout. ``evaluate`` measures the distillation itself: the distance
between the one-step generator's samples and the teacher's multi-step samples (MMD², per-noise MSE).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

import ffdebug
from reference_trainer import evaluation
from reference_trainer.adapters.base import Condition
from reference_trainer.config import RolloutSize, TrainingArguments
from reference_trainer.contracts import GENERATION_NO_FEEDBACK, ExecutionContract
from reference_trainer.errors import require
from reference_trainer.flow_matching import Generators, interpolate, predicted_x0, randn_rows, sample_sigmas
from reference_trainer.losses.dmd2 import dmd_generator_loss, fake_score_loss
from reference_trainer.registry import register_trainer
from reference_trainer.trainers.base import BaseTrainer


@dataclass(frozen=True, kw_only=True)
class DMD2Arguments(TrainingArguments):
    """``train:`` section of a DMD2 run."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_NO_FEEDBACK
    prompts_per_iteration: int = 4
    """P: samples (one per prompt) generated for each phase."""
    fake_updates_per_generator_update: int = 5
    """Fake-score optimizer steps before each generator step (DMD2 ``dfake_gen_update_ratio``,
    Flow-Factory ``ttur_fake_updates``; both default 5)."""
    sigma_min: float = 0.02
    """Lower bound of σ ~ U(σ_min, σ_max) for both losses (Flow-Factory: U(0.02, 0.98))."""
    sigma_max: float = 0.98
    """Upper bound of the σ draw (DMD2 ``max_step_percent`` 0.98)."""
    real_guidance_scale: float = 1.0
    """CFG scale of the teacher in the generator loss; 1 = no guidance (the only role allowed CFG)."""

    def rollout_size(self) -> RolloutSize:
        """One noise z of P prompts for each of the F + 1 phases of a rollout iteration (one step)."""
        return RolloutSize(
            (
                ("train.prompts_per_iteration", self.prompts_per_iteration),
                ("train.fake_updates_per_generator_update", self.fake_updates_per_generator_update + 1),
            ),
            ("", 1),
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.prompts_per_iteration >= 1,
            "prompts_per_iteration",
            f"must be >= 1, got {self.prompts_per_iteration}",
        )
        require(
            self.fake_updates_per_generator_update >= 1,
            "fake_updates_per_generator_update",
            f"must be >= 1, got {self.fake_updates_per_generator_update}",
        )
        require(
            0.0 < self.sigma_min < self.sigma_max < 1.0,
            "sigma_min",
            f"need 0 < sigma_min < sigma_max < 1, got {self.sigma_min}, {self.sigma_max}",
        )
        require(
            self.real_guidance_scale >= 1.0,
            "real_guidance_scale",
            f"must be >= 1, got {self.real_guidance_scale}",
        )


@dataclass(frozen=True)
class DMD2Phase:
    """Inputs of one role phase: P conditions and the generator's noise z [P, C, H, W]."""

    role: str
    condition: Condition
    z: torch.Tensor
    prompts: tuple[str, ...] = ()  # the prompts of `condition` (their token ids are tapped)


@register_trainer("dmd2", arguments=DMD2Arguments)
class DMD2Trainer(BaseTrainer):
    """DMD2 (module docstring)."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_NO_FEEDBACK
    roles: ClassVar[tuple[str, ...]] = ("generator", "fake")

    def setup_roles(self) -> dict[str, str]:
        """The ``generator`` (the base) and ``fake`` variants, and the frozen ``teacher`` snapshot.

        Returns:
            ``{role: variant name}``.
        """
        self.variants.declare_variant("generator")  # the base: the adapter's transformer
        self.variants.declare_variant("fake")  # a copy of the initial weights
        self.variants.add_snapshot("teacher", "generator")  # frozen real score, before any update
        return {"generator": "generator", "fake": "fake"}

    # ---------------------------------------------------------------- acquisition
    def sample(self) -> list[DMD2Phase]:
        """The noise and conditions of this iteration's phases (module docstring, step 1).

        Returns:
            One ``DMD2Phase`` per optimizer step: the fake phases, then the generator's.
        """
        args: DMD2Arguments = self.args  # type: ignore[assignment]
        roles = ["fake"] * args.fake_updates_per_generator_update + ["generator"]
        phases = []
        for index, role in enumerate(roles):
            prompts = self.prompts.draw(
                self.rollout_iteration * len(roles) + index, args.prompts_per_iteration
            )
            generators = self.sample_generators(
                "dmd2", self.rollout_iteration, index, "z", count=len(prompts)
            )
            z = randn_rows((len(prompts), *self.adapter.latent_shape), generators)
            phases.append(DMD2Phase(role, self.conditions.get(prompts), z, tuple(prompts)))
        return phases

    def generate(self, phase: DMD2Phase) -> torch.Tensor:
        """One-step generator: x = x̂_0(z, σ = 1) = z − 1·v_G(z, 1, c), [P, C, H, W].

        Args:
            phase: its noise z and condition.

        Returns:
            x, [P, C, H, W].
        """
        ones = torch.ones(phase.z.shape[0])
        v = self.adapter.forward(phase.z, ones, phase.condition, module=self.variants.variant("generator"))
        return predicted_x0(phase.z, v, ones)

    # ---------------------------------------------------------------- optimisation
    def optimize(self, phases: list[DMD2Phase]) -> None:
        """One optimizer step of its role per phase (module docstring, steps 2-3).

        Args:
            phases: what ``sample`` returned.
        """
        for index, phase in self.cycle_steps(list(enumerate(phases))):
            generator = self.sample_generators(
                "dmd2", self.rollout_iteration, index, "noise", count=len(phase.z)
            )
            with (
                ffdebug.step(**self.step_tags("train", role=phase.role)),
                self.optim.phase(phase.role) as step,
            ):
                phase = self.take_phase_inputs(phase)
                if phase.role == "fake":
                    loss, metrics = self.fake_loss(phase, generator)
                else:
                    loss, metrics = self.generator_loss(phase, generator)
                metrics.pop("loss")
                step.backward(loss, metrics)

    def take_phase_inputs(self, phase: DMD2Phase) -> DMD2Phase:
        """The phase's inputs, tapped for the same-inputs gate (docs/trainer-taps.md) and taken with
        ``--inputs-from``: ``rollout.prompt_ids`` and ``rollout.noise`` (its z); a one-step generator has
        no σ schedule or SDE noise."""
        prompts = self.drawn_prompts(phase.prompts)
        z = self.drawn("rollout.noise", phase.z)
        if tuple(prompts) == phase.prompts and z is phase.z:
            return phase
        return DMD2Phase(phase.role, self.conditions.get(prompts), z, tuple(prompts))

    def noised(
        self, x: torch.Tensor, generator: Generators
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(σ [P], ε [P, ...], x_σ) with σ ~ U(σ_min, σ_max); x_σ is built from the detached x.

        Args:
            x: generator samples, [P, C, H, W].
            generator: the RNG of σ and ε.

        Returns:
            ``(sigma, noise, x_sigma)``.
        """
        args: DMD2Arguments = self.args  # type: ignore[assignment]
        sigma = self.drawn(
            "train.sigma",
            sample_sigmas(x.shape[0], "uniform", generator, low=args.sigma_min, high=args.sigma_max),
        )
        noise = self.drawn("train.noise", randn_rows(x.shape, generator))
        return sigma, noise, interpolate(x.detach(), noise, sigma)

    def fake_loss(self, phase: DMD2Phase, generator: Generators) -> tuple[torch.Tensor, dict[str, float]]:
        """L_fake = mean ‖v_fake(x_σ) − (ε − x)‖² on detached generator samples (module doc, step 2).

        Args:
            phase: a ``fake`` phase.
            generator: the RNG of σ and ε (one, or one per sample).

        Returns:
            The loss and its metrics.
        """
        with torch.no_grad():
            x = self.generate(phase)
        ffdebug.tap("rollout.latents", x)
        sigma, noise, x_t = self.noised(x, generator)
        v_fake = self.adapter.forward(x_t, sigma, phase.condition, module=self.variants.variant("fake"))
        return fake_score_loss(v_fake, noise, x)

    def generator_loss(
        self, phase: DMD2Phase, generator: Generators
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """L_DM (module doc, step 3): teacher and fake score predictions under ``no_grad``.

        Args:
            phase: the ``generator`` phase.
            generator: the RNG of σ and ε.

        Returns:
            The loss and its metrics.
        """
        x = self.generate(phase)  # with gradient to the generator
        ffdebug.tap("rollout.latents", x)
        sigma, _, x_t = self.noised(x, generator)
        with torch.no_grad():
            x0_real = predicted_x0(x_t, self.teacher_velocity(x_t, sigma, phase.condition), sigma)
            v_fake = self.adapter.forward(x_t, sigma, phase.condition, module=self.variants.variant("fake"))
            x0_fake = predicted_x0(x_t, v_fake, sigma)
        ffdebug.tap("train.x0_real", x0_real)
        ffdebug.tap("train.x0_fake", x0_fake)
        return dmd_generator_loss(x, x0_real, x0_fake)

    def evaluate(self) -> dict[str, float]:
        """The one-step generator against its teacher, on the fixed evaluation noise z:

        * ``reward.*``: evaluation rewards of the one-step samples x = G(z);
        * ``teacher_mmd``: MMD² between {G(z)} and the teacher's ``eval.num_inference_steps``-step ODE
          samples from the same z (RBF bandwidth: their median squared distance) — what distribution
          matching minimises, so it falls as the generator distils the teacher;
        * ``teacher_paired_mse``: mean (G(z) − ODE_teacher(z))², the per-noise gap.

        Returns:
            ``{metric: value}``.
        """
        eval_config = self.config.eval
        prompts, group_ids = evaluation.eval_prompts(eval_config)
        condition = self.conditions.get(prompts)
        z = evaluation.eval_noise(eval_config, len(prompts), self.adapter.latent_shape)
        x = self.generate(DMD2Phase("generator", condition, z))
        x_teacher = self.adapter.inference(
            condition,
            num_steps=eval_config.num_inference_steps,
            noise_level=0.0,
            generator=evaluation.eval_generator(eval_config),  # first draw: the same z
            parameters=self.variants.snapshot("teacher"),
        ).final
        metrics = evaluation.reward_metrics(self.adapter, eval_config, x, prompts, group_ids)
        bandwidth = evaluation.median_sq_distance(x_teacher)
        metrics["teacher_mmd"] = evaluation.mmd(x, x_teacher, bandwidth)
        metrics["teacher_paired_mse"] = float((x - x_teacher).square().mean())
        return metrics

    def teacher_velocity(self, x_t: torch.Tensor, sigma: torch.Tensor, condition: Condition) -> torch.Tensor:
        """v_real, classifier-free guided when ``real_guidance_scale`` s > 1: v_u + s·(v_c − v_u).

        Args:
            x_t: noised latents, [P, C, H, W].
            sigma: σ per sample, [P].
            condition: the prompts' conditions.

        Returns:
            The teacher's velocity, [P, C, H, W].
        """
        scale = self.args.real_guidance_scale
        teacher = self.variants.snapshot("teacher")
        v_cond = self.adapter.forward(x_t, sigma, condition, parameters=teacher)
        if scale == 1.0:
            return v_cond
        uncond = self.conditions.get([""] * x_t.shape[0])
        v_uncond = self.adapter.forward(x_t, sigma, uncond, parameters=teacher)
        return v_uncond + scale * (v_cond - v_uncond)
