"""One line per ``log.every`` optimizer steps when stderr is not a terminal (docs/reference-trainer.md "The reference
trainer"); a terminal shows the progress bar instead. Rank 0 only: ``BaseTrainer._record_step``
calls it after the record is written. The lines go through the ``ffdebug.trainer.steps`` logger
(``ffdebug/logs.py``: its stderr handler, ``-q`` / ``-v`` of ``reference-trainer``; an application
that configured logging gets the records instead)::

    reference-trainer: grpo step 3/8 role=policy loss=-0.01234 reward=0.4521 lr=0.001 grad_norm=0.8731 step_time=1.27s

``step_time`` is the wall time since the previous line (the run's start for the first) over the
optimizer steps it covers: a generation trainer's sampling and the evaluations are included.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from ffdebug.logs import TRAINER, get_logger

LOGGER = f"{TRAINER}.steps"


class StepLog:
    """Writes the per-step lines of one run."""

    def __init__(self, trainer: str, every: int, max_steps: int, start_step: int) -> None:
        """Lines of run `trainer` every `every` steps of `max_steps`, the clock starting now at
        optimizer step `start_step` (a resumed run's)."""
        self.trainer, self.every, self.max_steps = trainer, every, max_steps
        self.logger = get_logger(LOGGER)
        self._clock, self._since = time.monotonic(), start_step

    def step(self, record: Mapping[str, object]) -> None:
        """After optimizer step ``record["optimizer_step"]``: a line when it is a multiple of ``every``."""
        step = int(record["optimizer_step"])  # type: ignore[call-overload]
        if not self.every or step % self.every or not self.logger.isEnabledFor(logging.INFO):
            return
        now = time.monotonic()
        seconds = (now - self._clock) / max(step - self._since, 1)
        self._clock, self._since = now, step
        self.logger.info(self.line(record, seconds))

    def line(self, record: Mapping[str, object], step_time: float) -> str:
        """``grpo step 3/8 role=policy loss=... reward=... lr=... grad_norm=... step_time=1.27s``."""
        role = record["role"]
        values = {
            "loss": record["loss"],
            "reward": record.get("reward_mean"),  # generation trainers with a runtime reward
            "lr": record[f"lr.{role}"],
            "grad_norm": record[f"grad_norm.{role}"],
        }
        shown = " ".join(f"{k}={v:.4g}" for k, v in values.items() if isinstance(v, (int, float)))
        return (
            f"{self.trainer} step {record['optimizer_step']}/{self.max_steps} role={role} {shown} "
            f"step_time={step_time:.3g}s"
        )
