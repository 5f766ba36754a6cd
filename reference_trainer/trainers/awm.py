"""AWM: advantage-weighted matching, PPO on a weighted flow-matching "log-prob" of finished rollouts.

Paper: Xue et al. 2025, "Advantage Weighted Matching: Aligning RL with Pretraining in Diffusion Models",
arXiv 2509.25050. Canonical code: scxue/advantage_weighted_matching
``advantage_weighted_matching/scripts/train_sd3_awm.py`` @ be513723 (old log-probs on the same
(t, ε) before training, lines 1230-1240; the training step, lines 1242-1354). The maths is in
``reference_trainer.losses.awm``; the loop is ``trainers.decoupled``'s.

One rollout iteration: rollouts (ODE by default) from the policy, or from the ``ema`` snapshot with
``off_policy`` (the canonical ``train.off_policy``); rewards and advantages; per minibatch one optimizer
step, all trained σ_j in one forward (as the canonical script batches its ``train_timesteps``), each with
its own ε: ℓ_θ [S, b] (with gradient), ℓ_old [S, b] from the sampling policy at the same (σ, ε) (no
grad), then ``losses.awm.awm_loss``. The sampling policy is the ``old`` snapshot, a copy of the policy
taken when the iteration rolls out (the canonical on-policy script takes ℓ_old from the policy before its
first update), or ``ema`` with ``off_policy``. Once per rollout iteration (the original: per epoch)
``ema`` ← d·ema + (1 − d)·θ, d = min(0.3, 0.001·step). The trained σ: ``timestep_sampling``
(``reference_trainer.timesteps``; the original's stratified ``discrete`` draw by default).

Roles: ``policy`` (trainable); snapshots ``old`` (on-policy), ``ema`` (with ``off_policy`` or
``ema_kl_beta > 0``), ``reference`` (frozen initial policy, ``kl_beta > 0``). Taps: ``rollout.latents``,
``reward``, ``advantage``, ``train.x_t``, ``train.log_prob``, ``train.log_prob_old``, ``train.ratio``,
``loss.policy``, ``grad_norm.policy``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

import ffdebug
from reference_trainer.adapters.base import Condition
from reference_trainer.contracts import GENERATION_REWARD, ExecutionContract
from reference_trainer.errors import require
from reference_trainer.losses import awm as awm_losses
from reference_trainer.registry import register_trainer
from reference_trainer.trainers.decoupled import DecoupledArguments, DecoupledSamples, DecoupledTrainer


@dataclass(frozen=True, kw_only=True)
class AWMArguments(DecoupledArguments):
    """``train:`` section of an AWM run (defaults: the canonical ``config/base_awm.py`` where it has one).

    Shared fields: see ``DecoupledArguments``.
    """

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    TIMESTEP_SAMPLINGS: ClassVar[tuple[str, ...]] = ("discrete", "discrete_wo_init", "logit_normal", "fixed")
    timestep_sampling: Literal["discrete", "discrete_wo_init", "logit_normal", "fixed"] = "discrete"
    """The original's ``time_type``: ``discrete`` one index drawn in each of S strata of 0 .. int(T·f) − 1,
    ``discrete_wo_init`` the same from index 1, ``logit_normal`` S stratified logit-normal times shifted by
    ``time_shift``; each shared by the minibatch. ``fixed``: j < int(T·f)."""
    num_train_timesteps: int | None = 2
    """S, the strata (the original's ``train.train_timesteps``: 6 of int(14·0.9) = 12; here 2 of the
    default 4 steps)."""
    clip_range: float = 1e-4
    """ε of the PPO clip on the ratio (canonical ``train.clip_range`` 1e-4)."""
    weighting: Literal["uniform", "t", "t**2", "huber", "ghuber"] = "uniform"
    """The weighting of the log-prob (canonical ``train.weighting``)."""
    ghuber_power: float = 0.25
    """p of the ``ghuber`` weighting."""
    loss_type: Literal["sum_first", "exp_first"] = "sum_first"
    """Average ℓ over the trained σ before (``sum_first``) or after (``exp_first``) the exponential."""
    ema_kl_beta: float = 0.0
    """Weight of mean‖v_θ − v_ema‖² (canonical ``train.ema_beta``); 0 = none."""
    ema_decay: float = 0.3
    """d of the ``ema`` snapshot's update (the original's ``train.kl_ema_decay`` 0.3)."""
    ema_decay_type: Literal["linear", "constant"] = "linear"
    """``linear``: decay min(d, 0.001·optimizer step), ``constant``: d (the original's
    ``kl_ema_decay_type``, ``linear`` in its configs); either once per rollout iteration, after its
    last optimizer step (the original's once per epoch)."""
    advantage_max: float | None = None
    """Rescale the clipped advantages from ±``adv_clip_max`` to ±``advantage_max`` (the original's
    ``train.advantage_max``, 1 in its configs; None: no rescale)."""
    train_guidance_scale: float = 1.0
    """CFG of every velocity of the loss, the policy's, the old's, the EMA's and the reference's (the
    original's ``train.cfg``, at its ``sample.guidance_scale``; off in all its configs); 1: none. The
    unconditional rows are the empty prompt, paired with each conditional row."""
    kl_weight: Literal["uniform", "elbo"] = "uniform"
    """Weight of each term's KL row: ``uniform`` 1, ``elbo`` 1/(2·s²) with s² = 0.49·σ/(1 − min(σ, 0.99))
    (the original's ``kl_weight`` ``ELBO``, ``std_dev_t = torch.sqrt(sigma / (1 - torch.clamp(sigma, 0,
    0.99)))*0.7``); the same for the EMA KL (``kl_ema_weight``)."""
    off_policy: bool = False
    """Roll out from, and take ℓ_old of, the ``ema`` snapshot (canonical ``train.off_policy``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.clip_range > 0, "clip_range", f"must be > 0, got {self.clip_range}")
        require(
            self.weighting in awm_losses.WEIGHTINGS,
            "weighting",
            f"must be one of {awm_losses.WEIGHTINGS}, got {self.weighting!r}",
        )
        require(self.ghuber_power > 0, "ghuber_power", f"must be > 0, got {self.ghuber_power}")
        require(
            self.loss_type in ("sum_first", "exp_first"),
            "loss_type",
            f"must be 'sum_first' or 'exp_first', got {self.loss_type!r}",
        )
        require(self.ema_kl_beta >= 0, "ema_kl_beta", f"must be >= 0, got {self.ema_kl_beta}")
        require(0 <= self.ema_decay < 1, "ema_decay", f"must be in [0, 1), got {self.ema_decay}")
        require(
            self.train_guidance_scale >= 1.0,
            "train_guidance_scale",
            f"must be >= 1 (1: no guidance), got {self.train_guidance_scale}",
        )
        if self.advantage_max is not None:
            require(self.advantage_max > 0, "advantage_max", f"must be > 0, got {self.advantage_max}")


@register_trainer("awm", arguments=AWMArguments)
class AWMTrainer(DecoupledTrainer):
    """AWM (module docstring)."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    roles: ClassVar[tuple[str, ...]] = ("policy",)
    noise_name: ClassVar[str] = "awm"

    @property
    def _uses_ema(self) -> bool:
        return self.args.off_policy or self.args.ema_kl_beta > 0

    @property
    def _old_name(self) -> str:
        return "ema" if self.args.off_policy else "old"

    def setup_roles(self) -> dict[str, str]:
        """The ``policy`` variant; ``old`` (on-policy), ``ema`` and ``reference`` snapshots as needed."""
        self.variants.declare_variant("policy")
        if not self.args.off_policy:
            self.variants.add_snapshot("old", "policy")
        if self._uses_ema:
            self.variants.add_snapshot("ema", "policy")
        if self.args.kl_beta > 0:
            self.variants.add_snapshot("reference", "policy")
        return {"policy": "policy"}

    def sampling_parameters(self) -> Mapping[str, torch.Tensor] | None:
        """On-policy: freeze the rollout policy as ``old`` (ℓ_old), roll out from the live policy;
        ``off_policy``: roll out from ``ema``."""
        if self.args.off_policy:
            return self.variants.snapshot("ema")
        self.variants.update_snapshot("old", "policy", 0.0)
        return None

    def train_terms(self, steps: int) -> list[tuple[int, ...]]:
        """All trained σ_j in one term (the ratio of ``sum_first`` averages ℓ over them)."""
        return [tuple(range(steps))]

    def term_loss(
        self, samples: DecoupledSamples, index: torch.Tensor, js: tuple[int, ...], minibatch: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``losses.awm.awm_loss`` of samples ``index`` at every σ_j, j ∈ ``js`` (module docstring)."""
        args = self.args
        parts = [self.noised(samples, index, j, minibatch) for j in js]
        x0, noise, sigma, x_t = (torch.cat([p[k] for p in parts]) for k in range(4))  # [S·b, ...]
        condition = Condition.cat([samples.condition.select(index)] * len(js))
        shape = (len(js), len(index))

        def log_prob(v: torch.Tensor) -> torch.Tensor:
            return awm_losses.awm_log_prob(
                v, noise, x0, sigma, weighting=args.weighting, ghuber_power=args.ghuber_power
            ).view(shape)

        cfg = args.train_guidance_scale
        v = self.velocity(x_t, sigma, condition, guidance_scale=cfg)
        with torch.no_grad():
            old = log_prob(self.velocity(x_t, sigma, condition, snapshot=self._old_name, guidance_scale=cfg))
        current = log_prob(v)
        ffdebug.tap("train.log_prob", current)
        ffdebug.tap("train.log_prob_old", old)
        ffdebug.tap("train.ratio", torch.exp(current.detach() - old))
        v_ref = (
            self.velocity(x_t, sigma, condition, snapshot="reference", guidance_scale=cfg)
            if args.kl_beta > 0
            else None
        )
        v_ema = (
            self.velocity(x_t, sigma, condition, snapshot="ema", guidance_scale=cfg)
            if args.ema_kl_beta > 0
            else None
        )
        advantages, clip = samples.advantages[index], args.adv_clip_max
        if (
            args.advantage_max is not None
        ):  # clamp, then rescale: ``advantages / adv_clip_max * advantage_max``
            advantages = advantages.clamp(-clip, clip) / clip * args.advantage_max
            clip = max(clip, args.advantage_max)  # the loss's clamp: now a no-op
        kl_rows = awm_losses.elbo_kl_weight(sigma) if args.kl_weight == "elbo" else None
        return awm_losses.awm_loss(
            current,
            old,
            advantages,
            clip_range=args.clip_range,
            adv_clip_max=clip,
            kl_row_weight=kl_rows,
            loss_type=args.loss_type,
            velocity=v,
            kl_beta=args.kl_beta,
            ref_velocity=v_ref,
            ema_kl_beta=args.ema_kl_beta,
            ema_velocity=v_ema,
        )

    def after_cycle(self) -> None:
        """``ema`` follows the policy once per rollout iteration: ema ← d·ema + (1 − d)·θ with
        d = min(``ema_decay``, 0.001·optimizer step) (``linear``) or ``ema_decay`` (the original's
        ``decay = min(config.train.kl_ema_decay, 0.001 * global_step)`` at the end of each epoch)."""
        if self._uses_ema:
            args = self.args
            decay = args.ema_decay
            if args.ema_decay_type == "linear":
                decay = min(args.ema_decay, 0.001 * self.optimizer_step)
            self.variants.update_snapshot("ema", "policy", decay)
