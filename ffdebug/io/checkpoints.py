"""Checkpoints as typed records with lazy sources: safetensors files, shard indexes, HF / diffusers
folders, `.pt` / `.bin` state dicts and folders of per-rank checkpoints.

Every function returns `Record`s keyed by tensor name (`io="weight"` unless told otherwise, the
layer read from the first integer path component). Nothing is read until `Record.load()`, which
reads one tensor as a numpy array (`ffdebug.io.safetensors`, a mapping of the file, without
torch). Only the `.pt` / `.bin` readers import torch (`ffdebug.io.torchfile`).
"""

from __future__ import annotations

import glob
import os
import re

from ffdebug.errors import FFDebugError, short_reason
from ffdebug.io.record import Record
from ffdebug.io.safetensors import SafetensorsFile
from ffdebug.io.sources import FileTensor, InMemory
from ffdebug.io.torchfile import flatten_tensors, load_weights_only

# Preferred weight files inside a model folder, best first.
SAFETENSORS_INDEXES = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")
SAFETENSORS_SINGLE = ("model.safetensors", "diffusion_pytorch_model.safetensors")
BIN_INDEXES = ("pytorch_model.bin.index.json", "diffusion_pytorch_model.bin.index.json")
BIN_SINGLE = ("pytorch_model.bin", "diffusion_pytorch_model.bin")
KNOWN_FILES = SAFETENSORS_INDEXES + SAFETENSORS_SINGLE + BIN_INDEXES + BIN_SINGLE

_RANK = re.compile(r"(?:^|[^A-Za-z0-9])(?:rank|tp)[-_]?(\d+)(?:[^0-9]|$)", re.IGNORECASE)
_LAYER = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def layer_of(name: str) -> int | None:
    """The first integer path component of a tensor name (`model.layers.3.mlp…` → 3), else None."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def dtype_name(dtype) -> str:
    """The store's name of a numpy or torch dtype (`bfloat16`, not `torch.bfloat16`)."""
    return str(dtype).replace("torch.", "")


def is_torch_module(obj) -> bool:
    """A torch `nn.Module`, told without importing torch (only a program that imported torch has
    one), so that reading a checkpoint file never imports it."""
    import sys

    torch = sys.modules.get("torch")
    nn = getattr(torch, "nn", None)
    return nn is not None and isinstance(obj, nn.Module)


def safetensors_records(
    file: SafetensorsFile | str, rank: int = 0, names=None, name_layers: bool = True, **fields
) -> list[Record]:
    """One record per tensor of a safetensors file (header read once, tensors on demand), by name
    in sorted order (as the safetensors library lists a file's tensors; its writer orders the
    header by dtype alignment first). `name_layers=False` leaves `layer` unset instead of reading
    it from the name."""
    if not isinstance(file, SafetensorsFile):
        file = SafetensorsFile(file)
    fields.setdefault("io", "weight")
    return [
        Record(
            key=name,
            seq=seq,
            rank=rank,
            layer=layer_of(name) if name_layers else None,
            dtype=file.meta[name][1],
            shape=file.meta[name][0],
            source=FileTensor(file, name),
            **fields,
        )
        for seq, name in enumerate(names if names is not None else sorted(file.meta))
    ]


def tensor_records(tensors: dict, origin: str, rank: int = 0, **fields) -> list[Record]:
    """One record per in-memory tensor of a flat {name: tensor} dict (numpy arrays or torch
    tensors; a torch tensor becomes a numpy view when loaded, `InMemory`)."""
    fields.setdefault("io", "weight")
    return [
        Record(
            key=name,
            seq=seq,
            rank=rank,
            layer=layer_of(name),
            dtype=dtype_name(t.dtype),
            shape=tuple(t.shape),
            source=InMemory(t, origin),
            **fields,
        )
        for seq, (name, t) in enumerate(tensors.items())
    ]


def state_dict_tensors(obj, origin: str) -> dict:
    """Flatten a state dict (unwrapping a lone `state_dict` / `model` / `module` key, or a module)
    of torch tensors or numpy arrays; imports torch only for a module (which imported it)."""
    if isinstance(obj, dict) and len(obj) == 1:
        ((key, inner),) = obj.items()
        if key in ("state_dict", "model", "module") and isinstance(inner, dict):
            obj = inner
    if is_torch_module(obj):
        obj = obj.state_dict()
    tensors = flatten_tensors(obj)
    if not tensors:
        raise FFDebugError(f"{origin}: holds no tensors; pass a state dict or a checkpoint of tensors")
    return tensors


def pt_records(path: str, rank: int = 0) -> list[Record]:
    return tensor_records(state_dict_tensors(load_weights_only(path), path), path, rank)


def _weight_map(index_path: str) -> dict:
    """The index's {tensor name: shard file}; every shard a plain file name beside the index."""
    from ffdebug.io.contained import MAX_JSON_FILE_BYTES, contained, read_json

    try:
        index = read_json(index_path, "shard index", limit=64 * MAX_JSON_FILE_BYTES, follow=True)
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (KeyError, TypeError) as err:
        raise FFDebugError(
            f"{index_path}: not a valid shard index ({type(err).__name__}: {short_reason(err)}); it needs a "
            '"weight_map" object {tensor name: shard file}'
        ) from None
    folder = os.path.dirname(index_path)
    for name, shard in weight_map.items():
        if type(shard) is not str:
            kind = "null" if shard is None else type(shard).__name__
            raise FFDebugError(
                f"{index_path}: weight_map[{name[:80]!r}] must be a shard file name, got {kind} {str(shard)[:40]}; "
                "the index is damaged — re-save or re-download it"
            )
        contained(folder, shard, f"{index_path}: weight_map[{name[:80]!r}]", "shard file")
    return weight_map


def safetensors_index_records(index_path: str, rank: int = 0) -> list[Record]:
    """`*.safetensors.index.json`: every tensor of every shard it lists, in index order."""
    weight_map = _weight_map(index_path)
    folder = os.path.dirname(index_path)
    files: dict[str, SafetensorsFile] = {}
    out: list[Record] = []
    for name, shard in weight_map.items():
        path = os.path.join(folder, shard)
        if shard not in files:
            if not os.path.exists(path):
                raise FFDebugError(f"{index_path}: shard {shard} listed for {name} is missing from {folder}")
            files[shard] = SafetensorsFile(path)
        file = files[shard]
        if name not in file.meta:
            raise FFDebugError(f"{index_path}: {name} is mapped to {shard}, which does not hold it")
        out.extend(safetensors_records(file, rank, [name]))
    return renumber(out)


def bin_index_records(index_path: str, rank: int = 0) -> list[Record]:
    """`pytorch_model.bin.index.json`: every tensor of every `.bin` shard it lists."""
    weight_map = _weight_map(index_path)
    folder = os.path.dirname(index_path)
    out: list[Record] = []
    for shard in dict.fromkeys(weight_map.values()):
        path = os.path.join(folder, shard)
        if not os.path.exists(path):
            raise FFDebugError(f"{index_path}: shard {shard} is missing from {folder}")
        out.extend(pt_records(path, rank))
    return renumber(out)


def renumber(records: list[Record]) -> list[Record]:
    """`seq` set to the position in `records` (after concatenating several files' records)."""
    import dataclasses

    return [r if r.seq == i else dataclasses.replace(r, seq=i) for i, r in enumerate(records)]


def folder_kind(weights_file: str) -> str:
    if os.path.basename(weights_file).startswith("diffusion_pytorch_model"):
        return "diffusers"
    return "hf-index" if weights_file.endswith(".index.json") else "hf-folder"


def pipeline_components(path: str) -> list[str]:
    """Component folders of a diffusers pipeline root that hold weights."""
    out = []
    for name in sorted(os.listdir(path)):
        sub = os.path.join(path, name)
        if os.path.isdir(sub) and any(
            f.endswith((".safetensors", ".bin", ".index.json")) for f in os.listdir(sub)
        ):
            out.append(name)
    return out


def folder_records(path: str, rank: int = 0, generic: bool = True) -> tuple[list[Record], str] | None:
    """(records, kind) of a model / component folder, or None when it holds no known weight file.

    `generic` also accepts any `*.safetensors` files (all of them) or a single `.pt`/`.bin`.
    """
    for names, read in (
        (SAFETENSORS_INDEXES, safetensors_index_records),
        (SAFETENSORS_SINGLE, safetensors_records),
        (BIN_INDEXES, bin_index_records),
        (BIN_SINGLE, pt_records),
    ):
        for name in names:
            p = os.path.join(path, name)
            if os.path.exists(p):
                return read(p, rank), folder_kind(p)
    if not generic:
        return None
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        records = renumber([r for f in files for r in safetensors_records(f, rank)])
        check_unique(records, path)
        return records, "safetensors-folder"
    pts = sorted(f for ext in ("*.pt", "*.pth", "*.bin") for f in glob.glob(os.path.join(path, ext)))
    if len(pts) == 1:
        return pt_records(pts[0], rank), "pt"
    return None


def check_unique(records: list[Record], where: str) -> None:
    """No tensor name twice on one rank (two files holding it and no index to choose)."""
    seen: dict[tuple[str, int], str] = {}
    for r in records:
        key = (r.key, r.rank)
        if key in seen:
            raise FFDebugError(
                f"{where}: tensor {r.key} appears in both {seen[key]} and {r.origin}; "
                "pass one file (or add a shard index)"
            )
        seen[key] = r.origin


def rank_number(name: str) -> int | None:
    m = _RANK.search(name)
    return int(m.group(1)) if m else None


def per_rank_records(path: str) -> tuple[list[Record], int] | None:
    """`rank0/`, `rank1/`… sub-folders or `*rank0*.safetensors`… files: one checkpoint per rank."""
    subdirs = {}
    files: dict[int, list[str]] = {}
    for name in os.listdir(path):
        r = rank_number(name)
        if r is None:
            continue
        full = os.path.join(path, name)
        if os.path.isdir(full):
            subdirs[r] = full
        elif name.endswith((".safetensors", ".pt", ".pth", ".bin")):
            files.setdefault(r, []).append(full)
    groups = subdirs or files
    if len(groups) < 2:
        return None
    ranks = sorted(groups)
    if ranks != list(range(len(ranks))):
        raise FFDebugError(
            f"{path}: per-rank checkpoints for ranks {ranks}; expected ranks 0..{len(ranks) - 1}"
        )
    records: list[Record] = []
    for r in ranks:
        if subdirs:
            got = folder_records(subdirs[r], r)
            if got is None:
                raise FFDebugError(f"{subdirs[r]}: no weight file for rank {r}")
            records.extend(got[0])
        else:
            for f in sorted(files[r]):
                records.extend(safetensors_records(f, r) if f.endswith(".safetensors") else pt_records(f, r))
    records = renumber(records)
    check_unique(records, path)
    return records, len(ranks)
