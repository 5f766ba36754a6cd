"""Execution contracts: how a trainer acquires its training data and whether it consumes a reward.

A trainer class and its algorithm-specific ``TrainingArguments`` class each declare one immutable
``ExecutionContract``; the two must be *equal* (value equality), and that is checked before any model
loads (``check_contracts``). The contract, not the contents of a batch, decides the execution path:
``BaseTrainer.start()`` dispatches on ``acquisition``.

Vocabulary follows Flow-Factory's Draft line (``src/flow_factory/contracts/execution.py``:
``ONLINE_EXECUTION_CONTRACT``, ``ONLINE_NO_FEEDBACK_EXECUTION_CONTRACT``, ``OFFLINE_EXECUTION_CONTRACT``),
with the newer names ``generation`` / ``runtime_reward``:

=========================  ===========  ==============  ==================  ====================
preset                     acquisition  feedback        cycle unit          examples
=========================  ===========  ==============  ==================  ====================
GENERATION_REWARD          generation   runtime_reward  rollout_iteration   GRPO, online DPO
GENERATION_NO_FEEDBACK     generation   none            rollout_iteration   DMD2, DiffusionOPD
DATASET                    dataset      none            data_epoch          SFT, offline DPO
=========================  ===========  ==============  ==================  ====================

``dataset`` + ``runtime_reward`` is rejected: a dataset trainer learns from supervision records, and a
reward there would be an undeclared second acquisition path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Acquisition = Literal["generation", "dataset"]
Feedback = Literal["runtime_reward", "none"]

_ACQUISITIONS = ("generation", "dataset")
_FEEDBACKS = ("runtime_reward", "none")


class ContractError(ValueError):
    """A trainer and its arguments disagree on their execution contract, or a contract is invalid."""


@dataclass(frozen=True)
class ExecutionContract:
    """How a trainer gets data (``acquisition``) and what feedback it consumes (``feedback``)."""

    acquisition: Acquisition
    """``generation``: the trainer samples its own trajectories each rollout iteration;
    ``dataset``: it iterates a finite dataset, one data epoch at a time."""
    feedback: Feedback
    """``runtime_reward``: rewards are computed on generated samples; ``none``: no reward."""

    def __post_init__(self) -> None:
        if self.acquisition not in _ACQUISITIONS:
            raise ContractError(f"acquisition must be one of {_ACQUISITIONS}, got {self.acquisition!r}")
        if self.feedback not in _FEEDBACKS:
            raise ContractError(f"feedback must be one of {_FEEDBACKS}, got {self.feedback!r}")
        if self.acquisition == "dataset" and self.feedback == "runtime_reward":
            raise ContractError("a dataset trainer cannot consume a runtime reward (feedback must be 'none')")

    @property
    def cycle_unit(self) -> str:
        """The counter that one acquisition cycle advances: ``rollout_iteration`` or ``data_epoch``."""
        return "rollout_iteration" if self.acquisition == "generation" else "data_epoch"

    def describe(self) -> str:
        """Short human-readable form, e.g. ``generation+runtime_reward``."""
        return f"{self.acquisition}+{self.feedback}"


GENERATION_REWARD = ExecutionContract(acquisition="generation", feedback="runtime_reward")
GENERATION_NO_FEEDBACK = ExecutionContract(acquisition="generation", feedback="none")
DATASET = ExecutionContract(acquisition="dataset", feedback="none")


def check_contracts(trainer_name: str, trainer_contract: object, arguments_contract: object) -> None:
    """Raise ``ContractError`` unless both sides declare equal ``ExecutionContract`` values.

    Called by the run builder before any model is loaded, so a mismatch costs no weight loading.
    """
    for side, contract in (("trainer", trainer_contract), ("arguments", arguments_contract)):
        if not isinstance(contract, ExecutionContract):
            raise ContractError(
                f"{trainer_name}: the {side} class must declare `execution_contract` as an ExecutionContract, "
                f"got {type(contract).__name__}"
            )
    if trainer_contract != arguments_contract:
        raise ContractError(
            f"{trainer_name}: trainer contract {trainer_contract.describe()} != arguments contract "  # type: ignore[union-attr]
            f"{arguments_contract.describe()}; make the trainer and its TrainingArguments declare the same "  # type: ignore[union-attr]
            "ExecutionContract"
        )
