"""TDM-R1: TDM plus a learned surrogate reward (generation + runtime reward, multi-role).

Paper: "TDM-R1: Reinforcing Few-Step Diffusion Models with Non-Differentiable Reward" (arXiv
2603.07700). ``train.variant`` selects one of two readings as a whole:

* ``authors`` (default): the authors' training script, Luo-Yihong/TDM-R1 @
  cc55d8975345e565b09d9c02c2800b69ca26fe90 ``scripts/train_tdmr1_pub.py`` (defaults of its
  ``config/tdmr1_clean.py``): ``reference_trainer.trainers.tdm_r1_authors``, losses
  ``reference_trainer.losses.tdm_r1``;
* ``flow_factory``: Flow-Factory's re-interpretation (X-GenGroup/Flow-Factory
  ``src/flow_factory/trainers/distillation/tdm_r1.py``, arguments and default optimizers in
  ``hparams/training_args/tdm_r1.py``), below; losses ``reference_trainer.losses.tdm_r1_flow_factory``.
  It differs from the authors in the surrogate's input (a forward-noised boundary x_t = (1 − σ)·x_b + σ·ε,
  σ and ε per sample, v* = ε − x_b), the reference penalty ((d_s − d_ref)² instead of the velocity
  MSE), the runaway clip (per sample instead of the batch's velocity MSE), the time weight ((b + 1)/K,
  b uniform), the fake score (TDM's importance- and SNR-weighted x̂_0 loss instead of velocity DSM +
  0.02·teacher pull), the generator's re-noise range, no ``trunc_steps`` gating, a guided KL teacher
  and a guidance reward only when ``real_guidance_scale`` > 1.

A subclass of ``TDMTrainer`` (``reference_trainer.trainers.tdm``).

Roles:
    generator       trainable variant (the base): TDM's K-step generator
    fake            trainable variant: TDM's fake score
    surrogate       trainable variant: the learned reward model (a score model; its DSM values are the
                    preference logits)
    teacher         frozen snapshot of the initial weights (the reference / real score)
    slow_surrogate  snapshot of the surrogate, moved after every surrogate step by an EMA with decay
                    min(``surrogate_slow_decay_max``, ``surrogate_slow_decay_min`` + 0.001·step)

Every random draw is keyed by the rollout iteration, the phase and the global sample or group index
(never the rank): a run's numbers do not depend on the rank layout.

One rollout iteration under ``flow_factory``, a three-phase cycle:

1. ``sample``: P prompts × K (``group_size``) generator trajectories; the final samples are decoded and
   scored, rewards → group-relative advantages (``feedback``), clipped to ±``advantage_clip_range``;
2. ``fake_updates_per_generator_update`` ``fake`` phases: TDM's fake-score loss;
3. one ``surrogate`` phase: per group one boundary b ∈ {1..K} of the trajectory, x_t = (1 − σ)·x_b + σ·ε
   with σ ~ U(σ_min, 1 − ``stage_margin``), v* = ε − x_b; the DSM values of surrogate, teacher and slow
   surrogate; the clipped group preference (loss module), time weight (b + 1)/K; then the slow update.
   Flow-Factory draws the query time with ``tdm_time_sampling.sample_query_timestep`` (uniform inside an
   interval by default); the interval it uses for the surrogate was not verified here, so σ is uniform
   over the whole range, and the boundary indexing of its ``_time_weight`` is read as b ∈ {1..K};
4. one ``generator`` phase: TDM's stage replay and re-noise; TDM term + ``tdm_weight``·guidance reward +
   (1 − ``tdm_weight``)·surrogate reward (the surrogate queried with the teacher's guidance scale).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal

import torch

import ffdebug
from reference_trainer.adapters.base import Condition
from reference_trainer.advantages import AdvantageConfig
from reference_trainer.config import RewardSpec, RolloutSize, require_unique_rewards
from reference_trainer.contracts import GENERATION_REWARD, ExecutionContract
from reference_trainer.data import repeat_groups
from reference_trainer.errors import require
from reference_trainer.feedback import RewardFeedback
from reference_trainer.flow_matching import predicted_x0, randn_rows
from reference_trainer.losses.dgpo import dsm_error
from reference_trainer.losses.tdm import conditional_renoise
from reference_trainer.losses.tdm_r1_flow_factory import generator_reward_loss, surrogate_loss
from reference_trainer.registry import register_trainer
from reference_trainer.trainers.tdm import StageDraw, TDMArguments, TDMRollout, TDMTrainer
from reference_trainer.trainers.tdm_r1_authors import AuthorsPhases


@dataclass(frozen=True, kw_only=True)
class TDMR1Arguments(TDMArguments):
    """``train:`` section of a TDM-R1 run (TDM's fields, plus the reward and the surrogate's).

    Fields read by one variant only (``VARIANT_FIELDS``) are refused at another value than their default
    under the other variant, naming the field."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    VARIANT_FIELDS: ClassVar[dict[str, tuple[str, ...]]] = {
        "authors": (
            "stages_per_iteration",
            "trunc_steps",
            "surrogate_sigma_min",
            "reward_sigma_min",
            "renoise_shift",
            "renoise_gap",
            "surrogate_guidance_scale",
            "time_weight",
        ),
        "flow_factory": (
            "fake_updates_per_generator_update",
            "sigma_min",
            "stage_margin",
            "snr_cap",
            "importance_clip",
        ),
    }
    variant: Literal["authors", "flow_factory"] = "authors"
    """Which reading of TDM-R1 (module docstring): the authors' script, or Flow-Factory's as a whole."""
    prompts_per_iteration: int = 2
    """P: distinct prompts per rollout iteration; B = P·K trajectories."""
    group_size: int = 4
    """K: trajectories per prompt, one advantage group."""
    rewards: tuple[RewardSpec, ...] = (RewardSpec(name="brightness"),)
    """Rewards of the decoded final samples."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """How rewards become advantages (group normalisation, aggregation, weights)."""
    advantage_clip_range: float = 5.0
    """A_max: advantages are clipped to ±A_max (Flow-Factory default 5)."""
    surrogate_preference_beta: float = 1.0
    """β of the group logit."""
    surrogate_clip_range: float = 1e-3
    """ε of the trust-region clip against the slow surrogate; 0 = off."""
    surrogate_reference_threshold: float = 0.05
    """τ of the runaway clip: ``authors``, the batch's velocity MSE R = mean (v_s − v_ref)² above it;
    ``flow_factory``, (d_s − d_ref)² per sample; in the advantage's direction, d_s is detached."""
    surrogate_reference_beta: float = 1e-3
    """β_ref of the anchor penalty: ``authors`` β·R, ``flow_factory`` β·mean (d_s − d_ref)²."""
    huber_c: float = 0.0
    """c of the generator's pseudo-Huber loss; 0 = squared error (both readings: ``use_huber`` false)."""
    real_guidance_scale: float = 4.5
    """CFG scale s of the teacher's x̂_0 (``authors``: the normaliser's anchor, the script's fixed
    ``cfg_scale=4.5``; ``flow_factory``: > 1 also adds its guidance reward)."""
    surrogate_slow_decay_min: float = 0.001
    """The slow surrogate's EMA decay at step 0 (it grows by 0.001 per optimizer step)."""
    surrogate_slow_decay_max: float = 0.3
    """Upper bound of that decay."""
    tdm_weight: float = 0.3
    """w: guidance reward w, surrogate reward 1 − w (in (0, 1))."""
    cfg_reward_scale: float = 3.5
    """c_r of the guidance (CFG) reward (``flow_factory``: used when ``real_guidance_scale`` > 1)."""
    # ------------------------------------------------------------ the authors' variant only
    stages_per_iteration: int = 2
    """M: generator stages j trained per rollout iteration, drawn without replacement from 0..K−1, the
    same on every rank (the authors' ``num_train_timesteps``)."""
    trunc_steps: int | None = None
    """Stages j < trunc_steps carry the reward terms, later ones the TDM term only (the authors'
    ``trunc_steps``); None: every stage."""
    surrogate_sigma_min: float = 0.3
    """Lower bound of the surrogate's training time σ_τ (the authors' ``t_min_dgpo_reward`` / 1000)."""
    reward_sigma_min: float = 0.3
    """Lower bound of the time σ_τ' the generator queries the surrogate at (``t_min_dgpo`` / 1000)."""
    renoise_shift: float = 3.0
    """s of the re-noise times' shift s(u) = s·u/(1 + (s − 1)·u) (``convert(..., s=3)``)."""
    renoise_gap: float = 0.02
    """Unshifted gap above the lower bound of every re-noise time (the authors' ``+ 20`` of 1000)."""
    surrogate_guidance_scale: float = 4.5
    """CFG scale of the surrogate when the generator queries it (the authors' ``rl_cfg``)."""
    time_weight: bool = True
    """Weight the surrogate loss by (j_s + 1)/K (the authors' ``use_tweight``)."""

    def rollout_size(self) -> RolloutSize:
        """P·K trajectories of K_steps + 1 boundaries."""
        return RolloutSize(
            (
                ("train.prompts_per_iteration", self.prompts_per_iteration),
                ("train.group_size", self.group_size),
            ),
            ("train.num_generator_steps", self.num_generator_steps),
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.group_size >= 2,
            "group_size",
            f"must be >= 2 (advantages are group-relative), got {self.group_size}",
        )
        require(len(self.rewards) >= 1, "rewards", "needs at least one reward")
        require_unique_rewards(self.rewards)
        names = [spec.name for spec in self.rewards]
        for name in self.advantage.weights:
            require(
                name in names, f"advantage.weights.{name}", f"is not a configured reward; rewards: {names}"
            )
        for name in ("advantage_clip_range", "surrogate_preference_beta", "surrogate_reference_threshold"):
            require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        for name in ("surrogate_clip_range", "surrogate_reference_beta", "cfg_reward_scale"):
            require(getattr(self, name) >= 0, name, f"must be >= 0, got {getattr(self, name)}")
        require(0.0 < self.tdm_weight < 1.0, "tdm_weight", f"must be in (0, 1), got {self.tdm_weight}")
        defaults = {f.name: f.default for f in fields(self)}
        for variant, names in self.VARIANT_FIELDS.items():
            if variant == self.variant:
                continue
            for name in names:
                require(
                    getattr(self, name) == defaults[name],
                    name,
                    f"is read by variant {variant} only; this run has variant {self.variant} "
                    f"(leave it at {defaults[name]!r} or set train.variant={variant})",
                )
        if self.variant == "authors":
            k = self.num_generator_steps
            require(
                1 <= self.stages_per_iteration <= k,
                "stages_per_iteration",
                f"must be in 1..num_generator_steps={k}, got {self.stages_per_iteration}",
            )
            if self.trunc_steps is not None:
                require(
                    self.stages_per_iteration <= self.trunc_steps <= k,
                    "trunc_steps",
                    f"must be in stages_per_iteration..num_generator_steps "
                    f"({self.stages_per_iteration}..{k}, the authors' assert), got {self.trunc_steps}",
                )
            for name in ("surrogate_sigma_min", "reward_sigma_min"):
                require(
                    0.0 <= getattr(self, name) < 1.0, name, f"must be in [0, 1), got {getattr(self, name)}"
                )
            require(self.renoise_shift > 0, "renoise_shift", f"must be > 0, got {self.renoise_shift}")
            require(
                0.0 <= self.renoise_gap < 1.0, "renoise_gap", f"must be in [0, 1), got {self.renoise_gap}"
            )
            require(
                self.surrogate_guidance_scale >= 1.0,
                "surrogate_guidance_scale",
                f"must be >= 1, got {self.surrogate_guidance_scale}",
            )
        require(
            0.0 <= self.surrogate_slow_decay_min <= self.surrogate_slow_decay_max <= 1.0,
            "surrogate_slow_decay_min",
            f"need 0 <= min <= max <= 1, got {self.surrogate_slow_decay_min}, {self.surrogate_slow_decay_max}",
        )


@dataclass(frozen=True)
class TDMR1Rollout(TDMRollout):
    """A TDM rollout of P·K trajectories with their group index [B] (dense, local), global group ids [B]
    and advantages [B]."""

    group_index: torch.Tensor
    group_ids: torch.Tensor
    advantages: torch.Tensor


@register_trainer("tdm_r1", arguments=TDMR1Arguments)
class TDMR1Trainer(AuthorsPhases, TDMTrainer):
    """TDM-R1 (module docstring)."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    roles: ClassVar[tuple[str, ...]] = ("generator", "fake", "surrogate")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.feedback = RewardFeedback(self.args)  # type: ignore[arg-type]

    def setup_roles(self) -> dict[str, str]:
        """TDM's roles, the ``surrogate`` variant and its ``slow_surrogate`` snapshot.

        Returns:
            ``{role: variant name}``.
        """
        roles = super().setup_roles()
        self.variants.declare_variant("surrogate")
        self.variants.add_snapshot("slow_surrogate", "surrogate")
        return {**roles, "surrogate": "surrogate"}

    def phase_roles(self) -> list[str]:
        """``flow_factory``: F ``fake``, one ``surrogate``, one ``generator`` optimizer step;
        ``authors``: ``AuthorsPhases.phase_roles``."""
        if self.args.variant == "authors":
            return AuthorsPhases.phase_roles(self)
        return ["fake"] * self.args.fake_updates_per_generator_update + ["surrogate", "generator"]

    @torch.no_grad()
    def sample(self) -> TDMR1Rollout:
        """P·K trajectories, their rewards and advantages (module docstring, step 1).

        Returns:
            The ``TDMR1Rollout``.
        """
        args: TDMR1Arguments = self.args  # type: ignore[assignment]
        prompts = self.rollout_prompts(args.prompts_per_iteration, args.group_size)
        repeated, group_ids = repeat_groups(prompts, args.group_size, self.backend.rank * len(prompts))
        condition = self.conditions.get(repeated)
        generators = self.sample_generators("tdm_r1", self.rollout_iteration, "z", count=len(repeated))
        z = self.rollout_noise(repeated, randn_rows((len(repeated), *self.adapter.latent_shape), generators))
        trajectory = self.generator_trajectory(z, condition)
        ffdebug.tap("rollout.latents", trajectory.latents)
        advantages, self.cycle_metrics = self.feedback(
            self.adapter.decode_latents(trajectory.final), repeated, group_ids
        )
        advantages = advantages.clamp(-args.advantage_clip_range, args.advantage_clip_range)
        group_index = group_ids - group_ids.min()
        return TDMR1Rollout(condition, trajectory, group_index, group_ids, advantages)

    def optimize(self, rollout: TDMR1Rollout) -> None:  # type: ignore[override]
        """One optimizer step of its role per phase, the slow update after the surrogate's (module doc).

        Args:
            rollout: what ``sample`` returned.
        """
        if self.args.variant == "authors":
            self.optimize_authors(rollout)
            return
        for index, role in self.cycle_steps(list(enumerate(self.phase_roles()))):
            with ffdebug.step(**self.step_tags("train", role=role)), self.optim.phase(role) as step:
                if role == "fake":
                    loss, metrics = self.fake_loss(self.draw_stage(rollout, index), rollout.condition)
                elif role == "surrogate":
                    loss, metrics = self.surrogate_phase_loss(rollout, index)
                else:
                    loss, metrics = self.generator_loss(self.draw_stage(rollout, index), rollout.condition)
                metrics.pop("loss")
                step.backward(loss, metrics)
            if role == "surrogate":
                self.variants.update_snapshot("slow_surrogate", "surrogate", self.slow_decay())

    def slow_decay(self) -> float:
        """min(max, min + 0.001·optimizer_step) (Flow-Factory ``_surrogate_phase``)."""
        args: TDMR1Arguments = self.args  # type: ignore[assignment]
        return min(args.surrogate_slow_decay_max, args.surrogate_slow_decay_min + 0.001 * self.optimizer_step)

    def surrogate_phase_loss(
        self, rollout: TDMR1Rollout, phase: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The surrogate's clipped group preference on noised boundary states (module docstring, step 3).

        Args:
            rollout: this iteration's trajectories and advantages.
            phase: the phase's index in the iteration.

        Returns:
            The loss and its metrics.
        """
        args: TDMR1Arguments = self.args  # type: ignore[assignment]
        latents = rollout.trajectory.latents
        count, steps = latents.shape[0], latents.shape[1] - 1
        groups = rollout.group_ids.tolist()
        per_group = {  # one boundary per group, keyed by the global group id
            group: int(
                torch.randint(
                    1,
                    steps + 1,
                    (1,),
                    generator=self.generator("tdm_r1", self.rollout_iteration, phase, "boundary", group),
                )
            )
            for group in dict.fromkeys(groups)
        }
        # the draws are inputs (docs/trainer-taps.md), each taken with --inputs-from
        boundary = self.drawn(
            "train.timestep_index",
            torch.tensor([per_group[group] for group in groups]),
            within=(1, steps + 1),
        )
        generators = self.sample_generators("tdm_r1", self.rollout_iteration, phase, "noise", count=count)
        sigma = torch.cat([torch.rand(1, generator=g) for g in generators])
        sigma = self.drawn("train.sigma", args.sigma_min + sigma * (1.0 - args.stage_margin - args.sigma_min))
        noise = self.drawn(
            "train.noise", torch.stack([torch.randn(latents.shape[2:], generator=g) for g in generators])
        )
        x_b = latents[torch.arange(count), boundary].float()
        s = sigma.reshape(-1, 1, 1, 1)
        x_t, target = (1.0 - s) * x_b + s * noise, noise - x_b
        ffdebug.tap("train.surrogate_x_t", x_t)
        condition = rollout.condition
        dsm = dsm_error(
            self.adapter.forward(x_t, sigma, condition, module=self.variants.variant("surrogate")), target
        )
        with torch.no_grad():
            teacher, slow = self.variants.snapshot("teacher"), self.variants.snapshot("slow_surrogate")
            ref_dsm = dsm_error(self.adapter.forward(x_t, sigma, condition, parameters=teacher), target)
            slow_dsm = dsm_error(self.adapter.forward(x_t, sigma, condition, parameters=slow), target)
        ffdebug.tap("train.surrogate_dsm", dsm)
        ffdebug.tap("train.reference_dsm", ref_dsm)
        return surrogate_loss(
            dsm,
            ref_dsm,
            slow_dsm,
            rollout.advantages,
            rollout.group_index,
            group_size=args.group_size,
            beta=args.surrogate_preference_beta,
            clip_range=args.surrogate_clip_range,
            runaway_threshold=args.surrogate_reference_threshold,
            reference_beta=args.surrogate_reference_beta,
            time_weight=(boundary.float() + 1.0) / steps,
        )

    def generator_loss(self, draw: StageDraw, condition: Condition) -> tuple[torch.Tensor, dict[str, float]]:
        """TDM term + guidance reward + surrogate reward (module docstring, step 4).

        Args:
            draw: the stage draws.
            condition: the conditions.

        Returns:
            The loss and its metrics.
        """
        args: TDMR1Arguments = self.args  # type: ignore[assignment]
        x0, eps_hat = self.generator_prediction(draw, condition)
        ffdebug.tap("train.x0", x0)
        scale = args.real_guidance_scale
        with torch.no_grad():
            x_t = conditional_renoise(
                x0.detach(), eps_hat.detach(), draw.sigma_mid, draw.sigma_t, draw.noise
            ).x_t
            x0_cond, x0_uncond = self.teacher_predictions(x_t, draw.sigma_t, condition)
            guidance = None
            x0_real = x0_cond
            if x0_uncond is not None:
                x0_real = x0_cond + (scale - 1.0) * (x0_cond - x0_uncond)
                if args.cfg_reward_scale > 0:
                    guidance = args.cfg_reward_scale * (x0_cond - x0_uncond)
            fake = self.adapter.forward(x_t, draw.sigma_t, condition, module=self.variants.variant("fake"))
            x0_fake = predicted_x0(x_t, fake, draw.sigma_t)
            v_sur = self.adapter.guided_forward(
                x_t, draw.sigma_t, condition, guidance_scale=scale, module=self.variants.variant("surrogate")
            )
            x0_surrogate = predicted_x0(x_t, v_sur, draw.sigma_t)
        ffdebug.tap("train.x_t", x_t)
        ffdebug.tap("train.x0_real", x0_real)
        ffdebug.tap("train.x0_fake", x0_fake)
        ffdebug.tap("train.x0_surrogate", x0_surrogate)
        return generator_reward_loss(
            x0,
            x0_real,
            x0_fake,
            x0_surrogate,
            tdm_weight=args.tdm_weight,
            guidance_direction=guidance,
            huber_c=args.huber_c if args.huber_c > 0 else None,
        )
