"""Importers for foreign dumps: ATOM `.pt` files and plain tensor files.

This is the one place that derives stage keys from file names, because foreign formats carry no
manifest. Every `.pt` is loaded with `torch.load(weights_only=True)`: a pickle that needs more than
tensors and containers is refused, never executed.
"""

from __future__ import annotations

import os
import re

from ffdebug.errors import FFDebugError, short_reason
from ffdebug.store.reader import Record, SideStore

# ref_layer03_Block__attn_out_rank0.pt  |  target_layer3_attn_out_rank1.pt  |  anything_else.pt
_ATOM_NAME = re.compile(
    r"^(?P<side>[A-Za-z0-9]+)_layer(?P<layer>\d+)_(?:(?P<cls>[A-Za-z0-9]+)__)?(?P<stage>.+?)(?:_rank(?P<rank>\d+))?$"
)


def load_pt_weights_only(path: str):
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise FFDebugError(
            f"{path}: refused to load: not a weights-only checkpoint ({short_reason(err)}); "
            "re-save it as a state dict of tensors or as safetensors"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise FFDebugError(f"{path}: unreadable .pt file ({short_reason(err)})") from None


def _flatten(prefix: str, obj, out: dict) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(f"{prefix}.{i}" if prefix else str(i), v, out)


def _record(key: str, tensor, seq: int, side: str, layer: int | None, rank: int, extra: dict) -> Record:
    fields = {
        "key": key,
        "seq": seq,
        "file": None,
        "tensor": None,
        "side": side,
        "rank": rank,
        "world_size": None,
        "call": None,
        "invocation": 0,
        "phase": None,
        "step": {},
        "layer": layer,
        "layer_class": None,
        "module_class": extra.get("module_class"),
        "module_path": None,
        "io": "out",
        "dtype": str(tensor.dtype).replace("torch.", ""),
        "shape": list(tensor.shape),
        "stats": None,
        "shard": None,
        "reduction": "full",
    }
    return Record(fields, None, tensor)


def import_pt_files(path: str, files: list[str]) -> SideStore:
    records: list[Record] = []
    side = os.path.basename(os.path.normpath(path))
    for file in files:
        stem = os.path.splitext(os.path.basename(file))[0]
        obj = load_pt_weights_only(file)
        tensors: dict = {}
        _flatten("", obj, tensors)
        if not tensors:
            raise FFDebugError(f"{file}: holds no tensors; not a dump")
        m = _ATOM_NAME.match(stem)
        layer = int(m.group("layer")) if m else None
        rank = int(m.group("rank")) if m and m.group("rank") else 0
        base = f"L{layer:03d}.{m.group('stage')}" if m else stem
        extra = {"module_class": m.group("cls")} if m and m.group("cls") else {}
        if m:
            side = m.group("side")
        for name, tensor in tensors.items():
            key = (
                base
                if len(tensors) == 1 and name in ("", "0")
                else (f"{base}.{name}" if len(files) > 1 or m else name)
            )
            records.append(_record(key, tensor, len(records), side, layer, rank, extra))
    return SideStore(path=path, records=records, run={"side": side}, kind="atom")


def import_safetensors_file(path: str) -> SideStore:
    from safetensors import SafetensorError, safe_open

    records: list[Record] = []
    try:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                records.append(_record(name, f.get_tensor(name), len(records), "file", None, 0, {}))
    except (SafetensorError, OSError, ValueError) as err:
        raise FFDebugError(
            f"{path}: unreadable safetensors file ({short_reason(err)}); it may be truncated"
        ) from None
    return SideStore(path=path, records=records, run={"side": os.path.basename(path)}, kind="safetensors")
