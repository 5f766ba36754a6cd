"""The checkpoint layout on disk, and its readers and writers of nested state (no pickle).

Owns the file names of ``DIR/checkpoints/step-NNNNNN/`` (layout: the ``reference_trainer.checkpoint``
docstring), the checkpoint errors, where a step's checkpoint lives and which are published
(``checkpoint_path``, ``list_checkpoints``), the split of nested state into a JSON skeleton and flat
safetensors (``split_tensors`` / ``join_tensors``), and the global RNG states a checkpoint keeps.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

CHECKPOINTS = "checkpoints"
STATE_FILE = "state/trainer_state.json"
CYCLE_START_FILE = "cycle_start.safetensors"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
VARIANTS_FILE = "state/variants.safetensors"
OPTIMIZER_FILES = ("state/optimizer.safetensors", "state/optimizer.json")
RNG_FILES = ("state/rng.safetensors", "state/rng.json")
REQUIRED_FILES = (STATE_FILE, VARIANTS_FILE, *OPTIMIZER_FILES, *RNG_FILES)
"""Files every checkpoint's manifest lists (plus ``model/<variant>/diffusion_pytorch_model.safetensors`` per variant)."""
STEP_NAME = re.compile(r"step-(\d+)")
EXPORT_WEIGHTS = "diffusion_pytorch_model.safetensors"
"""The export's weights file: diffusers' ``SAFETENSORS_WEIGHTS_NAME``, so that ``model/<variant>/`` is a
component folder ``from_pretrained`` loads (with the ``config.json`` written next to it)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not belong to this run."""


class DamagedCheckpointError(CheckpointError):
    """One file of a checkpoint is missing, truncated, garbled, or inconsistent with the rest."""

    def __init__(self, checkpoint: Path, file: str, problem: str):
        super().__init__(f"{Path(checkpoint) / file}: {problem}")
        self.checkpoint, self.file, self.problem = Path(checkpoint), file, problem


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
    tensors = _load_tensors(directory.parent, f"state/{name}.safetensors")
    skeleton = _read_json(directory.parent, f"state/{name}.json")
    try:
        return join_tensors(skeleton, tensors)
    except (KeyError, TypeError, ValueError) as error:
        raise DamagedCheckpointError(
            directory.parent, f"state/{name}.json", f"does not match state/{name}.safetensors ({error!r})"
        ) from None


def _load_tensors(checkpoint: Path, file: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(Path(checkpoint) / file)
    except (OSError, SafetensorError) as error:
        raise DamagedCheckpointError(checkpoint, file, f"not a readable safetensors file ({error})") from None


def _read_json(checkpoint: Path, file: str) -> Any:
    try:
        return json.loads((Path(checkpoint) / file).read_bytes())
    except OSError as error:
        raise DamagedCheckpointError(checkpoint, file, f"cannot be read ({error.strerror})") from None
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
        raise DamagedCheckpointError(checkpoint, file, f"not valid JSON ({error})") from None


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
# where checkpoints are
# --------------------------------------------------------------------------------------------------


def checkpoint_path(output_dir: Path, optimizer_step: int) -> Path:
    """The directory of the checkpoint for ``optimizer_step``: ``output_dir/checkpoints/step-NNNNNN``."""
    return Path(output_dir) / CHECKPOINTS / f"step-{optimizer_step:06d}"


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Published checkpoints of ``output_dir`` (directories named ``step-<digits>``), oldest first.

    Publication is atomic, so each was complete when written; ``validate_checkpoint`` tells whether it
    still is. Other entries (``.tmp-*`` of a killed save, a stray ``step-abc``) are ignored.
    """
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if STEP_NAME.fullmatch(path.name) and path.is_dir()]
    return sorted(found, key=lambda path: int(path.name.split("-")[1]))
