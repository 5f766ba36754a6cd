"""DiffusionOPD: on-policy distillation of one or more frozen teachers into a student, along the
student's own rollouts (generation, no feedback).

Project: ali-vilab/DiffusionOPD ("On-Policy Distillation of Diffusion Models"). Transcription source:
Flow-Factory's ``diffusion-opd`` (Jayce-Ping/Flow-Factory-Draft ``src/flow_factory/trainers/opd/trainer.py``):
the student rolls out (no reward); pass 1 caches each teacher's transition mean μ_T at the stored states
x_j of the samples routed to it; pass 2 trains the student only on ½‖μ_S − μ_T‖²/s_j². Teachers are
routed by dataset there; here by prompt (``train.teachers[i].prompts``; one teacher may take every
prompt no other one claims). The distilled step band is ``int(T · timestep_fraction)`` steps from the
start (Flow-Factory ``timestep_range`` 0.99). Loss: ``reference_trainer.losses.opd``.

Roles:
    student    trainable variant (the base: the adapter's transformer)
    teacher_i  frozen snapshots loaded from ``train.teachers[i].path`` (a diffusers transformer folder:
               ``save_pretrained`` output, or a checkpoint's ``model/<variant>/``)

One rollout iteration:

1. ``sample``: P prompts, one Flow-SDE (``noise_level`` > 0) or ODE (0) trajectory each from the
   student, without gradient;
2. ``gradient_steps_per_iteration`` optimizer steps, each on a minibatch of the shuffled samples of
   every rank (gathered; one shuffle of the global batch, each rank trains its equal share): for
   every trained step j, the student's transition mean μ_S at x_j (with gradient) and the routed
   teacher's μ_T (classifier-free guided when its ``guidance_scale`` > 1) under ``no_grad``;
   L = mean_{i, j} ½·(μ_S − μ_T)²/s_j² (s_j the step's transition std; 1 for the ODE).

``evaluate``: MMD² and per-noise MSE between the student's and the routed teachers'
``eval.num_inference_steps``-step ODE samples from the same noise (both fall as the student distils).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

import ffdebug
from reference_trainer import evaluation
from reference_trainer.adapters.base import Condition, Trajectory
from reference_trainer.config import RolloutSize, TrainingArguments
from reference_trainer.contracts import GENERATION_NO_FEEDBACK, ExecutionContract
from reference_trainer.errors import ConfigError, require
from reference_trainer.losses.opd import opd_loss
from reference_trainer.registry import register_trainer
from reference_trainer.sde import flow_ode_step, flow_sde_step
from reference_trainer.taps import tap_rollout_inputs
from reference_trainer.trainers.base import BaseTrainer

WEIGHTS = "diffusion_pytorch_model.safetensors"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@dataclass(frozen=True, kw_only=True)
class TeacherSpec:
    """One frozen teacher of ``train.teachers``."""

    path: str
    """A diffusers transformer folder holding ``diffusion_pytorch_model.safetensors`` of the student's
    architecture (relative: to the working directory, else to ``reference_trainer/fixtures/``)."""
    prompts: tuple[str, ...] = ()
    """The prompts routed to this teacher; () = every prompt no other teacher claims."""
    guidance_scale: float = 1.0
    """The teacher's CFG scale (Flow-Factory per-teacher ``guidance_scale``); 1 = none."""


@dataclass(frozen=True, kw_only=True)
class DiffusionOPDArguments(TrainingArguments):
    """``train:`` section of a DiffusionOPD run."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_NO_FEEDBACK
    teachers: tuple[TeacherSpec, ...] = ()
    """The frozen teachers (at least one)."""
    prompts_per_iteration: int = 4
    """P: student rollouts (one per prompt) per rollout iteration."""
    num_inference_steps: int = 4
    """T: denoising steps of each rollout."""
    noise_level: float = 0.7
    """The Flow-SDE's a of the rollouts and transitions; 0 = the ODE (s_j = 1)."""
    timestep_fraction: float = 0.99
    """The first int(T · fraction) steps are distilled (Flow-Factory ``timestep_range`` 0.99)."""
    gradient_steps_per_iteration: int = 1
    """Optimizer steps per rollout iteration (minibatches of the shuffled samples); must divide P."""

    def trained_steps(self) -> int:
        """int(T · timestep_fraction)."""
        return int(self.num_inference_steps * self.timestep_fraction)

    def rollout_size(self) -> RolloutSize:
        """P trajectories of T + 1 latents per rollout iteration."""
        return RolloutSize(
            (("train.prompts_per_iteration", self.prompts_per_iteration),),
            ("train.num_inference_steps", self.num_inference_steps),
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.teachers) >= 1, "teachers", "needs at least one teacher {path: DIR}")
        catch_all = [i for i, teacher in enumerate(self.teachers) if not teacher.prompts]
        require(
            len(catch_all) <= 1,
            "teachers",
            f"teachers {catch_all} all take the unclaimed prompts; give prompts",
        )
        claimed: dict[str, int] = {}
        for i, teacher in enumerate(self.teachers):
            require(bool(teacher.path), f"teachers[{i}].path", "is empty")
            require(
                teacher.guidance_scale >= 1.0,
                f"teachers[{i}].guidance_scale",
                f"must be >= 1, got {teacher.guidance_scale}",
            )
            for prompt in teacher.prompts:
                require(
                    prompt not in claimed,
                    f"teachers[{i}].prompts",
                    f"{prompt!r} is already routed to teachers[{claimed.get(prompt)}]",
                )
                claimed[prompt] = i
        for name in ("prompts_per_iteration", "num_inference_steps"):
            require(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        require(self.noise_level >= 0.0, "noise_level", f"must be >= 0, got {self.noise_level}")
        require(
            0.0 < self.timestep_fraction <= 1.0 and self.trained_steps() >= 1,
            "timestep_fraction",
            f"int({self.timestep_fraction} × num_inference_steps {self.num_inference_steps}) trains no step",
        )
        steps = self.gradient_steps_per_iteration
        require(
            steps >= 1 and self.prompts_per_iteration % steps == 0,
            "gradient_steps_per_iteration",
            f"must divide the {self.prompts_per_iteration} samples of an iteration, got {steps}",
        )

    def teacher_of(self, prompt: str) -> int:
        """The index of the teacher ``prompt`` is routed to (ConfigError when none is)."""
        for i, teacher in enumerate(self.teachers):
            if prompt in teacher.prompts:
                return i
        for i, teacher in enumerate(self.teachers):
            if not teacher.prompts:
                return i
        raise ConfigError(
            "train.teachers", f"prompt {prompt!r} is routed to no teacher; add a teacher without prompts"
        )


@dataclass(frozen=True)
class OPDSamples:
    """One rollout iteration: P prompts, their conditions, trajectories and routed teachers."""

    prompts: list[str]
    condition: Condition
    trajectory: Trajectory
    teachers: torch.Tensor  # [P] teacher index per sample


@register_trainer("diffusion_opd", arguments=DiffusionOPDArguments)
class DiffusionOPDTrainer(BaseTrainer):
    """DiffusionOPD (module docstring)."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_NO_FEEDBACK
    roles: ClassVar[tuple[str, ...]] = ("student",)

    def setup_roles(self) -> dict[str, str]:
        """The ``student`` variant and one frozen snapshot per teacher, loaded from its folder.

        Returns:
            ``{role: variant name}``.
        """
        self.variants.declare_variant("student")
        for i, teacher in enumerate(self.args.teachers):
            snapshot = self.variants.add_snapshot(f"teacher_{i}", "student")
            load_teacher(snapshot, teacher_folder(teacher.path), f"train.teachers[{i}].path")
        return {"student": "student"}

    # ---------------------------------------------------------------- acquisition
    @torch.no_grad()
    def sample(self) -> OPDSamples:
        """P prompts and the student's rollouts (module docstring, step 1).

        Returns:
            The ``OPDSamples``.
        """
        args: DiffusionOPDArguments = self.args  # type: ignore[assignment]
        prompts = self.rollout_prompts(args.prompts_per_iteration, 1)
        condition = self.conditions.get(prompts)
        trajectory = self.adapter.inference(
            condition,
            num_steps=args.num_inference_steps,
            noise_level=args.noise_level,
            generator=self.sample_generators("opd", self.rollout_iteration, count=len(prompts)),
            module=self.variants.variant("student"),
            given=self.rollout_given(args.num_inference_steps, args.noise_level),
        )
        tap_rollout_inputs(self.adapter, prompts, trajectory, num_steps_field="train.num_inference_steps")
        ffdebug.tap("rollout.latents", trajectory.latents)
        teachers = torch.tensor([args.teacher_of(prompt) for prompt in prompts])
        return OPDSamples(prompts, condition, trajectory, teachers)

    # ---------------------------------------------------------------- optimisation
    def optimize(self, samples: OPDSamples) -> None:
        """One optimizer step per minibatch of the shuffled samples (module docstring, step 2).

        Args:
            samples: what ``sample`` returned.
        """
        args: DiffusionOPDArguments = self.args  # type: ignore[assignment]
        steps = args.trained_steps()
        samples = self.gather_samples(samples)
        drawn = torch.randperm(
            len(samples.prompts), generator=self.generator("shuffle", self.rollout_iteration)
        )
        with ffdebug.step(**self.step_tags("train", role="student")):  # the sample order is an input
            order = self.sample_order(drawn)
        for minibatch in self.cycle_steps(order.chunk(args.gradient_steps_per_iteration)):
            minibatch = self.backend.local_part(minibatch)  # this rank's share of the global minibatch
            with (
                ffdebug.step(**self.step_tags("train", role="student")),
                self.optim.phase("student") as phase,
            ):
                for j in range(steps):
                    with ffdebug.step(timestep=j):
                        loss, metrics = self.step_loss(samples, minibatch, j)
                    metrics.pop("loss")
                    phase.backward(loss / steps, metrics)

    def gather_samples(self, samples: OPDSamples) -> OPDSamples:
        """Every rank's samples in rank order (= global sample order), so that the one shuffle of the
        iteration makes the same global minibatches whatever the rank layout (as GRPO's).

        Args:
            samples: this rank's samples.

        Returns:
            The samples of every rank.
        """
        backend = self.backend
        if backend.world_size == 1:
            return samples
        rows, trajectory, condition = backend.gather_rows, samples.trajectory, samples.condition
        return OPDSamples(
            backend.gather_objects(samples.prompts),
            Condition(rows(condition.prompt_embeds), rows(condition.pooled)),
            Trajectory(
                rows(trajectory.latents),
                rows(trajectory.log_probs) if trajectory.log_probs is not None else None,
                trajectory.sigmas,
                rows(trajectory.velocities) if trajectory.velocities is not None else None,
            ),
            rows(samples.teachers),
        )

    def transition_mean(
        self, samples: OPDSamples, index: torch.Tensor, j: int, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(μ, s) of the step x_j -> x_{j+1} under velocity v: the Flow-SDE mean and its transition std
        σ_t·√(−Δt), or the ODE's x_j + v·Δt and s = 1.

        Args:
            samples: this iteration's samples.
            index: the samples, [b].
            j: the denoising step.
            v: the velocity at x_j, [b, C, H, W].

        Returns:
            ``(mean [b, C, H, W], std [b])``.
        """
        trajectory = samples.trajectory
        sigmas = trajectory.sigmas
        x_j = trajectory.latents[index, j]
        sigma, sigma_next = sigmas[j].expand(len(index)), sigmas[j + 1].expand(len(index))
        if self.args.noise_level == 0.0:
            return flow_ode_step(v, x_j, sigma, sigma_next).float(), torch.ones(len(index))
        step = flow_sde_step(
            v,
            x_j,
            sigma,
            sigma_next,
            self.args.noise_level,
            sigma_max=float(sigmas[1]),
            prev_sample=trajectory.latents[index, j + 1],
        )
        return step.mean, step.step_std.reshape(-1)

    def step_loss(
        self, samples: OPDSamples, index: torch.Tensor, j: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """½·mean (μ_S − μ_T)²/s² of samples ``index`` at step j (module docstring, step 2).

        Args:
            samples: this iteration's samples.
            index: the samples, [b].
            j: the denoising step.

        Returns:
            The loss and its metrics.
        """
        x_j = samples.trajectory.latents[index, j]
        sigma = samples.trajectory.sigmas[j].expand(len(index))
        condition = samples.condition.select(index)
        v_student = self.adapter.forward(x_j, sigma, condition, module=self.variants.variant("student"))
        student_mean, std = self.transition_mean(samples, index, j, v_student)
        with torch.no_grad():
            v_teacher = torch.empty_like(v_student)
            routed = samples.teachers[index]
            for i, teacher in enumerate(self.args.teachers):
                rows = (routed == i).nonzero().flatten()
                if len(rows) == 0:
                    continue
                v_teacher[rows] = self.adapter.guided_forward(
                    x_j[rows],
                    sigma[rows],
                    condition.select(rows),
                    guidance_scale=teacher.guidance_scale,
                    parameters=self.variants.snapshot(f"teacher_{i}"),
                )
            teacher_mean, _ = self.transition_mean(samples, index, j, v_teacher)
        ffdebug.tap("train.student_mean", student_mean)
        ffdebug.tap("train.teacher_mean", teacher_mean)
        return opd_loss(student_mean, teacher_mean, std)

    def evaluate(self) -> dict[str, float]:
        """The student against its routed teachers on the fixed evaluation noise:

        * ``reward.*``: evaluation rewards of the student's ODE samples;
        * ``teacher_mmd``: MMD² between the student's and the routed teachers' samples from the same
          noise (RBF bandwidth: the teachers' median squared distance);
        * ``teacher_paired_mse``: mean squared per-noise gap between the two.

        Returns:
            ``{metric: value}``.
        """
        eval_config = self.config.eval
        prompts, group_ids = evaluation.eval_prompts(eval_config)
        condition = self.conditions.get(prompts)

        def ode(**model) -> torch.Tensor:
            return self.adapter.inference(
                condition,
                num_steps=eval_config.num_inference_steps,
                noise_level=0.0,
                generator=evaluation.eval_generator(eval_config),  # the same noise for every model
                **model,
            ).final

        x = ode(module=self.variants.variant("student"))
        routed = torch.tensor([self.args.teacher_of(prompt) for prompt in prompts])
        x_teacher = torch.empty_like(x)
        for i in routed.unique().tolist():
            rows = routed == i
            x_teacher[rows] = ode(parameters=self.variants.snapshot(f"teacher_{i}"))[rows]
        metrics = evaluation.reward_metrics(self.adapter, eval_config, x, prompts, group_ids)
        metrics["teacher_mmd"] = evaluation.mmd(x, x_teacher, evaluation.median_sq_distance(x_teacher))
        metrics["teacher_paired_mse"] = float((x - x_teacher).square().mean())
        return metrics


def teacher_folder(path: str) -> Path:
    """``path`` as given when it exists (absolute, or relative to the working directory), else relative
    to the package fixtures (``reference_trainer/fixtures/``, as the example config's teacher).

    Args:
        path: ``train.teachers[i].path``.

    Returns:
        The folder to load.
    """
    given = Path(path)
    return given if given.is_absolute() or given.exists() else FIXTURES / given


@torch.no_grad()
def load_teacher(snapshot: dict[str, torch.Tensor], folder: Path, field: str) -> None:
    """Fill ``snapshot`` in place from ``folder/diffusion_pytorch_model.safetensors`` (every key, same shapes).

    Args:
        snapshot: the teacher's snapshot (a copy of the student's parameters).
        folder: the teacher's diffusers transformer folder.
        field: the config field named by an error.
    """
    from safetensors.torch import load_file

    path = folder / WEIGHTS
    if not path.is_file():
        raise ConfigError(
            field, f"{path} does not exist; give a diffusers transformer folder (save_pretrained)"
        )
    weights = load_file(path)
    missing = sorted(set(snapshot) - set(weights))
    if missing:
        raise ConfigError(field, f"{path} lacks {len(missing)} student parameters, e.g. {missing[:3]}")
    for key, value in snapshot.items():
        if weights[key].shape != value.shape:
            raise ConfigError(
                field,
                f"{path}: {key} has shape {tuple(weights[key].shape)}, the student {tuple(value.shape)}",
            )
        value.copy_(weights[key].to(value.dtype))
