"""Checkpoints: a model-only export and the resumable state, published atomically.

Layout of ``DIR/checkpoints/step-NNNNNN/`` (NNNNNN = ``optimizer_step``)::

    model/<variant>/                       # export: a diffusers component folder per trainable variant,
        config.json                        #   loadable with ``<ModelClass>.from_pretrained(that folder)``
        diffusion_pytorch_model.safetensors
    state/trainer_state.json               # counters, sampler position, run identity (+ its hash)
    state/variants.safetensors             # every variant's full state_dict and every snapshot
    state/optimizer.safetensors + .json    # CompositeOptimizer state (tensors + JSON skeleton)
    state/rng.safetensors + rng.json       # torch / python / numpy RNG states
    state/cycle_start.safetensors          # only for a run stopped inside a cycle: the variants'
                                           # weights at the cycle's start (``BaseTrainer`` docstring)

No pickle anywhere: nested state (optimizer state dicts, RNG tuples) is split into a JSON skeleton and
a flat safetensors file (``split_tensors`` / ``join_tensors``).

Publication: everything is written into ``checkpoints/.tmp-step-NNNNNN-<pid>/``, every file fsync'ed,
and the directory renamed to ``step-NNNNNN`` (atomic on POSIX). A process killed mid-save leaves only a
``.tmp-*`` directory, which readers ignore and the next save removes; the previous checkpoint is
untouched.

Resume (``BaseTrainer.resume``) first reads ``trainer_state.json`` and compares the stored run
identity with the current one field by field (``identity_differences``), refusing any difference
*before* loading a single tensor into the model or optimizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

CHECKPOINTS = "checkpoints"
STATE_FILE = "state/trainer_state.json"
CYCLE_START_FILE = "cycle_start.safetensors"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not belong to this run."""


# --------------------------------------------------------------------------------------------------
# nested state <-> (JSON skeleton, flat tensors)
# --------------------------------------------------------------------------------------------------


def split_tensors(value: Any, tensors: dict[str, torch.Tensor], path: str = "t") -> Any:
    """Replace every tensor in ``value`` by ``{"__tensor__": key}`` (filling ``tensors``); JSON-safe.

    Dicts become ``{"__dict__": [[key, value], ...]}`` so integer keys (optimizer state) survive.
    """
    if isinstance(value, torch.Tensor):
        tensors[path] = value.detach().contiguous().clone()
        return {"__tensor__": path}
    if isinstance(value, Mapping):
        return {"__dict__": [[k, split_tensors(v, tensors, f"{path}.{k}")] for k, v in value.items()]}
    if isinstance(value, list | tuple):
        return {"__list__": [split_tensors(v, tensors, f"{path}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, np.ndarray):
        tensors[path] = torch.from_numpy(value.copy())
        return {"__ndarray__": path}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise CheckpointError(f"cannot serialise {type(value).__name__} at {path}")


def join_tensors(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of ``split_tensors`` (lists come back as lists, ndarrays as ndarrays)."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__ndarray__" in skeleton:
            return tensors[skeleton["__ndarray__"]].numpy()
        if "__dict__" in skeleton:
            return {k: join_tensors(v, tensors) for k, v in skeleton["__dict__"]}
        if "__list__" in skeleton:
            return [join_tensors(v, tensors) for v in skeleton["__list__"]]
    return skeleton


def _write_split(directory: Path, name: str, value: Any) -> None:
    tensors: dict[str, torch.Tensor] = {}
    skeleton = split_tensors(value, tensors)
    save_file(tensors, directory / f"{name}.safetensors")
    (directory / f"{name}.json").write_text(json.dumps(skeleton))


def _read_split(directory: Path, name: str) -> Any:
    tensors = load_file(directory / f"{name}.safetensors")
    return join_tensors(json.loads((directory / f"{name}.json").read_text()), tensors)


# --------------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """torch (CPU), python ``random`` and numpy global RNG states."""
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": list(np_state)}


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the torch (CPU), python ``random`` and numpy global RNG states saved by ``rng_state``."""
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(state["numpy"]))


# --------------------------------------------------------------------------------------------------
# identity
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# save / find / load
# --------------------------------------------------------------------------------------------------


def checkpoint_path(output_dir: Path, optimizer_step: int) -> Path:
    """The directory of the checkpoint for ``optimizer_step``: ``output_dir/checkpoints/step-NNNNNN``."""
    return Path(output_dir) / CHECKPOINTS / f"step-{optimizer_step:06d}"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(directory: Path) -> None:
    """fsync every file and directory below ``directory``, then ``directory`` itself."""
    for path in sorted(directory.rglob("*"), reverse=True):
        _fsync(path)
    _fsync(directory)


EXPORT_WEIGHTS = "diffusion_pytorch_model.safetensors"
"""The export's weights file: diffusers' ``SAFETENSORS_WEIGHTS_NAME``, so that ``model/<variant>/`` is a
component folder ``from_pretrained`` loads (with the ``config.json`` written next to it)."""


def write_model_export(directory: Path, variants: Mapping[str, torch.nn.Module]) -> None:
    """``model/<variant>/``: ``diffusion_pytorch_model.safetensors`` (+ ``config.json`` for diffusers models).

    Args:
        directory: the checkpoint being written.
        variants: the trainable variants by name (for a diffusers model, its full ``state_dict``).
    """
    from diffusers.configuration_utils import ConfigMixin

    for name, module in variants.items():
        target = directory / "model" / name
        target.mkdir(parents=True)
        weights = {key: value.detach().contiguous() for key, value in module.state_dict().items()}
        save_file(weights, target / EXPORT_WEIGHTS)
        if isinstance(module, ConfigMixin):
            module.save_config(target)


def save_checkpoint(
    output_dir: Path,
    *,
    trainer_state: Mapping[str, Any],
    variants: Mapping[str, torch.nn.Module],
    variant_tensors: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any],
    cycle_start: Mapping[str, torch.Tensor] | None = None,
    keep_last: int = 0,
) -> Path:
    """Write a checkpoint for ``trainer_state["optimizer_step"]`` and publish it by rename."""
    root = Path(output_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a killed save; never a published checkpoint
        shutil.rmtree(stale, ignore_errors=True)
    step = int(trainer_state["optimizer_step"])
    final = checkpoint_path(output_dir, step)
    tmp = root / f".tmp-step-{step:06d}-{os.getpid()}"
    (tmp / "state").mkdir(parents=True)
    write_model_export(tmp, variants)
    save_file({k: v.contiguous() for k, v in variant_tensors.items()}, tmp / "state" / "variants.safetensors")
    _write_split(tmp / "state", "optimizer", optimizer_state)
    _write_split(tmp / "state", "rng", rng_state())
    if cycle_start is not None:
        save_file({k: v.contiguous() for k, v in cycle_start.items()}, tmp / "state" / CYCLE_START_FILE)
    (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True))  # written last
    _fsync_tree(tmp)
    if final.exists():  # re-saving the same step (e.g. a resumed run that stops at once)
        old = root / f".tmp-old-{step:06d}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync(root)  # make the rename itself durable
    _prune(root, keep_last)
    return final


def _prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    for old in list_checkpoints(root.parent)[:-keep_last]:
        shutil.rmtree(old)


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Published, complete checkpoints of ``output_dir``, oldest first."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [path for path in root.glob("step-*") if (path / STATE_FILE).is_file()]
    return sorted(found, key=lambda path: int(path.name.split("-")[1]))


def resolve_resume(resume: str, output_dir: Path) -> Path:
    """``latest`` -> the newest complete checkpoint of ``output_dir``; else a checkpoint directory."""
    if resume == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise CheckpointError(
                f"--resume latest: no complete checkpoint under {Path(output_dir) / CHECKPOINTS}"
            )
        return found[-1]
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"--resume {resume}: not a complete checkpoint (no {STATE_FILE})")
    return path


def read_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """The JSON trainer state (counters, sampler position, identity) — read before anything else."""
    return json.loads((Path(checkpoint) / STATE_FILE).read_text())


def read_tensor_state(checkpoint: Path) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """(variant tensors, optimizer state, RNG state) of a checkpoint."""
    state_dir = Path(checkpoint) / "state"
    return (
        load_file(state_dir / "variants.safetensors"),
        _read_split(state_dir, "optimizer"),
        _read_split(state_dir, "rng"),
    )


def read_cycle_start(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The variants' weights at the start of the cycle a run was stopped in (``cycle.steps_done > 0``)."""
    path = Path(checkpoint) / "state" / CYCLE_START_FILE
    if not path.is_file():
        raise CheckpointError(f"{checkpoint} was saved inside a cycle but has no state/{CYCLE_START_FILE}")
    return load_file(path)
