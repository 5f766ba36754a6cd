"""`.pt` / `.pth` / `.bin` files: the one `torch.load` of ffdebug, always `weights_only=True`.

A pickle that needs more than tensors and containers is refused with a one-line error, never
executed. Zip-format files are memory-mapped (`mmap=True`), so a tensor's bytes are read when it
is used; legacy (non-zip) files cannot be mapped and are read whole.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ffdebug.errors import FFDebugError, short_reason


class RefusedPickle(FFDebugError):
    """`torch.load(weights_only=True)` refused the file; `needs` is the global it names."""

    def __init__(self, message: str, path: str, needs: str) -> None:
        super().__init__(message)
        self.path = path
        self.needs = needs


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_weights_only(path: str):
    """The object stored in `path`, loaded with `torch.load(weights_only=True)` on the CPU.
    A refused pickle raises `RefusedPickle` (an `FFDebugError`: one line, exit 2)."""
    import pickle
    import zipfile

    import torch

    from ffdebug.io.contained import check_regular

    check_regular(path, ".pt file")  # a FIFO or device would block torch.load
    try:
        mmap = zipfile.is_zipfile(path)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        m = _GLOBAL.search(str(err))
        raise RefusedPickle(
            f"{path}: refused to load: not a weights-only checkpoint ({short_reason(err)}); "
            "re-save it as a state dict of tensors or as safetensors",
            path,
            m.group(1) if m else short_reason(err),
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise FFDebugError(f"{path}: unreadable .pt file ({short_reason(err)})") from None


@dataclass(frozen=True)
class Refused:
    """A file of a foreign dump that a weights-only load refused, listed in coverage, never run."""

    path: str
    needs: str

    def sentence(self) -> str:
        return (
            f"{os.path.basename(self.path)} was not read: a weights-only load refuses the global "
            f"{self.needs} it needs (never unpickled)"
        )


def load_or_refused(path: str):
    """The object in `path`, or a `Refused` naming the global it needs (other errors raise)."""
    try:
        return load_weights_only(path)
    except RefusedPickle as err:
        return Refused(path, err.needs)


def flatten_tensors(obj, prefix: str = "") -> dict:
    """Every tensor of nested dicts / lists / tuples, by dotted path (`a.b.0`), in order."""
    out: dict = {}
    _flatten(prefix, obj, out)
    return out


def _is_tensor(obj) -> bool:
    """A numpy array, or a torch tensor (told without importing torch: only a program that
    imported it has one)."""
    import sys

    import numpy as np

    torch = sys.modules.get("torch")
    return isinstance(obj, np.ndarray) or (
        torch is not None and isinstance(obj, getattr(torch, "Tensor", ()))
    )


def _flatten(prefix: str, obj, out: dict) -> None:
    if _is_tensor(obj):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(f"{prefix}.{i}" if prefix else str(i), v, out)
