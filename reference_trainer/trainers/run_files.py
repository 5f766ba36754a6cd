"""The run directory's own files: ``run.json`` and the logs ``metrics.jsonl`` / ``eval.jsonl``.

``RunFiles`` is the part of ``BaseTrainer`` that ``start()`` calls before the loop: a fresh run
replaces the logs of an earlier run that published no checkpoint (``_replace_earlier_logs``), and every
start writes ``run.json`` (config, run identity and its hash, versions, backend, argv).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reference_trainer import checkpoint as ckpt
from reference_trainer.errors import warn
from reference_trainer.jsonl import write_jsonl_atomic

if TYPE_CHECKING:  # types only
    from reference_trainer.config import RunConfig
    from reference_trainer.distributed import Backend

EVAL_FILE = "eval.jsonl"
METRICS_FILE = "metrics.jsonl"


class RunFiles:
    """The run-directory side of ``BaseTrainer`` (module docstring)."""

    config: RunConfig
    backend: Backend
    output_dir: Path
    identity: dict[str, Any]
    optimizer_step: int

    def _replace_earlier_logs(self) -> None:
        """A fresh run starts its logs empty: rows left by an earlier run in this directory that
        published no checkpoint (``run.build_trainer`` refused one that did) are replaced, never
        appended to."""
        if not self.backend.is_main:
            return
        for name in (METRICS_FILE, EVAL_FILE):
            path = self.output_dir / name
            if path.is_file():
                warn(
                    f"{path}: replaced by this fresh run (it held the logs of an earlier run with no checkpoint)"
                )
                write_jsonl_atomic(path, [])

    def _write_run_json(self) -> None:
        import diffusers
        import transformers

        self.output_dir.mkdir(parents=True, exist_ok=True)
        if not self.backend.is_main:
            return
        run = {
            "config": self.config.to_dict(),
            "identity": self.identity,
            "identity_hash": ckpt.identity_hash(self.identity),
            "versions": {
                "torch": torch.__version__,
                "diffusers": diffusers.__version__,
                "transformers": transformers.__version__,
            },
            "threads": torch.get_num_threads(),
            "backend": {"kind": self.backend.kind, "world_size": self.backend.world_size},
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "argv": sys.argv,
            "resumed_at_step": self.optimizer_step,
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (self.output_dir / "run.json").write_text(json.dumps(run, indent=2, default=str))
