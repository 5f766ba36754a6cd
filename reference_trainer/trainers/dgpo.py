"""DGPO: direct group preference optimisation on the forward process, whole groups per minibatch.

Paper: Luo et al. 2025, "Reinforcing Diffusion Models by Direct Group Preference Optimization", arXiv
2510.08425. Canonical code: Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py`` @ 01ceb4b8 (shared noise per
group, ``generate_shared_noise_for_groups`` lines 77-107; rollouts from ``ema_ref`` once
``global_step > switch_ema_ref``, lines 799-879; the training step, lines 1100-1177, with ``ema_ref``
updated after every optimizer step at decay min(0.3, 0.001·global_step)). The maths is in
``reference_trainer.losses.dgpo``; the loop is ``trainers.decoupled``'s with two changes:

* minibatches are whole groups: the iteration's *groups* are shuffled and each minibatch takes
  (global groups / ``gradient_steps_per_iteration``) of them; its samples are then split equally over
  the ranks, so a group may span ranks;
* ε is shared by the members of a group: its generator is keyed by the global group id, not the sample.

Rollouts are classifier-free guided at ``rollout_guidance_scale`` (the original's 4.5). Per trained σ_j:
v_θ (gradient), v_ref (frozen ``reference``, guided at ``kl_cfg`` when > 1, as the original's
``ref_old_v``; or ``ema_ref`` with ``use_ema_ref``), and
``ema_ref``'s v_old for the DSM clip (``clip_dsm``). The group logit s_G needs every member's
Â·(d − d_ref): each rank's per-sample terms are gathered (``Backend.gather_rows``, the canonical script's
all-reduce of per-group sums), so two ranks compute the one-rank s_G.

Roles: ``policy`` (trainable); snapshots ``reference`` (frozen initial policy) and ``ema_ref`` (the fast
EMA). Taps: ``rollout.latents``, ``reward``, ``advantage``, ``train.x_t``, ``train.dsm``,
``train.dsm_ref``, ``train.group_logit``, ``loss.policy``, ``grad_norm.policy``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

import ffdebug
from reference_trainer.contracts import GENERATION_REWARD, ExecutionContract
from reference_trainer.errors import require
from reference_trainer.losses import dgpo as dgpo_losses
from reference_trainer.registry import register_trainer
from reference_trainer.trainers.decoupled import DecoupledArguments, DecoupledSamples, DecoupledTrainer


@dataclass(frozen=True, kw_only=True)
class DGPOArguments(DecoupledArguments):
    """``train:`` section of a DGPO run (defaults: the canonical ``config/dgpo.py``).

    Shared fields: see ``DecoupledArguments``. ``gradient_steps_per_iteration`` must divide the number
    of global groups (checked when the iteration is split).
    """

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    TIMESTEP_SAMPLINGS: ClassVar[tuple[str, ...]] = ("subset", "fixed")
    timestep_sampling: Literal["subset", "fixed"] = "subset"
    """``subset``: M = ``num_train_timesteps`` of the steps 0 .. ``trunc_steps``, drawn without replacement
    once per iteration and shared by every minibatch and rank (the original's
    ``generate_shared_sampled_timesteps``); ``fixed``: j < int(T·f)."""
    num_train_timesteps: int | None = 4
    """M (the original's ``num_train_timesteps`` 4)."""
    rollout_guidance_scale: float = 4.5
    """CFG of the rollouts (the original's ``sample.guidance_scale`` 4.5 in ``config/dgpo.py``)."""
    kl_cfg: float = 1.0
    """CFG of the frozen reference's velocity, used for d_ref and the KL (the original's ``kl_cfg``: 1 in
    ``config/dgpo.py``, 4.5 in its ``dgpo_wocfg.py``, where the rollouts are unguided); ≤ 1: none."""
    beta_dpo: float = 100.0
    """β_dpo of the group logit (canonical ``train.beta_dpo`` 100)."""
    clip_dsm: bool = True
    """Detach the DSM error of samples whose ratio to ``ema_ref`` left the clip range."""
    clip_range: float = 5e-2
    """ε of the DSM clip (canonical ``clip_range`` 5e-2)."""
    use_ema_ref: bool = False
    """d_ref from ``ema_ref`` instead of the frozen reference (canonical ``use_ema_ref``, TDM-R1)."""
    switch_ema_ref: int = 200
    """Roll out from ``ema_ref`` once the optimizer step exceeds this (canonical ``switch_ema_ref``)."""
    ema_ref_decay_max: float = 0.3
    """``ema_ref`` decay = min(this, ``ema_ref_decay_rate``·step) (canonical 0.3)."""
    ema_ref_decay_rate: float = 1e-3
    """See ``ema_ref_decay_max`` (canonical 0.001)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.beta_dpo > 0, "beta_dpo", f"must be > 0, got {self.beta_dpo}")
        require(self.kl_cfg >= 1.0, "kl_cfg", f"must be >= 1 (1: no guidance), got {self.kl_cfg}")
        require(self.clip_range > 0, "clip_range", f"must be > 0, got {self.clip_range}")
        require(self.switch_ema_ref >= 0, "switch_ema_ref", f"must be >= 0, got {self.switch_ema_ref}")
        require(
            0 <= self.ema_ref_decay_max < 1,
            "ema_ref_decay_max",
            f"must be in [0, 1), got {self.ema_ref_decay_max}",
        )
        require(
            self.ema_ref_decay_rate >= 0, "ema_ref_decay_rate", f"must be >= 0, got {self.ema_ref_decay_rate}"
        )


@register_trainer("dgpo", arguments=DGPOArguments)
class DGPOTrainer(DecoupledTrainer):
    """DGPO (module docstring)."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    roles: ClassVar[tuple[str, ...]] = ("policy",)
    noise_name: ClassVar[str] = "dgpo"

    def setup_roles(self) -> dict[str, str]:
        """The ``policy`` variant; the ``reference`` and ``ema_ref`` snapshots."""
        self.variants.declare_variant("policy")
        self.variants.add_snapshot("reference", "policy")
        self.variants.add_snapshot("ema_ref", "policy")
        return {"policy": "policy"}

    def sampling_parameters(self) -> Mapping[str, torch.Tensor] | None:
        """``ema_ref`` once the optimizer step exceeds ``switch_ema_ref``, else the live policy."""
        if self.optimizer_step > self.args.switch_ema_ref:
            return self.variants.snapshot("ema_ref")
        return None

    def minibatch_order(self, samples: DecoupledSamples) -> torch.Tensor:
        """Shuffled whole groups, members in order: [B] sample indices, ``steps`` equal chunks of groups."""
        groups = list(dict.fromkeys(samples.group_ids.tolist()))
        steps = self.args.gradient_steps_per_iteration
        if len(groups) % steps:
            raise ValueError(
                f"train.gradient_steps_per_iteration={steps} must divide the {len(groups)} global groups "
                "(DGPO minibatches hold whole groups)"
            )
        order = torch.randperm(len(groups), generator=self.generator("shuffle", self.rollout_iteration))
        return torch.cat([(samples.group_ids == groups[int(g)]).nonzero().flatten() for g in order])

    def noise_keys(self, samples: DecoupledSamples, index: torch.Tensor) -> list[int]:
        """ε shared within a group: keyed by the global group id."""
        return [int(g) for g in samples.group_ids[index]]

    def term_loss(
        self, samples: DecoupledSamples, index: torch.Tensor, js: tuple[int, ...], minibatch: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``losses.dgpo.dgpo_loss`` of samples ``index`` at σ_j, ``js = (j,)`` (module docstring)."""
        args = self.args
        (j,) = js
        x0, noise, sigma, x_t = self.noised(samples, index, j, minibatch)
        condition = samples.condition.select(index)
        target = noise - x0
        v = self.velocity(x_t, sigma, condition)
        with torch.no_grad():  # ``ref_old_v``: guided at ``kl_cfg`` when > 1 (``guided_forward``)
            v_ref = self.adapter.guided_forward(
                x_t,
                sigma,
                condition,
                guidance_scale=args.kl_cfg,
                parameters=self.variants.snapshot("reference"),
            )
        v_old = None
        if args.clip_dsm or args.use_ema_ref:
            v_old = self.velocity(x_t, sigma, condition, snapshot="ema_ref")
        dsm = dgpo_losses.dsm_error(v, target)
        dsm_ref = dgpo_losses.dsm_error(v_old if args.use_ema_ref else v_ref, target)
        advantages = samples.advantages[index].clamp(-args.adv_clip_max, args.adv_clip_max)
        metrics: dict[str, float] = {}
        if args.clip_dsm:
            dsm, clipped = dgpo_losses.dsm_clip(
                dsm, dgpo_losses.dsm_error(v_old, target), advantages, args.clip_range
            )
            metrics["clip_frac"] = clipped.float().mean().item()
        ffdebug.tap("train.dsm", dsm)
        ffdebug.tap("train.dsm_ref", dsm_ref)
        # s_G over the whole group: gather every rank's terms (rank order = the minibatch's global order)
        group_ids = self.backend.gather_rows(samples.group_ids[index])
        delta = self.backend.gather_rows((dsm - dsm_ref).detach())
        adv_all = self.backend.gather_rows(advantages)
        dense = torch.unique(group_ids, return_inverse=True)[1]
        logits = dgpo_losses.group_logits(
            delta, adv_all, dense, beta_dpo=args.beta_dpo, group_size=args.group_size
        )
        local = dense.tensor_split(self.backend.world_size)[self.backend.rank]
        logit = logits[local]
        ffdebug.tap("train.group_logit", logit)
        loss, loss_metrics = dgpo_losses.dgpo_loss(
            dsm, advantages, logit, kl_beta=args.kl_beta, velocity=v, ref_velocity=v_ref
        )
        return loss, {**metrics, **loss_metrics}

    def after_step(self) -> None:
        """``ema_ref`` ← d·ema_ref + (1 − d)·θ, d = min(max, rate·(step − 1)) (the canonical global_step
        before its increment)."""
        args = self.args
        decay = min(args.ema_ref_decay_max, args.ema_ref_decay_rate * (self.optimizer_step - 1))
        self.variants.update_snapshot("ema_ref", "policy", decay)
