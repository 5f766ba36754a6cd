"""The run identity a checkpoint records: its hash, and the field-by-field comparison on resume.

``BaseTrainer.resume`` refuses a checkpoint whose stored identity differs from the current run's
(``require_same_identity``) before loading a single tensor; ``file_digest`` hashes the input files
whose contents are part of the identity.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reference_trainer.checkpoint_format import CheckpointError


def identity_hash(identity: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of the identity fields."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def identity_differences(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Human-readable ``field: checkpoint X, now Y`` lines for every differing identity field."""
    stored_flat = _flatten(json.loads(json.dumps(stored, default=str)))
    current_flat = _flatten(json.loads(json.dumps(current, default=str)))
    lines = []
    for key in sorted(set(stored_flat) | set(current_flat)):
        if stored_flat.get(key, "<absent>") != current_flat.get(key, "<absent>"):
            lines.append(
                f"{key}: checkpoint {stored_flat.get(key, '<absent>')!r}, now {current_flat.get(key, '<absent>')!r}"
            )
    return lines


def require_same_identity(checkpoint: Path, stored: Mapping[str, Any], current: Mapping[str, Any]) -> None:
    """``CheckpointError`` listing the differing fields (at most 20) unless the identities are equal."""
    differences = identity_differences(stored, current)
    if differences:
        raise CheckpointError(
            f"refusing to resume from {checkpoint}: the run identity differs:\n  "
            + "\n  ".join(differences[:20])
            + "\nresume continues the same run only: restore what changed, or train into a new --output-dir"
        )


def file_digest(paths: list[Path], root: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of files whose contents are part of the identity (fixture weights,
    dataset records and images, the packaged prompt list)."""
    return {str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest() for path in paths}
