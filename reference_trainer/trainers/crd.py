"""CRD: centered reward distillation, implicit rewards vs an old snapshot matched to centred rewards.

Paper: "Diffusion Reinforcement Learning via Centered Reward Distillation", arXiv 2603.14128 (not read;
no public canonical code was found). Code followed: X-GenGroup/Flow-Factory
``src/flow_factory/trainers/crd.py`` @ 396dd6e2 (``CRDTrainer.start``: rollouts from the sampling
snapshot, then ``optimize``, then the old and sampling snapshot updates; ``optimize``: no shuffle, one
forward of the old snapshot and the CFG-guided reference per σ, the loss) and its arguments
``hparams/training_args/crd.py`` @ c5b89b17 (defaults). The maths is in ``reference_trainer.losses.crd``;
the loop is ``trainers.decoupled``'s with the samples in rollout order (Flow-Factory: "CRD does not
shuffle samples (needs same-prompt grouping for centering)").

Checked against Flow-Factory: the decay schedules (``compute_decay``, string form
"start_step-start_value-slope-end_value"; presets by name are not offered) applied after every iteration
at the optimizer step count; snapshots blended s ← d·s + (1 − d)·θ; the implicit reward against ``old``
(or the reference with ``use_old_for_loss`` false); advantages normalised to [0, 1] and gathered over
the ranks with r_θ; the three centring modes; the ``adv_clip_max / crd_beta`` scale; the KL to the
reference guided at ``kl_cfg`` (``BaseAdapter.guided_forward``, the empty prompt as the unconditional
input), reward-adaptive by default. Differences: the trained σ are the first int(T·``timestep_fraction``)
points of the rollout schedule (Flow-Factory draws ``num_train_timesteps`` of them, ``discrete``); no EMA
for evaluation; the centring is within each prompt group (Flow-Factory centres over the gathered
minibatch, several groups with two ranks; the paper's premise is within-prompt centring), and τ = 0's
pools split at the advantage's sign (``losses.crd``).

Roles: ``policy`` (trainable); snapshots ``old`` (implicit-reward baseline), ``sampling`` (rollouts),
``reference`` (frozen initial policy). Taps: ``rollout.latents``, ``reward``, ``advantage``,
``train.x_t``, ``train.implicit_reward``, ``train.velocity_ref``, ``loss.policy``, ``grad_norm.policy``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

import ffdebug
from reference_trainer.contracts import GENERATION_REWARD, ExecutionContract
from reference_trainer.errors import ConfigError, require
from reference_trainer.losses import crd as crd_losses
from reference_trainer.registry import register_trainer
from reference_trainer.trainers.decoupled import DecoupledArguments, DecoupledSamples, DecoupledTrainer


def _check_decay(text: str, field: str) -> None:
    try:
        _, value, slope, end = crd_losses.parse_decay(text)
    except ValueError as error:
        require(False, field, str(error))
        return
    require(
        0 <= value <= 1 and 0 <= end <= 1 and slope >= 0,
        field,
        f"values must be in [0, 1], slope >= 0: {text!r}",
    )


@dataclass(frozen=True, kw_only=True)
class CRDArguments(DecoupledArguments):
    """``train:`` section of a CRD run (defaults: Flow-Factory ``hparams/training_args/crd.py``).

    Shared fields: see ``DecoupledArguments`` (``kl_beta`` defaults to 0.1 here and the reference is
    always held; ``timestep_fraction`` 0.99 = Flow-Factory's ``timestep_range``).
    """

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    kl_beta: float = 0.1
    """β_KL of the KL to the CFG-guided reference."""
    timestep_fraction: float = 0.99
    """Train the first int(T · fraction) σ_j of the rollout schedule."""
    crd_beta: float = 1.0
    """β: scale of the centred implicit reward."""
    crd_loss_type: Literal["mse", "bce"] = "mse"
    """Matching loss: squared error or BCE with logits."""
    use_old_for_loss: bool = True
    """Implicit reward against the ``old`` snapshot (else the reference)."""
    adaptive_logp: bool = True
    """Weight the implicit-reward errors by their mean absolute error (fp64, no gradient)."""
    weight_temp: float = -1.0
    """τ of the centring: < 0 uniform mean, 0 hard positive / negative pools, > 0 softmax(±a/τ)."""
    old_model_decay: str = "0-0.25-0.005-0.999"
    """Decay schedule of ``old`` ("start_step-start_value-slope-end_value")."""
    sampling_model_decay: str = "75-0.0-0.0075-0.999"
    """Decay schedule of ``sampling``."""
    kl_cfg: float = 4.5
    """CFG scale of the reference in the KL (≤ 1: no guidance)."""
    reward_adaptive_kl: bool = True
    """Scale each sample's KL by c + a·(1 − c), c = 1e-4/β_KL."""

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.crd_beta > 0, "crd_beta", f"must be > 0, got {self.crd_beta}")
        require(
            self.crd_loss_type in ("mse", "bce"),
            "crd_loss_type",
            f"must be 'mse' or 'bce', got {self.crd_loss_type!r}",
        )
        require(self.kl_cfg >= 0, "kl_cfg", f"must be >= 0, got {self.kl_cfg}")
        _check_decay(self.old_model_decay, "old_model_decay")
        _check_decay(self.sampling_model_decay, "sampling_model_decay")


@register_trainer("crd", arguments=CRDArguments)
class CRDTrainer(DecoupledTrainer):
    """CRD (module docstring)."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    roles: ClassVar[tuple[str, ...]] = ("policy",)
    noise_name: ClassVar[str] = "crd"

    def setup_roles(self) -> dict[str, str]:
        """The ``policy`` variant; the ``old``, ``sampling`` and ``reference`` snapshots."""
        self.variants.declare_variant("policy")
        self.variants.add_snapshot("old", "policy")
        self.variants.add_snapshot("sampling", "policy")
        self.variants.add_snapshot("reference", "policy")
        return {"policy": "policy"}

    def sampling_parameters(self) -> Mapping[str, torch.Tensor]:
        """Rollouts always come from the ``sampling`` snapshot."""
        return self.variants.snapshot("sampling")

    def minibatch_order(self, samples: DecoupledSamples) -> torch.Tensor:
        """Rollout order, no shuffle (Flow-Factory: the centring keeps same-prompt samples together);
        every minibatch must hold whole prompt groups, since the centring is within each group.

        Raises:
            ConfigError: the global groups do not split into ``gradient_steps_per_iteration`` minibatches.
        """
        steps, groups = self.args.gradient_steps_per_iteration, len(samples.group_ids.unique())
        if groups % steps:
            raise ConfigError(
                "train.gradient_steps_per_iteration",
                f"{steps} minibatches would split some of the {groups} prompt groups of an iteration "
                f"(train.prompts_per_iteration × ranks); CRD centres within whole groups: use a divisor of {groups}",
            )
        return torch.arange(len(samples.prompts))

    def term_loss(
        self, samples: DecoupledSamples, index: torch.Tensor, js: tuple[int, ...], minibatch: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The CRD loss of samples ``index`` at σ_j, ``js = (j,)`` (module docstring)."""
        args = self.args
        (j,) = js
        x0, noise, sigma, x_t = self.noised(samples, index, j, minibatch)
        condition = samples.condition.select(index)
        target = noise - x0
        baseline = "old" if args.use_old_for_loss else "reference"
        v_old = self.velocity(x_t, sigma, condition, snapshot=baseline)
        v = self.velocity(x_t, sigma, condition)
        with torch.no_grad():
            v_ref = self.adapter.guided_forward(
                x_t,
                sigma,
                condition,
                guidance_scale=args.kl_cfg,
                uncondition=self.conditions.get([""] * len(index)),
                parameters=self.variants.snapshot("reference"),
            )
        ffdebug.tap("train.velocity_ref", v_ref)
        r_local = crd_losses.implicit_reward(v, v_old, target, adaptive=args.adaptive_logp)
        ffdebug.tap("train.implicit_reward", r_local)
        a_local = crd_losses.normalised_advantage(samples.advantages[index], args.adv_clip_max)
        r_all = self.backend.gather_rows(r_local.detach())
        a_all = self.backend.gather_rows(a_local)
        groups = samples.group_ids[index]
        policy_loss, ori = crd_losses.crd_loss(
            r_local,
            r_all,
            a_local,
            a_all,
            beta=args.crd_beta,
            adv_clip_max=args.adv_clip_max,
            weight_temp=args.weight_temp,
            loss_type=args.crd_loss_type,
            groups_local=groups,
            groups_all=self.backend.gather_rows(groups),
        )
        kl_loss, kl_div = crd_losses.crd_kl(
            v, v_ref, a_local, kl_beta=args.kl_beta, reward_adaptive=args.reward_adaptive_kl
        )
        loss = policy_loss + kl_loss
        metrics = {
            "policy_loss": policy_loss.item(),
            "unweighted_policy_loss": ori.item(),
            "kl": kl_div.item(),
            "kl_loss": kl_loss.item(),
            "r_theta_mean": r_local.detach().mean().item(),
            "old_deviate": ((v.detach() - v_old) ** 2).mean().item(),
            "loss": loss.item(),
        }
        return loss, metrics

    def after_cycle(self) -> None:
        """Blend ``old`` then ``sampling`` towards the policy at their decays of the optimizer step."""
        args = self.args
        for name, schedule in (("old", args.old_model_decay), ("sampling", args.sampling_model_decay)):
            decay = crd_losses.compute_decay(self.optimizer_step, *crd_losses.parse_decay(schedule))
            self.variants.update_snapshot(name, "policy", decay)
