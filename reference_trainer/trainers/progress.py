"""Per-step records of a run: ``metrics.jsonl``, and the progress bar or step log on stderr.

``StepProgress`` is the part of ``BaseTrainer`` that ``RoleOptimizer`` calls after each optimizer step
(``_record_step``): it counts the step, averages its values over the ranks, and on rank 0 appends the
record to ``metrics.jsonl`` and shows it, as a bar on a terminal, else as a line per ``log.every``
steps (``reference_trainer.steplog``; ``_progress_bar``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

# rich is imported here, not lazily in start(): importing rich.style draws from the global python RNG,
# whose checkpointed state must not depend on whether this process has trained before
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from reference_trainer.optim import StepResult
from reference_trainer.steplog import StepLog
from reference_trainer.trainers.run_files import METRICS_FILE

if TYPE_CHECKING:  # types only
    from reference_trainer.config import RunConfig
    from reference_trainer.distributed import Backend


class StepProgress:
    """The per-step records of ``BaseTrainer`` (module docstring)."""

    registry_name: ClassVar[str]
    config: RunConfig
    backend: Backend
    output_dir: Path
    optimizer_step: int
    cycle_step: int
    rollout_iteration: int
    data_epoch: int
    cycle_metrics: dict[str, float]
    _progress: Any
    _step_log: StepLog | None

    def _record_step(self, result: StepResult) -> None:
        """Called by ``RoleOptimizer`` after each optimizer step: count it and log one record.

        Rank 0 writes the record, of global values: the loss and the phase metrics averaged over the
        ranks (each rank's loss is the mean over its equal share of the step's samples), the gradient
        norm of the all-reduced gradient (the same on every rank), and the cycle metrics, which the
        trainers compute over every rank's samples (``feedback.RewardFeedback``)."""
        self.optimizer_step += 1
        self.cycle_step += 1
        averaged = self.backend.mean({"loss": result.loss, **result.metrics})
        result = StepResult(
            role=result.role,
            loss=averaged.pop("loss"),
            grad_norm=result.grad_norm,
            lr=result.lr,
            metrics={key: averaged[key] for key in result.metrics},
        )
        if not self.backend.is_main:
            return
        record: dict[str, Any] = {
            "optimizer_step": self.optimizer_step,
            "role": result.role,
            "rollout_iteration": self.rollout_iteration,
            "data_epoch": self.data_epoch,
            "loss": result.loss,
            f"loss.{result.role}": result.loss,
            f"grad_norm.{result.role}": result.grad_norm,
            f"lr.{result.role}": result.lr,
        }
        for key, value in {**self.cycle_metrics, **result.metrics}.items():
            record.setdefault(key, value)  # the run-identity keys above are never overridden
        with open(self.output_dir / METRICS_FILE, "a") as stream:
            stream.write(json.dumps(record) + "\n")
        if self._step_log is not None:
            self._step_log.step(record)
        if self._progress is not None:
            progress, task = self._progress
            progress.update(
                task, completed=self.optimizer_step, description=f"{result.role} loss {result.loss:+.4g}"
            )

    @contextmanager
    def _progress_bar(self) -> Iterator[None]:
        """Rank 0: a bar on a terminal, else a line per ``log.every`` steps (``steplog``)."""
        console = Console(stderr=True)
        if not self.backend.is_main:
            yield
            return
        if not console.is_terminal:
            self._step_log = StepLog(
                self.registry_name, self.config.log.every, self.config.max_steps, self.optimizer_step
            )
            try:
                yield
            finally:
                self._step_log = None
            return
        columns = (TextColumn(f"[bold]{self.registry_name}[/]"), BarColumn(), MofNCompleteColumn())
        with Progress(
            *columns, TextColumn("{task.description}"), TimeElapsedColumn(), console=console
        ) as progress:
            task = progress.add_task("", total=self.config.max_steps, completed=self.optimizer_step)
            self._progress = (progress, task)
            try:
                yield
            finally:
                self._progress = None
