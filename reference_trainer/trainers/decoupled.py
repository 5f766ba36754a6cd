"""Shared machinery of the decoupled (forward-process) RL trainers: NFT, AWM and DGPO.

These algorithms train on the *forward* flow-matching process of finished rollouts instead of the
per-step likelihood of the sampler (Flow-Factory's "decoupled" paradigm; NVlabs/DiffusionNFT
``scripts/train_nft_sd3.py``, scxue/advantage_weighted_matching ``scripts/train_sd3_awm.py``,
Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py`` all share this loop). One rollout iteration:

1. draw P prompts, repeat each K times (contiguous groups, global group ids as ``trainers.grpo``);
2. roll out (the ODE by default, ``noise_level`` 0) from the sampling policy (a snapshot or the
   policy itself, ``sampling_parameters``), keep the clean latents x_0 [B, C, H, W] and the schedule σ;
3. decode, rewards, group-normalised advantages A [B] (``feedback.RewardFeedback``);
4. gather every rank's samples (global sample order), shuffle, split into
   ``gradient_steps_per_iteration`` minibatches, each rank training on its equal share; each minibatch
   is one optimizer step of ``policy``, accumulated over the trained noise levels: term j of the
   minibatch trains sample i at σ_{j,i}, chosen by ``timestep_sampling`` as the trainer's original
   chooses them (``reference_trainer.timesteps``: ``fixed`` j < int(T · ``timestep_fraction``) for every
   sample; NFT's ``shuffle`` per sample; DGPO's ``subset`` shared by the iteration; AWM's ``discrete`` /
   ``discrete_wo_init`` / ``logit_normal`` shared by the minibatch), each draw keyed by the counters and
   the global sample index where it is per sample, never by the rank: x_t = (1 − σ)·x_0 + σ·ε with ε
   fresh per (iteration, minibatch, j, sample) from a generator seeded by the *global* sample index, so
   the draws do not depend on the rank layout.

Subclasses implement ``term_loss`` (the loss of one microbatch at one σ_j) and may override the
minibatch order (DGPO keeps whole groups) and the noise key (DGPO shares ε within a group).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

import ffdebug
from reference_trainer import timesteps
from reference_trainer.adapters.base import Condition
from reference_trainer.contracts import GENERATION_REWARD, ExecutionContract
from reference_trainer.data import repeat_groups
from reference_trainer.distributed import Backend
from reference_trainer.errors import require
from reference_trainer.feedback import GenerationRewardArguments, RewardFeedback
from reference_trainer.flow_matching import randn_rows
from reference_trainer.taps import tap_rollout_inputs
from reference_trainer.trainers.base import BaseTrainer
from reference_trainer.trainers.grpo import trained_steps


@dataclass(frozen=True, kw_only=True)
class DecoupledArguments(GenerationRewardArguments):
    """``train:`` fields shared by the decoupled trainers (rollout / reward fields: see
    ``GenerationRewardArguments``; ``noise_level`` defaults to 0, ODE rollouts)."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    noise_level: float = 0.0
    """a of the rollout; 0 = the deterministic ODE (the decoupled algorithms need no log-probs)."""
    timestep_fraction: float = 1.0
    """Train the first int(T · fraction) noise levels σ_j of the rollout schedule (``trained_steps``)."""
    gradient_steps_per_iteration: int = 1
    """Optimizer steps per rollout iteration (minibatches of the shuffled samples)."""
    TIMESTEP_SAMPLINGS: ClassVar[tuple[str, ...]] = ("fixed",)
    """The ``timestep_sampling`` values this trainer offers (its original's first)."""
    timestep_sampling: Literal[
        "fixed", "shuffle", "subset", "discrete", "discrete_wo_init", "logit_normal"
    ] = "fixed"
    """How the trained noise levels are chosen (module docstring, ``reference_trainer.timesteps``)."""
    num_train_timesteps: int | None = None
    """M (``subset``) or S (``discrete``, ``discrete_wo_init``, ``logit_normal``): terms per minibatch."""
    trunc_steps: int | None = None
    """``subset``: draw from the schedule indices 0 .. trunc_steps (None: every step, T − 1)."""
    time_shift: float = 3.0
    """``logit_normal``: the shift of the drawn times (the original's ``time_shift``)."""
    rollout_guidance_scale: float = 1.0
    """Classifier-free guidance of the rollouts (the originals' ``sample.guidance_scale``); 1: none."""
    adv_clip_max: float = 5.0
    """A_max: advantages are clipped to [−A_max, A_max]."""
    kl_beta: float = 0.0
    """Weight of the velocity KL mean‖v_θ − v_ref‖² to the frozen reference; 0 = no reference."""

    def __post_init__(self) -> None:
        super().__post_init__()
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
        self._check_timestep_sampling()
        require(
            self.rollout_guidance_scale >= 1.0,
            "rollout_guidance_scale",
            f"must be >= 1 (1: no guidance), got {self.rollout_guidance_scale}",
        )
        require(self.adv_clip_max > 0, "adv_clip_max", f"must be > 0, got {self.adv_clip_max}")
        require(self.kl_beta >= 0, "kl_beta", f"must be >= 0, got {self.kl_beta}")
        batch = self.group_size * self.prompts_per_iteration
        steps = self.gradient_steps_per_iteration
        require(
            steps >= 1 and batch % steps == 0,
            "gradient_steps_per_iteration",
            f"must divide the {batch} samples of an iteration, got {steps}",
        )

    def _check_timestep_sampling(self) -> None:
        """The sampling is one this trainer offers and its counts fit the schedule (field named)."""
        kind, offered = self.timestep_sampling, self.TIMESTEP_SAMPLINGS
        require(
            kind in offered,
            "timestep_sampling",
            f"must be one of {list(offered)} for this trainer, got {kind!r}",
        )
        counted = kind in ("subset", "discrete", "discrete_wo_init", "logit_normal")
        if not counted:
            require(
                self.num_train_timesteps is None,
                "num_train_timesteps",
                f"is read by timestep_sampling subset / discrete / logit_normal only (this run: {kind})",
            )
        if kind != "subset":
            require(
                self.trunc_steps is None,
                "trunc_steps",
                f"is read by timestep_sampling subset only (this run: {kind})",
            )
        if not counted:
            return
        count, steps = self.num_train_timesteps, self.num_inference_steps
        require(
            count is not None and count >= 1, "num_train_timesteps", f"must be >= 1 for {kind}, got {count}"
        )
        if kind == "subset":
            trunc = steps - 1 if self.trunc_steps is None else self.trunc_steps
            require(
                0 <= trunc < steps,
                "trunc_steps",
                f"must be in 0..num_inference_steps − 1 ({steps - 1}), got {trunc}",
            )
            require(
                count <= trunc + 1,
                "num_train_timesteps",
                f"must be <= trunc_steps + 1 = {trunc + 1}, got {count}",
            )
        elif kind != "logit_normal":
            low, high = (0 if kind == "discrete" else 1), trained_steps(self.timestep_fraction, steps)
            require(
                count <= high - low,
                "num_train_timesteps",
                f"{count} strata of the {high - low} trained indices {low}..{high - 1} "
                "(int(timestep_fraction · num_inference_steps)): a stratum would be empty",
            )
        else:
            require(self.time_shift > 0, "time_shift", f"must be > 0, got {self.time_shift}")

    def term_count(self) -> int:
        """The backward terms of a minibatch: K = int(T·f) (``fixed``, ``shuffle``), else M or S."""
        if self.timestep_sampling in ("fixed", "shuffle"):
            return trained_steps(self.timestep_fraction, self.num_inference_steps)
        return int(self.num_train_timesteps)  # type: ignore[arg-type]


@dataclass(frozen=True)
class DecoupledSamples:
    """One rollout iteration, gathered over the ranks: B samples (global order)."""

    prompts: list[str]  # [B]
    group_ids: torch.Tensor  # [B] global group ids
    condition: Condition  # [B, ...]
    x0: torch.Tensor  # [B, C, H, W] the clean rollout latents
    sigmas: torch.Tensor  # [T + 1] the rollout schedule
    advantages: torch.Tensor  # [B] fp32


def gather_decoupled(samples: DecoupledSamples, backend: Backend) -> DecoupledSamples:
    """Every rank's samples in rank order (= global sample order); one rank: unchanged."""
    if backend.world_size == 1:
        return samples
    rows = backend.gather_rows
    return DecoupledSamples(
        backend.gather_objects(samples.prompts),
        rows(samples.group_ids),
        Condition(rows(samples.condition.prompt_embeds), rows(samples.condition.pooled)),
        rows(samples.x0),
        samples.sigmas,
        rows(samples.advantages),
    )


class DecoupledTrainer(BaseTrainer):
    """The decoupled loop (module docstring); not registered itself."""

    execution_contract: ClassVar[ExecutionContract] = GENERATION_REWARD
    roles: ClassVar[tuple[str, ...]] = ("policy",)
    noise_name: ClassVar[str] = "decoupled"
    """The name that keys this trainer's training-noise generators."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.feedback = RewardFeedback(self.args)

    # ---------------------------------------------------------------- hooks
    def sampling_parameters(self) -> Mapping[str, torch.Tensor] | None:
        """The snapshot that rolls out (None: the live policy)."""
        return None

    def train_terms(self, steps: int) -> list[tuple[int, ...]]:
        """The backward terms of a minibatch, each a tuple of trained step indices j: by default one
        term per σ_j (accumulated); AWM trains all its σ_j in one term (its ratio may average over them)."""
        return [(j,) for j in range(steps)]

    @abstractmethod
    def term_loss(
        self, samples: DecoupledSamples, index: torch.Tensor, js: tuple[int, ...], minibatch: int
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of samples ``index`` at the noise levels σ_j, j ∈ ``js``, and its metrics (each
        algorithm's own)."""

    def after_step(self) -> None:
        """Called after each optimizer step (snapshot updates)."""

    def after_cycle(self) -> None:
        """Called once a rollout iteration's optimizer steps all ran (not after a cut)."""

    def minibatch_order(self, samples: DecoupledSamples) -> torch.Tensor:
        """The iteration's shuffled global sample order [B] (chunked into minibatches)."""
        batch = len(samples.prompts)
        return torch.randperm(batch, generator=self.generator("shuffle", self.rollout_iteration))

    def noise_keys(self, samples: DecoupledSamples, index: torch.Tensor) -> list[int]:
        """One key per sample of ``index`` for its training noise: the global sample index."""
        return [int(i) for i in index]

    # ---------------------------------------------------------------- acquisition + feedback
    def sample(self) -> DecoupledSamples:
        """Steps 1-3 of the module docstring.

        Returns:
            The gathered ``DecoupledSamples`` of this iteration.
        """
        args = self.args
        prompts = self.rollout_prompts(args.prompts_per_iteration, args.group_size)
        first_group = self.backend.rank * args.prompts_per_iteration  # global group ids
        repeated, group_ids = repeat_groups(prompts, args.group_size, first_group)
        condition = self.conditions.get(repeated)
        parameters = self.sampling_parameters()
        trajectory = self.adapter.inference(
            condition,
            num_steps=args.num_inference_steps,
            noise_level=args.noise_level,
            generator=self.sample_generators("rollout", self.rollout_iteration, count=len(repeated)),
            module=None if parameters is not None else self.variants.variant("policy"),
            parameters=parameters,
            guidance_scale=args.rollout_guidance_scale,
            given=self.rollout_given(args.num_inference_steps, args.noise_level),
        )
        tap_rollout_inputs(self.adapter, repeated, trajectory, num_steps_field="train.num_inference_steps")
        ffdebug.tap("rollout.latents", trajectory.latents)
        images = self.adapter.decode_latents(trajectory.final)
        advantages, self.cycle_metrics = self.feedback(images, repeated, group_ids)
        samples = DecoupledSamples(
            repeated, group_ids, condition, trajectory.final.float(), trajectory.sigmas, advantages
        )
        return gather_decoupled(samples, self.backend)

    # ---------------------------------------------------------------- optimisation
    def optimize(self, samples: DecoupledSamples) -> None:
        """Step 4 of the module docstring.

        Args:
            samples: what ``sample`` returned.
        """
        args = self.args
        steps = args.term_count()
        with ffdebug.step(**self.step_tags("train")):  # the iteration's sample order is an input
            order = self.sample_order(self.minibatch_order(samples))
        chunks = order.chunk(args.gradient_steps_per_iteration)
        for m, minibatch in self.cycle_steps(list(enumerate(chunks))):
            index = self.backend.local_part(minibatch)
            terms = self.train_terms(steps)
            with ffdebug.step(**self.step_tags("train")), self.optim.phase("policy") as phase:
                for js in terms:
                    with ffdebug.step(timestep=js[0], microbatch=phase.backward_calls):
                        loss, metrics = self.term_loss(samples, index, js, m)
                    metrics.pop("loss", None)  # the step's loss is logged by the base
                    phase.backward(loss / len(terms), metrics)
            self.after_step()
        if not self._cycle_cut:
            self.after_cycle()

    # ---------------------------------------------------------------- helpers
    def noised(
        self, samples: DecoupledSamples, index: torch.Tensor, j: int, minibatch: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_0, ε, σ, x_t) of samples ``index`` at σ_j: [b, C, H, W], [b, C, H, W], [b], [b, C, H, W]."""
        x0 = samples.x0[index]
        generators = [
            self.generator(self.noise_name, self.rollout_iteration, minibatch, j, key)
            for key in self.noise_keys(samples, index)
        ]
        noise = self.drawn("train.noise", randn_rows(x0.shape, generators))
        sigma = self.term_sigma(samples, index, j, minibatch)
        s = sigma.view(-1, *([1] * (x0.ndim - 1)))
        x_t = (1.0 - s) * x0 + s * noise
        ffdebug.tap("train.x_t", x_t)
        return x0, noise, sigma, x_t

    def term_sigma(
        self, samples: DecoupledSamples, index: torch.Tensor, j: int, minibatch: int
    ) -> torch.Tensor:
        """σ of term j for samples ``index`` (global sample indices) of ``minibatch``, [b] fp32: the
        ``timestep_sampling`` draw (``reference_trainer.timesteps``), keyed by the counters and, where the
        original draws per sample, the global sample index; shared draws are the same on every rank."""
        sigma = self._term_sigma(samples, index, j, minibatch)
        ffdebug.tap("train.sigma", sigma)
        return sigma

    def _term_sigma(
        self, samples: DecoupledSamples, index: torch.Tensor, j: int, minibatch: int
    ) -> torch.Tensor:
        """``term_sigma`` before its tap: the random part of the choice passes ``drawn`` (the indices
        ``train.timestep_index`` [b] int64 into the σ schedule; a continuous σ itself, ``train.sigma_draw``)."""
        args, sigmas, iteration = self.args, samples.sigmas, self.rollout_iteration
        steps, count, kind = len(sigmas) - 1, args.term_count(), args.timestep_sampling
        b = len(index)
        if kind == "fixed":
            return sigmas[j].float().expand(b)
        if kind == "shuffle":
            picked = [
                int(
                    timesteps.shuffled_indices(steps, count, self.generator("timesteps", iteration, int(i)))[
                        j
                    ]
                )
                for i in index
            ]
            chosen = torch.tensor(picked, dtype=torch.long)
        elif kind == "subset":  # one draw for the iteration, every minibatch and rank
            trunc = steps - 1 if args.trunc_steps is None else args.trunc_steps
            drawn = timesteps.subset_indices(trunc, count, self.generator("timesteps", iteration))
            chosen = torch.as_tensor(drawn[j], dtype=torch.long).expand(b).clone()
        else:
            generator = self.generator("timesteps", iteration, minibatch)  # shared by the minibatch
            if kind == "logit_normal":
                sigma = timesteps.logit_normal_sigmas(count, args.time_shift, generator)[j].float().expand(b)
                return self.drawn("train.sigma_draw", sigma.clone())
            low, high = (0 if kind == "discrete" else 1), trained_steps(args.timestep_fraction, steps)
            drawn = timesteps.stratified_indices(low, high, count, generator)
            chosen = torch.as_tensor(drawn[j], dtype=torch.long).expand(b).clone()
        return sigmas[self.drawn("train.timestep_index", chosen, within=(0, len(sigmas)))].float()

    def velocity(
        self,
        x_t: torch.Tensor,
        sigma: torch.Tensor,
        condition: Condition,
        *,
        snapshot: str | None = None,
        guidance_scale: float = 1.0,
    ) -> torch.Tensor:
        """v(x_t, σ) of the live policy (with gradients) or of a snapshot (no grad), classifier-free
        guided at ``guidance_scale`` when > 1 (``guided_forward``)."""
        adapter = self.adapter
        if snapshot is None:
            policy = self.variants.variant("policy")
            return adapter.guided_forward(x_t, sigma, condition, guidance_scale=guidance_scale, module=policy)
        with torch.no_grad():
            parameters = self.variants.snapshot(snapshot)
            return adapter.guided_forward(
                x_t, sigma, condition, guidance_scale=guidance_scale, parameters=parameters
            )
