"""Choosing where a run starts: a fresh output directory, or a validated checkpoint to resume from.

``check_fresh_start`` refuses a fresh start over an earlier run's checkpoints; ``resolve_resume``
finds the checkpoint of ``--resume`` (only ``latest`` falls back past damaged ones, with a warning);
``read_*`` read a validated checkpoint's state for ``BaseTrainer.resume``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from reference_trainer.checkpoint_format import (
    CHECKPOINTS,
    CYCLE_START_FILE,
    STATE_FILE,
    VARIANTS_FILE,
    CheckpointError,
    DamagedCheckpointError,
    _load_tensors,
    _read_split,
    list_checkpoints,
)
from reference_trainer.checkpoint_validate import validate_checkpoint
from reference_trainer.errors import warn


def _logged_steps(output_dir: Path) -> str:
    """``metrics.jsonl (1 record)``-style words for the run's non-empty logs ('' when none)."""
    from reference_trainer.jsonl import read_jsonl

    parts = []
    for name in ("metrics.jsonl", "eval.jsonl"):
        try:
            count = len(read_jsonl(output_dir / name, quiet=True).records)
        except ValueError:  # a damaged log still counts as a log
            count = -1
        if count:
            parts.append(
                f"{name} ({count} record{'s' if count != 1 else ''})" if count > 0 else f"{name} (damaged)"
            )
    return " and ".join(parts)


def check_fresh_start(output_dir: Path) -> list[str]:
    """Before a run without ``--resume``: refuse a directory holding an earlier run's published
    checkpoints (a fresh start would mix two runs), and return the logs a fresh start replaces (an
    earlier run killed before its first checkpoint leaves rows no checkpoint belongs to)."""
    found = list_checkpoints(output_dir)
    if found:
        raise CheckpointError(
            f"--output-dir {output_dir} holds {len(found)} checkpoint(s) of an earlier run (newest "
            f"{found[-1].name}): continue it with --resume latest, or give another --output-dir; a fresh "
            "start here would mix two runs' logs and checkpoints"
        )
    return [name for name in ("metrics.jsonl", "eval.jsonl") if (Path(output_dir) / name).is_file()]


def resolve_resume(resume: str, output_dir: Path) -> Path:
    """The checkpoint to resume from, validated (``validate_checkpoint``; module docstring).

    ``latest``: the newest valid checkpoint of ``output_dir``, with a warning for each newer damaged
    one; else ``resume`` is a checkpoint directory, refused unless it is valid.
    """
    if resume != "latest":
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"--resume {resume}: not a checkpoint directory")
        validate_checkpoint(path)
        return path
    found = list_checkpoints(output_dir)
    if not found:
        logged = _logged_steps(Path(output_dir))
        where = Path(output_dir) / CHECKPOINTS
        if logged:
            raise CheckpointError(
                f"--resume latest: no complete checkpoint under {where}; its {logged} "
                f"{'are' if ' and ' in logged else 'is'} all that is left "
                "of a run killed before its first checkpoint was published: start the run again without "
                "--resume (the fresh start replaces metrics.jsonl and eval.jsonl)"
            )
        raise CheckpointError(
            f"--resume latest: no complete checkpoint under {where}: nothing to resume from; start the run without --resume"
        )
    damaged: list[DamagedCheckpointError] = []
    for path in reversed(found):
        try:
            validate_checkpoint(path)
        except DamagedCheckpointError as error:
            damaged.append(error)
            continue
        for error in damaged:
            warn(f"--resume latest: skipping the damaged checkpoint {error.checkpoint.name}: {error}")
        if damaged:
            warn(f"--resume latest: resuming from {path.name}, the newest valid checkpoint")
        return path
    raise CheckpointError(
        f"--resume latest: no valid checkpoint under {Path(output_dir) / CHECKPOINTS}: "
        + "; ".join(str(error) for error in damaged)
    )


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """The JSON trainer state (counters, sampler position, identity) — read before anything else."""
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def read_tensor_state(checkpoint: Path) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """(variant tensors, optimizer state, RNG state) of a checkpoint."""
    state_dir = Path(checkpoint) / "state"
    return (
        _load_tensors(checkpoint, VARIANTS_FILE),
        _read_split(state_dir, "optimizer"),
        _read_split(state_dir, "rng"),
    )


def read_cycle_start(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The variants' weights at the start of the cycle a run was stopped in (``cycle.steps_done > 0``)."""
    path = Path(checkpoint) / "state" / CYCLE_START_FILE
    if not path.is_file():
        raise CheckpointError(f"{checkpoint} was saved inside a cycle but has no state/{CYCLE_START_FILE}")
    return _load_tensors(checkpoint, f"state/{CYCLE_START_FILE}")
