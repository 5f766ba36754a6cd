"""The config/environment part of a run's identity (``config_identity``), computed by ``run``.

A checkpoint stores the identity and a resume refuses any difference (``checkpoint_identity``); the
trainer adds the parameter and optimizer layout (``BaseTrainer._schema``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch

from reference_trainer.config import RunConfig


def config_identity(
    config: RunConfig,
    fixture_digest: Mapping[str, str],
    world_size: int,
    *,
    inputs: Mapping[str, Mapping[str, str]],
) -> dict[str, Any]:
    """The config/environment part of the run identity (operational fields excluded: ``max_steps``,
    checkpoint and evaluation cadence, output location).

    ``fixture_digest`` hashes the init weights; ``inputs`` the contents of the input files
    (``run.input_digest``: dataset records and images, the packaged prompt list), so a dataset
    changed in place at the same path is a different run.
    """
    import diffusers
    import transformers

    return {
        "trainer": config.trainer,
        "seed": config.seed,
        "model": asdict(config.model),
        "train": _plain(asdict(config.train)),
        "data": _plain(asdict(config.data)),
        "eval": {key: value for key, value in _plain(asdict(config.eval)).items() if key != "every"},
        "optimizers": {role: _plain(asdict(config.optimizer_for(role))) for role in _roles_of(config)},
        "runtime": {
            **asdict(config.runtime),
            "deterministic_enabled": torch.are_deterministic_algorithms_enabled(),
            "num_threads": torch.get_num_threads(),
        },
        "world_size": world_size,
        "backend": asdict(config.backend),
        "fixtures": dict(fixture_digest),
        "inputs": {kind: dict(files) for kind, files in inputs.items()},
        "versions": {
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "transformers": transformers.__version__,
        },
    }


def _plain(value: Any) -> Any:
    """JSON-normal form (tuples as lists), as stored in a checkpoint's identity."""
    return json.loads(json.dumps(value, default=list))


def _roles_of(config: RunConfig) -> tuple[str, ...]:
    from reference_trainer.registry import resolve_trainer

    trainer_cls, _ = resolve_trainer(config.trainer)
    return trainer_cls.roles
