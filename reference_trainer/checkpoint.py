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
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from reference_trainer.errors import warn

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
# manifest and validation
# --------------------------------------------------------------------------------------------------


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
