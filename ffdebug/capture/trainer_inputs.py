"""The inputs of a training run under the tap contract (docs/trainer-taps.md "Inputs").

A trainer's inputs are what it is *given* or *draws*, not what it computes: the prompts, every
Gaussian draw, the sample orders, the random timesteps, and the inputs its configuration fixes (the σ
schedule, the prompts' token ids of a dataset record). The same-inputs gate of compare
(`comparison.inputs_gate`) checks each of them exactly, in this order, before any number is graded;
`reference-trainer train --inputs-from` takes the drawn ones from a target's store and recomputes the
derived ones from its own configuration (a derived input's tap names its sources with
`derived_from=`, kept in the record's `extra`).

The capture keeps these stages in full in every dump mode (the gate needs the values).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrainerInput:
    """One input stage: its key and what it is (the gate's message)."""

    key: str
    what: str


TRAINER_INPUTS = (
    TrainerInput("rollout.prompt_ids", "prompts"),
    TrainerInput("rollout.noise", "initial noise"),
    TrainerInput("rollout.sde_noise", "per-step SDE noise"),
    TrainerInput("rollout.timesteps", "σ schedule"),
    TrainerInput("batch.sample_ids", "dataset sample ids"),
    TrainerInput("batch.prompt_ids", "the batch's prompt token ids"),
    TrainerInput("train.order", "sample order"),
    TrainerInput("train.timestep_index", "sampled timestep indices"),
    TrainerInput("train.sigma_draw", "sampled continuous σ"),
    TrainerInput("train.sigma", "training σ"),
    TrainerInput("train.noise", "training noise ε"),
)
"""The contract's input stages, in the order the gate checks them."""

INPUT_KEYS = tuple(i.key for i in TRAINER_INPUTS)
