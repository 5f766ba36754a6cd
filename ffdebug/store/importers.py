"""Built-in importers of foreign dumps: ATOM `.pt` files and a plain `.safetensors` file.

This is the one place that derives stage keys from file names, because foreign formats carry no
manifest. Each importer is one `register_importer` call (`ffdebug.io.registry`); `.pt` files are
loaded by `ffdebug.io.torchfile.load_weights_only` only.
"""

from __future__ import annotations

import glob
import os
import re

from ffdebug.errors import FFDebugError
from ffdebug.io.checkpoints import dtype_name, safetensors_records
from ffdebug.io.record import Record
from ffdebug.io.registry import Importer, register_importer
from ffdebug.io.side import SideStore
from ffdebug.io.sources import InMemory
from ffdebug.io.torchfile import flatten_tensors, load_weights_only

# ref_layer03_Block__attn_out_rank0.pt  |  target_layer3_attn_out_rank1.pt  |  anything_else.pt
_ATOM_NAME = re.compile(
    r"^(?P<side>[A-Za-z0-9]+)_layer(?P<layer>\d+)_(?:(?P<cls>[A-Za-z0-9]+)__)?(?P<stage>.+?)(?:_rank(?P<rank>\d+))?$"
)
_PT = (".pt", ".pth", ".bin")


def import_pt_files(path: str, files: list[str]) -> SideStore:
    records: list[Record] = []
    side = os.path.basename(os.path.normpath(path))
    for file in files:
        stem = os.path.splitext(os.path.basename(file))[0]
        tensors = flatten_tensors(load_weights_only(file))
        if not tensors:
            raise FFDebugError(f"{file}: holds no tensors; not a dump")
        m = _ATOM_NAME.match(stem)
        layer = int(m.group("layer")) if m else None
        rank = int(m.group("rank")) if m and m.group("rank") else 0
        base = f"L{layer:03d}.{m.group('stage')}" if m else stem
        module_class = m.group("cls") if m and m.group("cls") else None
        if m:
            side = m.group("side")
        for name, tensor in tensors.items():
            key = (
                base
                if len(tensors) == 1 and name in ("", "0")
                else (f"{base}.{name}" if len(files) > 1 or m else name)
            )
            records.append(
                Record(
                    key=key,
                    seq=len(records),
                    side=side,
                    rank=rank,
                    layer=layer,
                    module_class=module_class,
                    dtype=dtype_name(tensor.dtype),
                    shape=tuple(tensor.shape),
                    source=InMemory(tensor, file),
                )
            )
    return SideStore(path=path, records=records, run={"side": side}, kind="atom")


def import_safetensors_file(path: str) -> SideStore:
    """Each tensor of the file is one record (read when loaded)."""
    records = safetensors_records(path, side="file", io="out", name_layers=False)
    return SideStore(path=path, records=records, run={"side": os.path.basename(path)}, kind="safetensors")


def _pt_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path] if path.endswith(_PT) else []
    return sorted(glob.glob(os.path.join(path, "*.pt")))


register_importer(
    Importer(
        "safetensors",
        detect=lambda p: os.path.isfile(p) and p.endswith(".safetensors"),
        read=import_safetensors_file,
        accepts="a .safetensors file",
    )
)
register_importer(
    Importer(
        "atom-pt",
        detect=lambda p: bool(_pt_files(p)),
        read=lambda p: import_pt_files(p, _pt_files(p)),
        accepts="a .pt file or a folder of ATOM .pt dumps",
    )
)
