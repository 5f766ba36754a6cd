"""DiffusionNFT: online RL on the forward process with implicit positive / negative velocities.

Paper: Zheng et al. 2025, "DiffusionNFT: Online Diffusion Reinforcement with Forward Process", arXiv
2509.16117. Canonical code: NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py`` (read in the fork
pkuhxy/DiffusionNFT @ 619456aa: the "old" LoRA adapter samples, lines 643-662; the training loop,
lines 856-973; the old-adapter update after each epoch, lines 1037-1042). The maths is in
``reference_trainer.losses.nft``; the loop is ``trainers.decoupled``'s.

One rollout iteration: ODE rollouts (``noise_level`` 0, NVlabs ``sample.deterministic``) from the
``old`` snapshot; rewards and advantages; per minibatch one optimizer step over the trained σ_j:
v_θ (with gradient), v_old (``old``, no grad), v_ref (``reference``, only with ``kl_beta > 0``) at the
same x_t, then ``losses.nft.nft_loss``. After each optimizer step the ``ema`` snapshot is updated
(θ_ema ← d·θ_ema + (1 − d)·θ, constant ``ema_decay``; NVlabs keeps an EMA for evaluation); after the
iteration's steps the ``old`` snapshot: θ_old ← δ·θ_old + (1 − δ)·θ, δ = ``losses.nft.old_decay`` of
the optimizer step (NVlabs ``return_decay``), so resume is exact.

Roles: ``policy`` (trainable); snapshots ``old`` (sampling policy and v_old), ``ema`` (when
``ema_decay > 0``), ``reference`` (frozen initial policy, when ``kl_beta > 0``). Full finetuning stands
in for NVlabs' LoRA adapters (its reference is the base with the adapter disabled = the initial policy).
Taps: ``rollout.latents``, ``reward``, ``advantage``, ``train.x_t``, ``train.velocity``,
``train.velocity_old``, ``loss.policy``, ``grad_norm.policy``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

import ffdebug
from reference_trainer.contracts import GENERATION_REWARD, ExecutionContract
from reference_trainer.errors import require
from reference_trainer.losses import nft as nft_losses
from reference_trainer.registry import register_trainer
from reference_trainer.trainers.decoupled import DecoupledArguments, DecoupledSamples, DecoupledTrainer


@dataclass(frozen=True, kw_only=True)
class NFTArguments(DecoupledArguments):
    """``train:`` section of a DiffusionNFT run (defaults: NVlabs ``config/nft.py`` where it has one).

    Shared fields (rollout, rewards, ``timestep_fraction``, ``adv_clip_max``, ``kl_beta``): see
    ``DecoupledArguments``.
    """

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    TIMESTEP_SAMPLINGS: ClassVar[tuple[str, ...]] = ("shuffle", "fixed")
    timestep_sampling: Literal["shuffle", "fixed"] = "shuffle"
    """``shuffle``: per sample a random permutation of the T steps, its first int(T·f) (the original's
    ``perms_time``); ``fixed``: j < int(T·f) for every sample."""
    timestep_fraction: float = 0.99
    """f of int(T·f) (the original's ``train.timestep_fraction`` 0.99)."""
    nft_beta: float = 1.0
    """β: the mixing of v_θ into the implicit velocities (NVlabs ``config.beta``, 1.0 or 0.1)."""
    old_decay_flat: int = 0
    """Steps before the old snapshot starts to lag (NVlabs ``return_decay`` ``flat``; type 1: 0)."""
    old_decay_rate: float = 0.001
    """Decay growth per step after ``old_decay_flat`` (``uprate``; type 1: 0.001)."""
    old_decay_max: float = 0.5
    """Decay ceiling (``uphold``; type 1: 0.5)."""
    ema_decay: float = 0.9
    """Constant decay of the ``ema`` snapshot per optimizer step; 0 = no EMA snapshot."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.nft_beta > 0, "nft_beta", f"must be > 0, got {self.nft_beta}")
        require(self.old_decay_flat >= 0, "old_decay_flat", f"must be >= 0, got {self.old_decay_flat}")
        require(self.old_decay_rate >= 0, "old_decay_rate", f"must be >= 0, got {self.old_decay_rate}")
        require(0 <= self.old_decay_max < 1, "old_decay_max", f"must be in [0, 1), got {self.old_decay_max}")
        require(0 <= self.ema_decay < 1, "ema_decay", f"must be in [0, 1), got {self.ema_decay}")


@register_trainer("nft", arguments=NFTArguments)
class NFTTrainer(DecoupledTrainer):
    """DiffusionNFT (module docstring)."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    roles: ClassVar[tuple[str, ...]] = ("policy",)
    noise_name: ClassVar[str] = "nft"

    def setup_roles(self) -> dict[str, str]:
        """The ``policy`` variant; the ``old``, ``ema`` and (``kl_beta > 0``) ``reference`` snapshots."""
        self.variants.declare_variant("policy")
        self.variants.add_snapshot("old", "policy")
        if self.args.ema_decay > 0:
            self.variants.add_snapshot("ema", "policy")
        if self.args.kl_beta > 0:
            self.variants.add_snapshot("reference", "policy")
        return {"policy": "policy"}

    def sampling_parameters(self) -> Mapping[str, torch.Tensor]:
        """NVlabs samples with the ``old`` adapter."""
        return self.variants.snapshot("old")

    def term_loss(
        self, samples: DecoupledSamples, index: torch.Tensor, js: tuple[int, ...], minibatch: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """``losses.nft.nft_loss`` of samples ``index`` at σ_j, ``js = (j,)`` (module docstring)."""
        args = self.args
        (j,) = js
        x0, _, sigma, x_t = self.noised(samples, index, j, minibatch)
        condition = samples.condition.select(index)
        v_old = self.velocity(x_t, sigma, condition, snapshot="old")
        v = self.velocity(x_t, sigma, condition)
        ffdebug.tap("train.velocity", v)
        ffdebug.tap("train.velocity_old", v_old)
        v_ref = self.velocity(x_t, sigma, condition, snapshot="reference") if args.kl_beta > 0 else None
        return nft_losses.nft_loss(
            v,
            v_old,
            x_t,
            x0,
            sigma,
            samples.advantages[index],
            beta=args.nft_beta,
            adv_clip_max=args.adv_clip_max,
            kl_beta=args.kl_beta,
            ref_velocity=v_ref,
        )

    def after_step(self) -> None:
        """The ``ema`` snapshot follows the policy after every optimizer step."""
        if self.args.ema_decay > 0:
            self.variants.update_snapshot("ema", "policy", self.args.ema_decay)

    def after_cycle(self) -> None:
        """θ_old ← δ·θ_old + (1 − δ)·θ with δ = old_decay(optimizer step) (NVlabs, after each epoch)."""
        args = self.args
        decay = nft_losses.old_decay(
            self.optimizer_step, args.old_decay_flat, args.old_decay_rate, args.old_decay_max
        )
        self.variants.update_snapshot("old", "policy", decay)
