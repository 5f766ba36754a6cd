"""Open any checkpoint kind as a list of lazily loaded tensor entries.

Accepted inputs (`open_source`):
- a `.safetensors` file;
- a Hugging Face model folder (`model.safetensors`, or sharded with `model.safetensors.index.json`;
  `pytorch_model.bin[.index.json]` as a fallback) and a diffusers component folder
  (`diffusion_pytorch_model.safetensors[.index.json]`); a diffusers pipeline root is refused with
  the list of its component folders;
- a `.pt` / `.pth` / `.bin` state dict, loaded with `torch.load(weights_only=True)` only;
- a weight dump store written by `maybe_dump_weights_and_exit` (`DIR/weights` or `DIR`), per rank;
- a folder of per-rank checkpoints (`rank0/`, `rank1/`… or files named `*rank0*.safetensors`…);
- a Python entry `module:function` (or `path/to/file.py:function`) returning a module or a dict of
  tensors; in-process callers may also pass an `nn.Module` or a dict (of torch tensors or numpy
  arrays) directly.

Each kind is read by the tensor-file layer (`ffdebug.io.checkpoints`, `ffdebug.io.torchfile`, the
store reader for weight dumps) into typed `Record`s (`ffdebug.io.record`), one per tensor (one
rank's piece of it for per-rank sources). Memory stays bounded: nothing is read until
`Record.load()`, which reads one tensor as a numpy array (`ffdebug.io.safetensors` maps it; no file
stays open). torch is imported only by the kinds that hold torch objects: a `.pt` / `.bin` file
(`ffdebug.io.torchfile`), an entry returning a module or tensors, a module passed in; their
tensors become numpy arrays when loaded (`ffdebug.arrays.as_array`). A dict may hold numpy arrays.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass

from ffdebug._entry import call_entry, is_entry_spec
from ffdebug.errors import FFDebugError
from ffdebug.io.checkpoints import (
    KNOWN_FILES,
    bin_index_records,
    folder_records,
    is_torch_module,
    layer_of,
    per_rank_records,
    pipeline_components,
    pt_records,
    safetensors_index_records,
    safetensors_records,
    state_dict_tensors,
    tensor_records,
)
from ffdebug.io.record import Record
from ffdebug.io.side import SideStore


@dataclass
class WeightSource:
    """All records of one side, in file order; `world_size` > 1 for per-rank sources."""

    path: str
    kind: str
    entries: list[Record]
    world_size: int = 1
    layer_spec: str | None = None  # a weight dump's FFDEBUG_WEIGHT_DUMP_LAYERS, from its run.json
    layers_only: bool = False  # the dump holds block tensors only (ATOM): the rest is left out
    never_dumped: tuple[str, ...] = ()  # name parts the dumper skips (ATOM: ".experts."), left out too

    @property
    def label(self) -> str:
        return f"{self.path} ({self.kind})"


# ------------------------------------------------------------------------------------------------
# weight dump stores


def _dump_entries(path: str) -> tuple[list[Record], int, str | None]:
    """(records, world size, the layer selection the dump was written with, if any)."""
    from ffdebug.store.reader import open_side

    store = open_side(path)
    records = [r for r in store.records if r.io == "weight"]
    if not records:
        raise FFDebugError(
            f"{path}: this store holds no weight records (io=weight); pass the weights/ folder written "
            "by maybe_dump_weights_and_exit (FFDEBUG_WEIGHT_DUMP_DIR/weights)"
        )
    entries = []
    world = 1
    for rec in records:
        if not rec.has_payload:
            raise FFDebugError(f"{path}: {rec.key} (rank {rec.rank}) has no payload; re-run the weight dump")
        world = max(world, rec.world_size or 1, rec.rank + 1)
        if rec.layer is None and layer_of(rec.key) is not None:
            rec = dataclasses.replace(rec, layer=layer_of(rec.key))
        if rec.dtype is None:
            rec = dataclasses.replace(rec, dtype="float32")
        entries.append(rec)
    env = store.run.get("env") if isinstance(store.run, dict) else None
    env = env if isinstance(env, dict) else {}
    spec = env.get("FFDEBUG_WEIGHT_DUMP_LAYERS") or env.get("ATOM_WEIGHT_DUMP_LAYERS")
    return entries, world, spec if isinstance(spec, str) and spec.strip() not in ("", "all") else None


def _atom_weight_dump(path: str) -> WeightSource | None:
    """ATOM's `weight_rank{R}_layer{L}.pt` files (`ffdebug.io.atom`): a weight dump of the layers
    it holds (ATOM_WEIGHT_DUMP_LAYERS), so the other side's other layers are left out, not missing."""
    from ffdebug.io import atom

    if "weights" not in atom.sides(path):
        return None
    store = atom.read_side(path, "weights")
    if store.problems:
        raise FFDebugError(f"{path}: {store.problems[0]}")
    world = max([r.world_size or 1 for r in store.records] + [r.rank + 1 for r in store.records] + [1])
    layers = ",".join(str(n) for n in store.run.get("layers", []))
    return WeightSource(
        path,
        "weight-dump",
        store.records,
        world,
        layers or None,
        layers_only=True,
        never_dumped=(".experts.",),
    )


def _is_store(path: str) -> bool:
    return os.path.exists(os.path.join(path, "run.json")) or bool(
        glob.glob(os.path.join(path, "rank*", "manifest.jsonl"))
    )


# ------------------------------------------------------------------------------------------------
# folders


def _open_dir(path: str) -> WeightSource:
    if _is_store(path):
        entries, world, spec = _dump_entries(path)
        return WeightSource(path, "weight-dump", entries, world, spec)
    if _is_store(os.path.join(path, "weights")):
        sub = os.path.join(path, "weights")
        entries, world, spec = _dump_entries(sub)
        return WeightSource(sub, "weight-dump", entries, world, spec)
    atom = _atom_weight_dump(path)
    if atom is not None:
        return atom
    if os.path.exists(os.path.join(path, "model_index.json")):
        comps = pipeline_components(path)
        example = os.path.join(path, comps[0]) if comps else os.path.join(path, "transformer")
        raise FFDebugError(
            f"{path}: is a diffusers pipeline (model_index.json); pass one component folder, e.g. "
            f"{example} (components with weights: {', '.join(comps) or 'none'})"
        )
    got = folder_records(path, generic=False)
    if got is not None:
        return WeightSource(path, got[1], got[0])
    ranked = per_rank_records(path)
    if ranked is not None:
        return WeightSource(path, "per-rank", ranked[0], ranked[1])
    got = folder_records(path)
    if got is not None:
        return WeightSource(path, got[1], got[0])
    raise FFDebugError(
        f"{path}: no weights found; expected model.safetensors[.index.json], "
        "diffusion_pytorch_model.safetensors, pytorch_model.bin, *.safetensors, or a weight dump store"
    )


# ------------------------------------------------------------------------------------------------


def open_source(x, label: str = "input") -> WeightSource:
    """Open one side of a weights diff (see the module docstring for the accepted kinds)."""
    if isinstance(x, WeightSource):
        return x
    if is_torch_module(x):
        return WeightSource(f"<{type(x).__name__}>", "module", tensor_records(x.state_dict(), label))
    if isinstance(x, dict):
        return WeightSource(
            f"<{label} dict>", "state-dict", tensor_records(state_dict_tensors(x, label), label)
        )
    if not isinstance(x, (str, os.PathLike)):
        raise FFDebugError(f"{label}: cannot read {type(x).__name__}; pass a path, a module or a state dict")
    path = os.fspath(x)
    if os.path.isdir(path):
        return _open_dir(path)
    if os.path.isfile(path):
        if path.endswith(".index.json"):
            if path.endswith(".bin.index.json"):
                return WeightSource(path, "hf-index", bin_index_records(path))
            return WeightSource(path, "hf-index", safetensors_index_records(path))
        if path.endswith(".safetensors"):
            return WeightSource(path, "safetensors", safetensors_records(path))
        if path.endswith((".pt", ".pth", ".bin")):
            return WeightSource(path, "pt", pt_records(path))
        raise FFDebugError(
            f"{path}: unknown checkpoint kind; pass a .safetensors / .pt / .bin file, a model folder, "
            "a *.index.json, a weight dump folder or module:function"
        )
    if is_entry_spec(path):
        obj = call_entry(path)
        if not (is_torch_module(obj) or isinstance(obj, dict)):
            raise FFDebugError(
                f"{path}: returned {type(obj).__name__}; return an nn.Module or a dict of tensors"
            )
        src = open_source(obj, label=path)
        src.path, src.kind = path, "entry"
        return src
    raise FFDebugError(f"{path}: no such file or directory (nor a module:function entry)")


def checkpoint_side_store(path: str) -> SideStore | None:
    """A `SideStore` view of a checkpoint folder or index (for `ffdebug inspect`), else None.

    Only for kinds the store reader does not open itself: model / component folders and shard
    indexes. Payloads are loaded one at a time when a record is read.
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        if not path.endswith(".index.json"):
            return None
    elif not os.path.isdir(path) or _is_store(path) or _is_store(os.path.join(path, "weights")):
        return None
    else:
        known = KNOWN_FILES + ("model_index.json",)
        if not any(os.path.exists(os.path.join(path, n)) for n in known) and not glob.glob(
            os.path.join(path, "*.safetensors")
        ):
            return None  # e.g. a folder of ATOM .pt dumps: the store reader imports those
    src = open_source(path)
    side = os.path.basename(os.path.normpath(path))
    records = [
        dataclasses.replace(r, seq=seq, side=side, world_size=src.world_size)
        for seq, r in enumerate(src.entries)
    ]
    return SideStore(path=src.path, records=records, run={"side": src.kind}, kind=src.kind)
