"""Flow-GRPO: PPO-clip on the Flow-SDE per-step log-prob ratio, with an optional KL to the reference.

Paper: Liu et al. 2025, "Flow-GRPO: Training Flow Matching Models via Online RL", arXiv 2505.05470.
Canonical code: yifan123/flow_grpo ``scripts/train_sd3.py`` (sampling, advantages, the training loop)
and ``flow_grpo/diffusers_patch/sd3_sde_with_logprob.py`` (the SDE step, ``reference_trainer.sde``).
Flow-Factory's ``grpo`` trainer (``trainers/grpo.py``) is the framework analogue.

One rollout iteration (``sample`` then ``optimize``):

1. draw P prompts and repeat each K times (``group_size``): B = P·K samples in P contiguous groups;
2. roll out with the Flow-SDE from the current policy (no grad), keeping every latent x_0..x_T and the
   per-step log-probs log p_old(x_{j+1} | x_j) [B, T];
3. decode x_T, compute the rewards, and the group-normalised advantages A [B] (``feedback.RewardFeedback``);
4. gather every rank's samples, shuffle the global batch and split it into
   ``gradient_steps_per_iteration`` minibatches, each rank training on its equal share; each is one
   optimizer step of the ``policy`` role, accumulating over microbatches and over the trained steps
   j < ⌊timestep_fraction·T⌋ (``trained_steps``): recompute log p_θ(x_{j+1} | x_j) with gradients and minimise
   L = mean max(−Â·r, −Â·clip(r, 1 ± ε)) + β·KL(p_θ ‖ p_ref) (``losses.grpo.grpo_loss``).

Roles: ``policy`` (trainable, the base variant); ``reference`` (a frozen snapshot of the initial
policy, declared only when ``kl_beta > 0``, used through ``functional_call``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

import ffdebug
from reference_trainer.adapters.base import Condition, Trajectory
from reference_trainer.contracts import GENERATION_REWARD, ExecutionContract
from reference_trainer.data import repeat_groups
from reference_trainer.distributed import Backend
from reference_trainer.errors import require
from reference_trainer.feedback import GenerationRewardArguments, RewardFeedback
from reference_trainer.losses import grpo as grpo_losses
from reference_trainer.registry import register_trainer
from reference_trainer.sde import SDEStep, flow_sde_step
from reference_trainer.taps import tap_rollout_inputs
from reference_trainer.trainers.base import BaseTrainer


def trained_steps(timestep_fraction: float, num_steps: int) -> int:
    """The number of denoising steps trained per trajectory: ``int(num_steps · timestep_fraction)``.

    flow_grpo ``scripts/train_sd3.py`` (``num_train_timesteps``): truncation, not rounding up, so the
    steps j = 0 .. trained_steps − 1 are trained and the last ones (towards σ = 0) are left out.

    Args:
        timestep_fraction: the fraction f in (0, 1] of each trajectory to train.
        num_steps: T, the rollout's denoising steps.

    Returns:
        ``int(T · f)`` (the float product, truncated, exactly as flow_grpo computes it).
    """
    return int(num_steps * timestep_fraction)


def loss_scale(advantages: torch.Tensor, metrics: dict[str, float], args: GRPOArguments) -> float:
    """Σ|terms| / B of the GRPO loss, ≈ mean|Â|·mean ρ + β·KL: the size of what ``loss.<role>`` is the
    mean of, so a loss of cancelling terms (on-policy, ρ = 1) is judged against its rounding."""
    adv = advantages.float().clamp(-args.adv_clip_max, args.adv_clip_max).abs().mean().item()
    return adv * metrics.get("ratio_mean", 1.0) + args.kl_beta * metrics.get("kl", 0.0)


@dataclass(frozen=True, kw_only=True)
class GRPOArguments(GenerationRewardArguments):
    """``train:`` section of a GRPO run (defaults: flow_grpo ``config/base.py`` where it has one).

    Rollout, reward and advantage fields (``group_size`` K, ``prompts_per_iteration`` P,
    ``num_inference_steps`` T, ``noise_level`` a > 0, ``rewards``, ``advantage``): see
    ``GenerationRewardArguments``.
    """

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    timestep_fraction: float = 1.0
    """Train the first ``int(fraction·T)`` steps of each trajectory, as flow_grpo does
    (``num_train_timesteps = int(num_steps * timestep_fraction)`` in ``scripts/train_sd3.py``): its
    0.99 × 10 trains 9 steps, leaving out the final step to σ = 0. Must train at least one step."""
    gradient_steps_per_iteration: int = 1
    """Optimizer steps per rollout iteration (minibatches of the shuffled samples)."""
    microbatch_size: int = 0
    """Samples per forward inside a minibatch; 0 = the whole minibatch at once."""
    clip_range: float = 1e-4
    """ε of the PPO clip on the ratio."""
    adv_clip_max: float = 5.0
    """A_max: advantages are clipped to [−A_max, A_max]."""
    kl_beta: float = 0.0
    """β: weight of the KL to the frozen reference; 0 = no reference snapshot."""
    kl_std: Literal["step_std", "std_dev_t"] = "step_std"
    """KL denominator: the exact transition std σ_t√(−Δt), or flow_grpo's σ_t (omits Δt, its issue #78)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.noise_level > 0,
            "noise_level",
            f"must be > 0 (the SDE needs noise for log-probs), got {self.noise_level}",
        )
        require(
            0 < self.timestep_fraction <= 1,
            "timestep_fraction",
            f"must be in (0, 1], got {self.timestep_fraction}",
        )
        require(
            trained_steps(self.timestep_fraction, self.num_inference_steps) >= 1,
            "timestep_fraction",
            f"int({self.timestep_fraction} × num_inference_steps {self.num_inference_steps}) trains no step",
        )
        require(self.clip_range > 0, "clip_range", f"must be > 0, got {self.clip_range}")
        require(self.adv_clip_max > 0, "adv_clip_max", f"must be > 0, got {self.adv_clip_max}")
        require(self.kl_beta >= 0, "kl_beta", f"must be >= 0, got {self.kl_beta}")
        batch = self.group_size * self.prompts_per_iteration
        steps = self.gradient_steps_per_iteration
        require(
            steps >= 1 and batch % steps == 0,
            "gradient_steps_per_iteration",
            f"must divide the {batch} samples of an iteration, got {steps}",
        )
        minibatch = batch // steps
        require(
            self.microbatch_size >= 0
            and (self.microbatch_size == 0 or minibatch % self.microbatch_size == 0),
            "microbatch_size",
            f"must be 0 or divide the minibatch of {minibatch} samples, got {self.microbatch_size}",
        )


@dataclass(frozen=True)
class GRPOSamples:
    """One rollout iteration. B = P·K samples, T steps."""

    prompts: list[str]  # [B]
    group_ids: torch.Tensor  # [B], sample i is in group i // K
    condition: Condition  # [B, ...]
    trajectory: Trajectory  # latents [B, T + 1, C, H, W], log_probs [B, T]
    advantages: torch.Tensor  # [B] fp32


def gather_samples(samples: GRPOSamples, backend: Backend) -> GRPOSamples:
    """Every rank's samples, in rank order (= global sample order): each rank then trains on its share
    of every global minibatch of the iteration's one shuffle, whatever the rank layout."""
    if backend.world_size == 1:
        return samples
    rows, trajectory = backend.gather_rows, samples.trajectory
    velocities = trajectory.velocities
    return GRPOSamples(
        backend.gather_objects(samples.prompts),
        rows(samples.group_ids),
        Condition(rows(samples.condition.prompt_embeds), rows(samples.condition.pooled)),
        Trajectory(
            rows(trajectory.latents),
            rows(trajectory.log_probs) if trajectory.log_probs is not None else None,
            trajectory.sigmas,
            rows(velocities) if velocities is not None else None,
        ),
        rows(samples.advantages),
    )


@register_trainer("grpo", arguments=GRPOArguments)
class GRPOTrainer(BaseTrainer):
    """Flow-GRPO (module docstring)."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    roles: ClassVar[tuple[str, ...]] = ("policy",)
    takes_inputs: ClassVar[bool] = True
    uses_rollout_velocities: ClassVar[bool] = False
    """Subclasses that compare against the rollout policy's velocities (GRPO-Guard, DPPO) set this:
    ``sample`` then checks the adapter recorded them and taps them as ``rollout.velocity``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.feedback = RewardFeedback(self.args)

    def setup_roles(self) -> dict[str, str]:
        """The ``policy`` variant, and the frozen ``reference`` snapshot when ``kl_beta > 0``.

        Returns:
            ``{role: variant name}``.
        """
        self.variants.declare_variant("policy")
        if self.args.kl_beta > 0:
            self.variants.add_snapshot("reference", "policy")
        return {"policy": "policy"}

    # ---------------------------------------------------------------- acquisition + feedback
    def sample(self) -> GRPOSamples:
        """Steps 1-3 of the module docstring: prompts, Flow-SDE rollout, rewards and advantages.

        Returns:
            The ``GRPOSamples`` of this iteration.
        """
        args = self.args
        # 1. P prompts, each repeated K times in contiguous groups (or the target's: --inputs-from)
        prompts = self.rollout_prompts(args.prompts_per_iteration, args.group_size)
        first_group = self.backend.rank * args.prompts_per_iteration  # global group ids
        repeated, group_ids = repeat_groups(prompts, args.group_size, first_group)
        condition = self.conditions.get(repeated)
        # 2. Flow-SDE rollout from the current policy (no grad), log-probs in fp32; each sample's noise
        # from its own generator (seed, rollout_iteration, global sample index)
        trajectory = self.adapter.inference(
            condition,
            num_steps=args.num_inference_steps,
            noise_level=args.noise_level,
            generator=self.sample_generators("rollout", self.rollout_iteration, count=len(repeated)),
            module=self.variants.variant("policy"),
            given=self.rollout_given(args.num_inference_steps, args.noise_level),
        )
        tap_rollout_inputs(self.adapter, repeated, trajectory, num_steps_field="train.num_inference_steps")
        ffdebug.tap("rollout.latents", trajectory.latents)
        ffdebug.tap("rollout.log_prob", trajectory.log_probs)
        # 3. rewards on the decoded images, then group-relative advantages
        images = self.adapter.decode_latents(trajectory.final)
        advantages, self.cycle_metrics = self.feedback(images, repeated, group_ids)
        samples = gather_samples(
            GRPOSamples(repeated, group_ids, condition, trajectory, advantages), self.backend
        )
        if self.uses_rollout_velocities:
            ffdebug.tap("rollout.velocity", self.rollout_velocities(samples))
        return samples

    # ---------------------------------------------------------------- optimisation
    def optimize(self, samples: GRPOSamples) -> None:
        """Step 4 of the module docstring: one optimizer step per minibatch of the shuffled samples.

        Args:
            samples: what ``sample`` returned.
        """
        args = self.args
        batch = len(samples.prompts)
        steps = trained_steps(args.timestep_fraction, args.num_inference_steps)
        with ffdebug.step(**self.step_tags("train")):  # the sample order is an input (train.order)
            order = self.sample_order(
                torch.randperm(batch, generator=self.generator("shuffle", self.rollout_iteration))
            )
        for minibatch in self.cycle_steps(order.chunk(args.gradient_steps_per_iteration)):
            minibatch = self.backend.local_part(minibatch)  # this rank's share of the global minibatch
            micro_size = args.microbatch_size or len(minibatch)
            microbatches = minibatch.split(micro_size)
            terms = len(microbatches) * steps
            with ffdebug.step(**self.step_tags("train")), self.optim.phase("policy") as phase:
                for index in microbatches:
                    for j in range(steps):
                        with ffdebug.step(timestep=j, microbatch=phase.backward_calls):
                            loss, metrics = self.step_loss(samples, index, j)
                        metrics.pop("loss", None)  # the step's loss is logged by the base
                        scale = loss_scale(samples.advantages[index], metrics, args)
                        phase.backward(loss / terms, metrics, scale=scale / terms)

    def step_loss(
        self, samples: GRPOSamples, index: torch.Tensor, j: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The GRPO loss of samples ``index`` at denoising step j (see the module docstring, step 4).

        Args:
            samples: this iteration's samples.
            index: the samples of the microbatch, [b].
            j: the denoising step.

        Returns:
            The loss and its metrics (``losses.grpo.grpo_loss``).
        """
        args = self.args
        _, step, sde_args = self.policy_step(samples, index, j)
        ref_mean = self.reference_mean(samples, index, j, sde_args) if args.kl_beta > 0 else None
        old_log_prob = samples.trajectory.log_probs[index, j]
        ffdebug.tap("train.log_prob", step.log_prob)
        ffdebug.tap("train.ratio", torch.exp(step.log_prob.detach() - old_log_prob))
        loss, metrics = grpo_losses.grpo_loss(
            step.log_prob,
            old_log_prob,
            samples.advantages[index],
            clip_range=args.clip_range,
            adv_clip_max=args.adv_clip_max,
            kl_beta=args.kl_beta,
            mean=step.mean,
            ref_mean=ref_mean,
            kl_std=self.kl_std(step),
        )
        if "kl" in metrics:
            ffdebug.tap("train.kl", torch.tensor(metrics["kl"], dtype=torch.float32))
        return loss, metrics

    def policy_step(
        self, samples: GRPOSamples, index: torch.Tensor, j: int
    ) -> tuple[torch.Tensor, SDEStep, dict[str, Any]]:
        """The policy's Flow-SDE transition x_j -> x_{j+1} of samples ``index`` (b of them), with gradients.

        Returns the velocity v_θ(x_j, σ_j) [b, C, H, W], the ``SDEStep`` (log p_θ(x_{j+1} | x_j) [b] of the
        stored x_{j+1}, transition mean [b, C, H, W]) and the keyword arguments of ``flow_sde_step`` that
        reproduce this transition for another velocity (the reference's, or the rollout's).

        Args:
            samples: this iteration's samples.
            index: the samples, [b].
            j: the denoising step.

        Returns:
            ``(v, step, sde_args)`` as above.
        """
        trajectory = samples.trajectory
        sigmas = trajectory.sigmas
        x_j = trajectory.latents[index, j]  # [b, C, H, W]
        sigma = sigmas[j].expand(len(index))
        sde_args: dict[str, Any] = dict(
            x=x_j,
            sigma=sigma,
            sigma_next=sigmas[j + 1].expand(len(index)),
            noise_level=self.args.noise_level,
            sigma_max=float(sigmas[1]),
            prev_sample=trajectory.latents[index, j + 1],
        )
        v = self.adapter.forward(
            x_j, sigma, samples.condition.select(index), module=self.variants.variant("policy")
        )
        return v, flow_sde_step(v, **sde_args), sde_args

    def rollout_step(
        self, samples: GRPOSamples, index: torch.Tensor, j: int, sde_args: dict[str, Any]
    ) -> tuple[torch.Tensor, SDEStep]:
        """The rollout policy's velocity v_old [b, C, H, W] at step j (stored by the sampler) and its
        transition (mean μ_old; log-prob = the stored log p_old), recomputed elementwise, no graph.

        GRPO itself needs only the stored log-probs; GRPO-Guard and DPPO compare μ_θ / v_θ against these.

        Args:
            samples: this iteration's samples (with the rollout velocities).
            index: the samples, [b].
            j: the denoising step.
            sde_args: the ``flow_sde_step`` arguments from ``policy_step``.

        Returns:
            ``(v_old, step_old)``.
        """
        v_old = self.rollout_velocities(samples)[index, j]
        with torch.no_grad():
            return v_old, flow_sde_step(v_old, **sde_args)

    def rollout_velocities(self, samples: GRPOSamples) -> torch.Tensor:
        """The rollout policy's velocities [B, T, C, H, W] (an error when the adapter recorded none).

        Args:
            samples: this iteration's samples.

        Returns:
            The velocities.
        """
        velocities = samples.trajectory.velocities
        if velocities is None:
            raise RuntimeError(
                f"{type(self).__name__} needs the rollout velocities; the adapter recorded none"
            )
        return velocities

    def reference_mean(
        self, samples: GRPOSamples, index: torch.Tensor, j: int, sde_args: dict[str, Any]
    ) -> torch.Tensor:
        """The frozen reference's transition mean [b, C, H, W] at step j, under ``no_grad``: the KL keeps
        the policy's graph through its own mean only (Flow-Factory issues #122-#124).

        Args:
            samples: this iteration's samples.
            index: the samples, [b].
            j: the denoising step.
            sde_args: the ``flow_sde_step`` arguments from ``policy_step``.

        Returns:
            μ_ref, [b, C, H, W] fp32.
        """
        with torch.no_grad():
            v_ref = self.adapter.forward(
                sde_args["x"],
                sde_args["sigma"],
                samples.condition.select(index),
                parameters=self.variants.snapshot("reference"),
            )
            return flow_sde_step(v_ref, **sde_args).mean

    def kl_std(self, step: SDEStep) -> torch.Tensor:
        """The KL's denominator (``kl_std``): the transition std σ_t·√(−Δt), or flow_grpo's σ_t.

        Args:
            step: the policy's ``SDEStep``.

        Returns:
            The std, broadcastable to the mean.
        """
        return step.step_std if self.args.kl_std == "step_std" else step.std_dev_t
