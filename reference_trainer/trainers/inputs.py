"""A trainer's inputs: every random draw tapped as an input, and taken from a target with ``--inputs-from``.

The tap contract (docs/trainer-taps.md "Inputs") names what a run is given or draws: prompts, noise,
sample orders, random timesteps, a dataset batch's record ids. ``RunInputs`` is the part of
``BaseTrainer`` that owns them: each trainer draws as it always does, then passes the draw through
``drawn(stage, value)``, which taps it and, when ``--inputs-from`` set ``inputs_from``
(``reference_trainer.inputs_from``), returns the target's value of the same stage and step tags
instead. What the configuration fixes (the σ schedule, a record's prompt token ids) is recomputed and
tapped with ``derived_from`` (never taken), so the same-inputs gate names a target configured otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch

import ffdebug
from ffdebug.capture.state import current_tags
from reference_trainer.flow_matching import randn_rows, sample_sigmas

if TYPE_CHECKING:  # types only
    from reference_trainer.adapters.base import BaseAdapter, SamplingInputs
    from reference_trainer.data import DatasetAcquisition, PromptSource
    from reference_trainer.inputs_from import InputsFrom


class RunInputs:
    """The input side of ``BaseTrainer`` (module docstring)."""

    takes_inputs: ClassVar[bool] = True
    """Every registered trainer takes a target's inputs (``--inputs-from``)."""
    inputs_from: InputsFrom | None = None
    """Set by ``run.train`` for ``--inputs-from``: the draws come from that store."""
    adapter: BaseAdapter
    prompts: PromptSource | None
    dataset: DatasetAcquisition | None
    rollout_iteration: int

    def drawn(
        self, stage: str, value: torch.Tensor, *, within: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """A random draw of this run, tapped as the input ``stage`` under the step tags in force; with
        ``--inputs-from``, the target's capture of ``stage`` under the same tags replaces it.

        Args:
            stage: the input's stage name (``ffdebug.capture.trainer_inputs``).
            value: what this run drew.
            within: ``(low, high)``: an index draw's range, low ≤ i < high; a taken value outside it is
                an ``--inputs-from`` error.

        Returns:
            The value to use (the target's, or ``value``).
        """
        if self.inputs_from is not None:
            value = self.inputs_from.take(stage, current_tags(), value, within=within)
        ffdebug.tap(stage, value)
        return value

    def drawn_sigma_noise(
        self, shape: Sequence[int], args: Any, generator: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One flow-matching draw: σ [n] (``args.sigma_scheme`` in [``sigma_min``, ``sigma_max``]), then
        ε [n, ...] of ``shape``, from ``generator`` (one, or one per row), each through ``drawn``
        (``train.sigma``, ``train.noise``)."""
        n = shape[0]
        sigma = sample_sigmas(n, args.sigma_scheme, generator, low=args.sigma_min, high=args.sigma_max)
        sigma = self.drawn("train.sigma", sigma)
        return sigma, self.drawn("train.noise", randn_rows(shape, generator))

    def rollout_prompts(self, count: int, group_size: int) -> list[str]:
        """This iteration's ``count`` prompts (one per group): drawn, or the target's (``--inputs-from``)."""
        prompts = self.prompts.draw(self.rollout_iteration, count)
        if self.inputs_from is None:
            return prompts
        forced = self.inputs_from.prompts(
            self.rollout_iteration, group_size, self.prompts.prompts, self.adapter.prompt_token_ids
        )
        return forced or prompts

    def drawn_prompts(self, prompts: Sequence[str]) -> list[str]:
        """Prompts drawn for a phase that taps its own ``rollout.prompt_ids`` (not once per rollout
        iteration): tapped under the tags in force; with ``--inputs-from``, the target's rows there,
        each looked up among ``data.prompts``."""
        if self.inputs_from is None and not ffdebug.enabled():
            return list(prompts)
        own = self.adapter.prompt_token_ids(list(prompts))
        if own is None:  # an adapter without token ids: nothing to tap or take
            return list(prompts)
        if self.inputs_from is None:
            ffdebug.tap("rollout.prompt_ids", own)
            return list(prompts)
        ids = self.inputs_from.take("rollout.prompt_ids", current_tags(), own)
        ffdebug.tap("rollout.prompt_ids", ids)
        if ids is own:
            return list(prompts)
        assert self.prompts is not None
        where = f"{self.inputs_from.store}: rollout.prompt_ids at {current_tags()}"
        return self.inputs_from.prompts_of(ids, self.prompts.prompts, self.adapter.prompt_token_ids, where)

    def rollout_given(self, num_steps: int, noise_level: float) -> SamplingInputs | None:
        """The target's rollout noise with this run's own σ schedule (``--inputs-from``), or None."""
        if self.inputs_from is None:
            return None
        return self.inputs_from.sampling(self.rollout_iteration, noise_level, self.adapter.sigmas(num_steps))

    def sample_order(self, drawn: torch.Tensor) -> torch.Tensor:
        """The iteration's training order [B], tapped as ``train.order`` (call it inside the iteration's
        first ``train`` block): ``drawn``, or the target's."""
        order = drawn
        if self.inputs_from is not None:
            given = self.inputs_from.order(self.rollout_iteration, len(drawn))
            order = drawn if given is None else given
        ffdebug.tap("train.order", order)
        return order

    def take_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A dataset batch's record ids are an input (the sampler's order is a draw), tapped as
        ``batch.sample_ids``; with ``--inputs-from`` the batch is rebuilt from the target's ids. The
        batch's prompt token ids follow from the records (``batch.prompt_ids``, derived)."""
        assert self.dataset is not None
        ids = torch.tensor(batch["indices"], dtype=torch.long)
        given = self.drawn("batch.sample_ids", ids)
        if not torch.equal(given, ids):
            batch = self.dataset.batch_of(given.tolist())
        if ffdebug.enabled():
            token_ids = self.adapter.prompt_token_ids(list(batch["prompts"]))
            if token_ids is not None:
                source = (
                    f"the records' prompts in {self.dataset.source} and the tokenizer of model.fixture_dir"
                )
                ffdebug.tap("batch.prompt_ids", token_ids, derived_from=source)
        return batch
