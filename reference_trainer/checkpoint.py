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
    manifest.json                          # sha256 and size of every other file; written last

No pickle anywhere: nested state (optimizer state dicts, RNG tuples) is split into a JSON skeleton and
a flat safetensors file (``split_tensors`` / ``join_tensors``).

Publication: everything is written into ``checkpoints/.tmp-step-NNNNNN-<pid>/``, every file fsync'ed,
and the directory renamed to ``step-NNNNNN`` (atomic on POSIX). A process killed mid-save leaves only a
``.tmp-*`` directory, which readers ignore and the next save removes; the previous checkpoint is
untouched.

Validation (``validate_checkpoint``), before any model loads: every file listed in the manifest must
exist with its recorded size and sha256 (so a truncated, garbled or missing file is named), the
trainer state must be well-formed JSON with its counters, and the tensors must have the layout that
the checkpoint's own run identity records (variant and export shapes, optimizer state shapes per
parameter, loadable RNG states). A failure is a ``DamagedCheckpointError`` naming the file.

``resolve_resume``: an explicit ``--resume DIR`` that fails validation is refused. Only ``--resume
latest`` falls back: it validates the checkpoints newest first, warns about each damaged one (naming
the file), and resumes from the newest valid one. Directories of ``checkpoints/`` that are not named
``step-<digits>`` are ignored.

Resume (``BaseTrainer.resume``) then compares the stored run identity with the current one field by
field (``identity_differences``), refusing any difference *before* loading a single tensor into the
model or optimizer.

This module writes and publishes a checkpoint (``save_checkpoint``, ``write_model_export``); the
other parts are ``checkpoint_format`` (layout, errors, nested state, RNG), ``checkpoint_identity``,
``checkpoint_validate`` (manifest, ``validate_checkpoint``) and ``checkpoint_resume``
(``resolve_resume``, ``read_*``). Their public names are re-exported here.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from reference_trainer.checkpoint_format import (
    CHECKPOINTS,
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
    CheckpointError,
    DamagedCheckpointError,
    _write_split,
    checkpoint_path,
    join_tensors,
    list_checkpoints,
    rng_state,
    set_rng_state,
    split_tensors,
)
from reference_trainer.checkpoint_identity import (
    file_digest,
    identity_differences,
    identity_hash,
    require_same_identity,
)
from reference_trainer.checkpoint_resume import (
    check_fresh_start,
    read_cycle_start,
    read_tensor_state,
    read_trainer_state,
    resolve_resume,
)
from reference_trainer.checkpoint_validate import validate_checkpoint, write_manifest

__all__ = [
    "CHECKPOINTS",
    "CYCLE_START_FILE",
    "EXPORT_WEIGHTS",
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "OPTIMIZER_FILES",
    "REQUIRED_FILES",
    "RNG_FILES",
    "STATE_FILE",
    "STEP_NAME",
    "VARIANTS_FILE",
    "CheckpointError",
    "DamagedCheckpointError",
    "check_fresh_start",
    "checkpoint_path",
    "file_digest",
    "identity_differences",
    "identity_hash",
    "join_tensors",
    "list_checkpoints",
    "read_cycle_start",
    "read_tensor_state",
    "read_trainer_state",
    "require_same_identity",
    "resolve_resume",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "split_tensors",
    "validate_checkpoint",
    "write_manifest",
    "write_model_export",
]


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


def write_model_export(
    directory: Path,
    variants: Mapping[str, torch.nn.Module],
    variant_tensors: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """``model/<variant>/``: ``diffusion_pytorch_model.safetensors`` (+ ``config.json`` for diffusers models).

    Args:
        directory: the checkpoint being written.
        variants: the trainable variants by name (for a diffusers model, its full ``state_dict``).
        variant_tensors: full weights as ``variant.<name>.<key>`` (``roles.ComponentVariantRegistry.
            state_tensors``, gathered under FSDP2); default: each module's own ``state_dict``.
    """
    from diffusers.configuration_utils import ConfigMixin

    for name, module in variants.items():
        target = directory / "model" / name
        target.mkdir(parents=True)
        state = module.state_dict()
        if variant_tensors is not None:
            state = {key: variant_tensors[f"variant.{name}.{key}"] for key in state}
        weights = {key: value.detach().contiguous() for key, value in state.items()}
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
    write_model_export(tmp, variants, variant_tensors)
    save_file({k: v.contiguous() for k, v in variant_tensors.items()}, tmp / "state" / "variants.safetensors")
    _write_split(tmp / "state", "optimizer", optimizer_state)
    _write_split(tmp / "state", "rng", rng_state())
    if cycle_start is not None:
        save_file({k: v.contiguous() for k, v in cycle_start.items()}, tmp / "state" / CYCLE_START_FILE)
    (tmp / STATE_FILE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True))
    write_manifest(tmp)  # written last: it hashes every other file
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
