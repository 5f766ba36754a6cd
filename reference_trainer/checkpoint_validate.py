"""A checkpoint's manifest, and its complete validation before any model loads.

``write_manifest`` records the sha256 and size of every file (written last); ``validate_checkpoint``
checks every listed file against it, the trainer state's counters, and the tensors' layout against
the checkpoint's own run identity (variant and export shapes, optimizer state shapes, RNG states).
A failure is a ``DamagedCheckpointError`` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from reference_trainer.checkpoint_format import (
    CYCLE_START_FILE,
    EXPORT_WEIGHTS,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    OPTIMIZER_FILES,
    REQUIRED_FILES,
    RNG_FILES,
    STATE_FILE,
    STEP_NAME,
    VARIANTS_FILE,
    DamagedCheckpointError,
    _read_json,
    _read_split,
)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _files_digest(files: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: Path) -> None:
    """``manifest.json``: ``{"format": 1, "files": {relative path: {"sha256", "bytes"}}, "sha256"}`` of
    every other file; the last ``sha256`` hashes the ``files`` mapping itself, so a damaged manifest is
    named as such rather than as a mismatch of the file whose entry it garbled."""
    files = {
        path.relative_to(directory).as_posix(): {"sha256": _sha256(path), "bytes": path.stat().st_size}
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST_FILE
    }
    manifest = {"format": MANIFEST_FORMAT, "files": files, "sha256": _files_digest(files)}
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _manifest_files(checkpoint: Path) -> dict[str, dict[str, Any]]:
    if not (checkpoint / MANIFEST_FILE).is_file():
        raise DamagedCheckpointError(
            checkpoint, MANIFEST_FILE, "missing: the checkpoint is incomplete (or predates content hashes)"
        )
    manifest = _read_json(checkpoint, MANIFEST_FILE)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != MANIFEST_FORMAT
        or not isinstance(files, dict)
    ):
        raise DamagedCheckpointError(checkpoint, MANIFEST_FILE, f"not a format-{MANIFEST_FORMAT} manifest")
    for name, entry in files.items():
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("sha256"), str)
            and type(entry.get("bytes")) is int
        )
        if not ok or Path(name).is_absolute() or ".." in Path(name).parts:
            raise DamagedCheckpointError(checkpoint, MANIFEST_FILE, f"malformed entry for {name!r}")
    if manifest.get("sha256") != _files_digest(files):
        raise DamagedCheckpointError(
            checkpoint, MANIFEST_FILE, "its entries differ from its own sha256: damaged"
        )
    return files


def _check_file(checkpoint: Path, name: str, entry: Mapping[str, Any]) -> None:
    path = checkpoint / name
    if not path.is_file():
        raise DamagedCheckpointError(checkpoint, name, "missing (listed in manifest.json)")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise DamagedCheckpointError(
            checkpoint,
            name,
            f"{size} bytes, manifest.json records {entry['bytes']}: truncated or overwritten",
        )
    if _sha256(path) != entry["sha256"]:
        raise DamagedCheckpointError(checkpoint, name, "contents differ from the sha256 in manifest.json")


_STATE_INTEGERS = (
    ("optimizer_step",),
    ("rollout_iteration",),
    ("data_epoch",),
    ("sampler", "data_epoch"),
    ("sampler", "batches_in_epoch"),
    ("cycle", "steps_done"),
)
"""Counters of ``trainer_state.json``: each a non-negative integer."""


def _check_trainer_state(checkpoint: Path, state: Any) -> dict[str, Any]:
    def bad(problem: str) -> DamagedCheckpointError:
        return DamagedCheckpointError(checkpoint, STATE_FILE, problem)

    if not isinstance(state, dict):
        raise bad("not a JSON object")
    for keys in _STATE_INTEGERS:
        value: Any = state
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if type(value) is not int or value < 0:
            raise bad(f"{'.'.join(keys)} must be a non-negative integer, got {value!r}")
    schema = state.get("identity", {}).get("schema") if isinstance(state.get("identity"), dict) else None
    if not isinstance(schema, dict) or not isinstance(schema.get("variants"), dict):
        raise bad("identity.schema.variants is missing")
    match = STEP_NAME.fullmatch(checkpoint.name)
    if match and int(match.group(1)) != state["optimizer_step"]:
        raise bad(f"records optimizer_step {state['optimizer_step']}, the directory is {checkpoint.name}")
    return state


def _header_shapes(checkpoint: Path, file: str) -> dict[str, list[int]]:
    """``{key: shape}`` from a safetensors header (no tensor is read)."""
    try:
        with safe_open(checkpoint / file, framework="pt") as stream:
            return {key: list(stream.get_slice(key).get_shape()) for key in stream.keys()}
    except (OSError, SafetensorError) as error:
        raise DamagedCheckpointError(checkpoint, file, f"not a readable safetensors file ({error})") from None


def _check_shapes(
    checkpoint: Path, file: str, found: Mapping[str, list[int]], expected: Mapping[str, Any]
) -> None:
    for key, shape in expected.items():
        if key not in found:
            raise DamagedCheckpointError(checkpoint, file, f"has no tensor {key}")
        if list(found[key]) != list(shape):
            raise DamagedCheckpointError(
                checkpoint,
                file,
                f"tensor {key} has shape {found[key]}, the run identity records {list(shape)}",
            )


def _check_tensor_layout(checkpoint: Path, state: Mapping[str, Any], files: Mapping[str, Any]) -> None:
    """Variant, export and cycle-start shapes against ``identity.schema.variants``."""
    variants = state["identity"]["schema"]["variants"]
    stored = _header_shapes(checkpoint, VARIANTS_FILE)
    for name, parameters in variants.items():
        shapes = {key: shape for key, shape in parameters}
        _check_shapes(
            checkpoint, VARIANTS_FILE, stored, {f"variant.{name}.{key}": s for key, s in shapes.items()}
        )
        export = f"model/{name}/{EXPORT_WEIGHTS}"
        if export not in files:
            raise DamagedCheckpointError(checkpoint, MANIFEST_FILE, f"does not list {export}")
        _check_shapes(checkpoint, export, _header_shapes(checkpoint, export), shapes)
    if state["cycle"]["steps_done"]:
        cycle_file = f"state/{CYCLE_START_FILE}"
        if cycle_file not in files:
            raise DamagedCheckpointError(
                checkpoint, MANIFEST_FILE, f"does not list {cycle_file} (saved inside a cycle)"
            )
        _check_shapes(checkpoint, cycle_file, _header_shapes(checkpoint, cycle_file), stored)


def _check_optimizer_state(checkpoint: Path, state: Mapping[str, Any]) -> None:
    """Every tensor of the optimizer state that is not a scalar has its parameter's shape, as recorded
    in ``identity.schema.optimizer`` (one entry per parameter group, children in order)."""
    file = OPTIMIZER_FILES[0]
    layout = state["identity"]["schema"].get("optimizer")
    optimizer = _read_split(checkpoint / "state", "optimizer")
    children = optimizer.get("composite") if isinstance(optimizer, dict) else None
    if not isinstance(layout, list) or not isinstance(children, list):
        raise DamagedCheckpointError(checkpoint, file, "not a CompositeOptimizer state")
    try:
        groups = [
            (index, child, group) for index, child in enumerate(children) for group in child["param_groups"]
        ]
        if len(groups) != len(layout):
            raise DamagedCheckpointError(
                checkpoint,
                file,
                f"has {len(groups)} parameter groups, the run identity records {len(layout)}",
            )
        for (index, child, group), described in zip(groups, layout):
            for param_id, shape in zip(group["params"], described["shapes"], strict=True):
                for key, value in child["state"].get(param_id, {}).items():
                    if isinstance(value, torch.Tensor) and value.ndim and list(value.shape) != list(shape):
                        raise DamagedCheckpointError(
                            checkpoint,
                            file,
                            f"composite[{index}] state {param_id}.{key} has shape {list(value.shape)}, "
                            f"its parameter {list(shape)}",
                        )
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise DamagedCheckpointError(checkpoint, file, f"malformed optimizer state ({error!r})") from None


def _check_rng_state(checkpoint: Path) -> None:
    """The RNG states load into scratch generators (the global ones are not touched)."""
    rng = _read_split(checkpoint / "state", "rng")
    try:
        torch.Generator().set_state(rng["torch"])
        version, internal, gauss = rng["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        np.random.RandomState().set_state(tuple(rng["numpy"]))
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise DamagedCheckpointError(checkpoint, RNG_FILES[0], f"not a valid RNG state ({error})") from None


def validate_checkpoint(checkpoint: Path) -> dict[str, Any]:
    """Check a checkpoint completely, before any model loads (module docstring); its trainer state."""
    checkpoint = Path(checkpoint)
    files = _manifest_files(checkpoint)
    for name in REQUIRED_FILES:
        if name not in files:
            raise DamagedCheckpointError(checkpoint, MANIFEST_FILE, f"does not list {name}")
    for name, entry in sorted(files.items()):
        _check_file(checkpoint, name, entry)
    state = _check_trainer_state(checkpoint, _read_json(checkpoint, STATE_FILE))
    _check_tensor_layout(checkpoint, state, files)
    _check_optimizer_state(checkpoint, state)
    _check_rng_state(checkpoint)
    return state
