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
  tensors; in-process callers may also pass an `nn.Module` or a dict directly.

Memory stays bounded: nothing is read until `Entry.load()`, which reads one tensor. safetensors
files are read through `safe_open`; the handle is dropped after every `RECYCLE_BYTES` read so the
pages of its memory map leave the resident set (a handle kept open for a whole 2 GiB file would
keep all 2 GiB resident).
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from ffdebug._entry import call_entry, is_entry_spec
from ffdebug.errors import FFDebugError, short_reason

RECYCLE_BYTES = 64 << 20

SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "C64": "complex64",
}

# Preferred weight files inside a model folder, best first.
_SAFETENSORS_INDEXES = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")
_SAFETENSORS_SINGLE = ("model.safetensors", "diffusion_pytorch_model.safetensors")
_BIN_INDEXES = ("pytorch_model.bin.index.json", "diffusion_pytorch_model.bin.index.json")
_BIN_SINGLE = ("pytorch_model.bin", "diffusion_pytorch_model.bin")

_RANK = re.compile(r"(?:^|[^A-Za-z0-9])(?:rank|tp)[-_]?(\d+)(?:[^0-9]|$)", re.IGNORECASE)
_LAYER = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


@dataclass
class Entry:
    """One tensor of a checkpoint (one rank's piece of it for per-rank sources)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    loader: Callable = field(repr=False)
    rank: int = 0
    layer: int | None = None
    shard: dict | None = None  # {dim, index, count} from a dump manifest
    origin: str = ""  # the file it lives in, for messages
    persistent: bool | None = None  # a dump record's `persistent` (False: a non-persistent buffer)

    def load(self):
        return self.loader()


@dataclass
class WeightSource:
    """All entries of one side, in file order; `world_size` > 1 for per-rank sources."""

    path: str
    kind: str
    entries: list[Entry]
    world_size: int = 1
    layer_spec: str | None = None  # a weight dump's FFDEBUG_WEIGHT_DUMP_LAYERS, from its run.json

    @property
    def label(self) -> str:
        return f"{self.path} ({self.kind})"


def layer_of(name: str) -> int | None:
    """The first integer path component of a tensor name (`model.layers.3.mlp…` → 3), else None."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


# ------------------------------------------------------------------------------------------------
# safetensors


class SafetensorsFile:
    """Header read once at open (validates the file); tensors read one at a time on demand."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._handle = None
        self._read = 0
        self.meta: dict[str, tuple[tuple[int, ...], str]] = {}
        try:
            f = self._open()
            for name in f.keys():
                sl = f.get_slice(name)
                code = sl.get_dtype()
                self.meta[name] = (tuple(sl.get_shape()), SAFETENSORS_DTYPES.get(code, code.lower()))
            del f
        except FFDebugError:
            raise
        except Exception as err:  # SafetensorError, OSError, ValueError, ...
            raise _unreadable(path, err) from None

    def _open(self):
        from safetensors import safe_open

        return safe_open(self.path, framework="pt")

    def get(self, name: str):
        try:
            if self._handle is None:
                self._handle = self._open()
            t = self._handle.get_tensor(name)
        except Exception as err:
            self._handle = None
            raise _unreadable(self.path, err) from None
        self._read += t.numel() * t.element_size()
        if self._read >= RECYCLE_BYTES:
            self._handle, self._read = None, 0
        return t

    def entries(self, rank: int = 0, names=None) -> list[Entry]:
        out = []
        for name in names if names is not None else self.meta:
            shape, dtype = self.meta[name]
            out.append(
                Entry(
                    name, shape, dtype, _getter(self, name), rank=rank, layer=layer_of(name), origin=self.path
                )
            )
        return out


def _getter(file: SafetensorsFile, name: str):
    return lambda: file.get(name)


def _unreadable(path: str, err: Exception) -> FFDebugError:
    return FFDebugError(
        f"{path}: unreadable safetensors file ({short_reason(err)}); it may be truncated or not safetensors — "
        "re-save or re-download it"
    )


def _safetensors_index(index_path: str, rank: int = 0) -> list[Entry]:
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FFDebugError(
            f"{index_path}: not a valid shard index ({type(err).__name__}: {short_reason(err)}); it needs a "
            '"weight_map" object {tensor name: shard file}'
        ) from None
    folder = os.path.dirname(index_path)
    files: dict[str, SafetensorsFile] = {}
    entries = []
    for name, shard in weight_map.items():
        path = os.path.join(folder, shard)
        if shard not in files:
            if not os.path.exists(path):
                raise FFDebugError(f"{index_path}: shard {shard} listed for {name} is missing from {folder}")
            files[shard] = SafetensorsFile(path)
        file = files[shard]
        if name not in file.meta:
            raise FFDebugError(f"{index_path}: {name} is mapped to {shard}, which does not hold it")
        entries.extend(file.entries(rank, [name]))
    return entries


# ------------------------------------------------------------------------------------------------
# .pt / .bin state dicts


def _load_pt(path: str):
    """torch.load(weights_only=True), memory-mapped when the file format allows it."""
    import pickle

    import torch

    from ffdebug.store.importers import load_pt_weights_only

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError):
        # Legacy (non-zip) files cannot be mapped; refusals get their one-line message here.
        return load_pt_weights_only(path)


def _tensor_dict(obj, origin: str) -> dict:
    """Flatten a state dict (unwrapping a lone `state_dict` / `model` / `module` key)."""
    import torch

    from ffdebug.store.importers import _flatten

    if isinstance(obj, dict) and len(obj) == 1:
        ((key, inner),) = obj.items()
        if key in ("state_dict", "model", "module") and isinstance(inner, dict):
            obj = inner
    if isinstance(obj, torch.nn.Module):
        obj = obj.state_dict()
    tensors: dict = {}
    _flatten("", obj, tensors)
    if not tensors:
        raise FFDebugError(f"{origin}: holds no tensors; pass a state dict or a checkpoint of tensors")
    return tensors


def _dict_entries(tensors: dict, origin: str, rank: int = 0) -> list[Entry]:
    return [
        Entry(
            name,
            tuple(t.shape),
            dtype_name(t.dtype),
            (lambda t=t: t.detach()),
            rank=rank,
            layer=layer_of(name),
            origin=origin,
        )
        for name, t in tensors.items()
    ]


def _pt_entries(path: str, rank: int = 0) -> list[Entry]:
    return _dict_entries(_tensor_dict(_load_pt(path), path), path, rank)


def _bin_index(index_path: str, rank: int = 0) -> list[Entry]:
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FFDebugError(f"{index_path}: not a valid shard index ({short_reason(err)})") from None
    folder = os.path.dirname(index_path)
    entries = []
    for shard in dict.fromkeys(weight_map.values()):
        path = os.path.join(folder, shard)
        if not os.path.exists(path):
            raise FFDebugError(f"{index_path}: shard {shard} is missing from {folder}")
        entries.extend(_pt_entries(path, rank))
    return entries


# ------------------------------------------------------------------------------------------------
# weight dump stores


def _dump_entries(path: str) -> tuple[list[Entry], int, str | None]:
    """(entries, world size, the layer selection the dump was written with, if any)."""
    from ffdebug.store.reader import open_side

    store = open_side(path)
    records = [r for r in store.records if r.get("io") == "weight"]
    if not records:
        raise FFDebugError(
            f"{path}: this store holds no weight records (io=weight); pass the weights/ folder written "
            "by maybe_dump_weights_and_exit (FFDEBUG_WEIGHT_DUMP_DIR/weights)"
        )
    entries = []
    world = 1
    for rec in records:
        if not rec.has_payload:
            raise FFDebugError(
                f"{path}: {rec.key} (rank {rec.get('rank')}) has no payload; re-run the weight dump"
            )
        rank = int(rec.get("rank") or 0)
        world = max(world, int(rec.get("world_size") or 1), rank + 1)
        layer = rec.get("layer")
        entries.append(
            Entry(
                rec.key,
                tuple(rec.get("shape") or ()),
                rec.get("dtype") or "float32",
                rec.load,
                rank=rank,
                layer=layer if layer is not None else layer_of(rec.key),
                shard=rec.get("shard"),
                origin=rec.rank_dir or path,
                persistent=rec.get("persistent"),
            )
        )
    env = store.run.get("env") if isinstance(store.run, dict) else None
    env = env if isinstance(env, dict) else {}
    spec = env.get("FFDEBUG_WEIGHT_DUMP_LAYERS") or env.get("ATOM_WEIGHT_DUMP_LAYERS")
    return entries, world, spec if isinstance(spec, str) and spec.strip() not in ("", "all") else None


def _is_store(path: str) -> bool:
    return os.path.exists(os.path.join(path, "run.json")) or bool(
        glob.glob(os.path.join(path, "rank*", "manifest.jsonl"))
    )


# ------------------------------------------------------------------------------------------------
# folders


def _folder_kind(path: str, weights_file: str) -> str:
    if os.path.basename(weights_file).startswith("diffusion_pytorch_model"):
        return "diffusers"
    return "hf-index" if weights_file.endswith(".index.json") else "hf-folder"


def _pipeline_components(path: str) -> list[str]:
    out = []
    for name in sorted(os.listdir(path)):
        sub = os.path.join(path, name)
        if os.path.isdir(sub) and any(
            f.endswith((".safetensors", ".bin", ".index.json")) for f in os.listdir(sub)
        ):
            out.append(name)
    return out


def _rank_number(name: str) -> int | None:
    m = _RANK.search(name)
    return int(m.group(1)) if m else None


def _single_folder(path: str, rank: int = 0, generic: bool = True) -> tuple[list[Entry], str] | None:
    """Entries of a model / component folder, or None when it holds no known weight file.

    `generic` also accepts any `*.safetensors` files (all of them) or a single `.pt`/`.bin`.
    """
    for name in _SAFETENSORS_INDEXES:
        p = os.path.join(path, name)
        if os.path.exists(p):
            return _safetensors_index(p, rank), _folder_kind(path, p)
    for name in _SAFETENSORS_SINGLE:
        p = os.path.join(path, name)
        if os.path.exists(p):
            return SafetensorsFile(p).entries(rank), _folder_kind(path, p)
    for name in _BIN_INDEXES:
        p = os.path.join(path, name)
        if os.path.exists(p):
            return _bin_index(p, rank), _folder_kind(path, p)
    for name in _BIN_SINGLE:
        p = os.path.join(path, name)
        if os.path.exists(p):
            return _pt_entries(p, rank), _folder_kind(path, p)
    if not generic:
        return None
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        entries = []
        for f in files:
            entries.extend(SafetensorsFile(f).entries(rank))
        _check_unique(entries, path)
        return entries, "safetensors-folder"
    pts = sorted(f for ext in ("*.pt", "*.pth", "*.bin") for f in glob.glob(os.path.join(path, ext)))
    if len(pts) == 1:
        return _pt_entries(pts[0], rank), "pt"
    return None


def _check_unique(entries: list[Entry], where: str) -> None:
    seen: dict[tuple[str, int], str] = {}
    for e in entries:
        key = (e.name, e.rank)
        if key in seen:
            raise FFDebugError(
                f"{where}: tensor {e.name} appears in both {seen[key]} and {e.origin}; "
                "pass one file (or add a shard index)"
            )
        seen[key] = e.origin


def _per_rank(path: str) -> tuple[list[Entry], int] | None:
    """`rank0/`, `rank1/`… sub-folders or `*rank0*.safetensors`… files: one checkpoint per rank."""
    subdirs = {}
    files = {}
    for name in os.listdir(path):
        r = _rank_number(name)
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
    entries: list[Entry] = []
    for r in ranks:
        if subdirs:
            got = _single_folder(subdirs[r], r)
            if got is None:
                raise FFDebugError(f"{subdirs[r]}: no weight file for rank {r}")
            entries.extend(got[0])
        else:
            for f in sorted(files[r]):
                entries.extend(
                    SafetensorsFile(f).entries(r) if f.endswith(".safetensors") else _pt_entries(f, r)
                )
    _check_unique(entries, path)
    return entries, len(ranks)


def _open_dir(path: str) -> WeightSource:
    if _is_store(path):
        entries, world, spec = _dump_entries(path)
        return WeightSource(path, "weight-dump", entries, world, spec)
    if _is_store(os.path.join(path, "weights")):
        sub = os.path.join(path, "weights")
        entries, world, spec = _dump_entries(sub)
        return WeightSource(sub, "weight-dump", entries, world, spec)
    if os.path.exists(os.path.join(path, "model_index.json")):
        comps = _pipeline_components(path)
        example = os.path.join(path, comps[0]) if comps else os.path.join(path, "transformer")
        raise FFDebugError(
            f"{path}: is a diffusers pipeline (model_index.json); pass one component folder, e.g. "
            f"{example} (components with weights: {', '.join(comps) or 'none'})"
        )
    got = _single_folder(path, generic=False)
    if got is not None:
        return WeightSource(path, got[1], got[0])
    ranked = _per_rank(path)
    if ranked is not None:
        return WeightSource(path, "per-rank", ranked[0], ranked[1])
    got = _single_folder(path)
    if got is not None:
        return WeightSource(path, got[1], got[0])
    raise FFDebugError(
        f"{path}: no weights found; expected model.safetensors[.index.json], "
        "diffusion_pytorch_model.safetensors, pytorch_model.bin, *.safetensors, or a weight dump store"
    )


# ------------------------------------------------------------------------------------------------
# Python entries


# ------------------------------------------------------------------------------------------------


def open_source(x, label: str = "input") -> WeightSource:
    """Open one side of a weights diff (see the module docstring for the accepted kinds)."""
    import torch

    if isinstance(x, WeightSource):
        return x
    if isinstance(x, torch.nn.Module):
        return WeightSource(f"<{type(x).__name__}>", "module", _dict_entries(x.state_dict(), label))
    if isinstance(x, dict):
        return WeightSource(f"<{label} dict>", "state-dict", _dict_entries(_tensor_dict(x, label), label))
    if not isinstance(x, (str, os.PathLike)):
        raise FFDebugError(f"{label}: cannot read {type(x).__name__}; pass a path, a module or a state dict")
    path = os.fspath(x)
    if os.path.isdir(path):
        return _open_dir(path)
    if os.path.isfile(path):
        if path.endswith(".index.json"):
            if path.endswith(".bin.index.json"):
                return WeightSource(path, "hf-index", _bin_index(path))
            return WeightSource(path, "hf-index", _safetensors_index(path))
        if path.endswith(".safetensors"):
            return WeightSource(path, "safetensors", SafetensorsFile(path).entries())
        if path.endswith((".pt", ".pth", ".bin")):
            return WeightSource(path, "pt", _pt_entries(path))
        raise FFDebugError(
            f"{path}: unknown checkpoint kind; pass a .safetensors / .pt / .bin file, a model folder, "
            "a *.index.json, a weight dump folder or module:function"
        )
    if is_entry_spec(path):
        obj = call_entry(path)
        if not isinstance(obj, (torch.nn.Module, dict)):
            raise FFDebugError(
                f"{path}: returned {type(obj).__name__}; return an nn.Module or a dict of tensors"
            )
        src = open_source(obj, label=path)
        src.path, src.kind = path, "entry"
        return src
    raise FFDebugError(f"{path}: no such file or directory (nor a module:function entry)")


def checkpoint_side_store(path: str):
    """A `SideStore` view of a checkpoint folder or index (for `ffdebug inspect`), else None.

    Only for kinds the store reader does not open itself: model / component folders and shard
    indexes. Payloads are loaded one at a time when a record is read.
    """
    from ffdebug.store.reader import SideStore

    path = os.fspath(path)
    if os.path.isfile(path):
        if not path.endswith(".index.json"):
            return None
    elif not os.path.isdir(path) or _is_store(path) or _is_store(os.path.join(path, "weights")):
        return None
    else:
        known = (
            _SAFETENSORS_INDEXES + _SAFETENSORS_SINGLE + _BIN_INDEXES + _BIN_SINGLE + ("model_index.json",)
        )
        if not any(os.path.exists(os.path.join(path, n)) for n in known) and not glob.glob(
            os.path.join(path, "*.safetensors")
        ):
            return None  # e.g. a folder of ATOM .pt dumps: the store reader imports those
    src = open_source(path)
    records = []
    for seq, e in enumerate(src.entries):
        fields = {
            "key": e.name,
            "seq": seq,
            "side": os.path.basename(os.path.normpath(path)),
            "rank": e.rank,
            "world_size": src.world_size,
            "layer": e.layer,
            "io": "weight",
            "dtype": e.dtype,
            "shape": list(e.shape),
            "stats": None,
            "shard": e.shard,
            "file": None,
            "tensor": None,
        }
        records.append(_LazyRecord(fields, e.loader))
    return SideStore(path=src.path, records=records, run={"side": src.kind}, kind=src.kind)


class _LazyRecord:
    """Record-like view of an entry: manifest fields plus a one-tensor loader."""

    def __init__(self, fields: dict, loader) -> None:
        self.fields = fields
        self._loader = loader

    key = property(lambda self: self.fields["key"])
    has_payload = True

    def __getitem__(self, name):
        return self.fields.get(name)

    def get(self, name, default=None):
        return self.fields.get(name, default)

    def __getattr__(self, name: str):
        if name.startswith("_") or name == "fields":
            raise AttributeError(name)
        value = self.__dict__["fields"].get(name)
        if value is None and name in ("rank", "invocation"):
            return 0
        if value is None and name in ("step", "extra"):
            return {}
        return value

    def verify(self) -> None:
        """Headers were validated when the checkpoint was opened."""

    def load(self):
        return self._loader()
