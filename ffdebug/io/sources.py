"""Lazy tensor sources: what `Record.source` holds. Each has `load()` (read the tensor now),
`verify()` (check it is readable without reading it) and `origin` (where it lives, for messages).
The folded source of several per-rank records is `ffdebug.io.ranks.Folded`."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ffdebug.arrays import as_array
from ffdebug.io.safetensors import SafetensorsFile, load_payload, verify_payload


@dataclass(frozen=True)
class StorePayload:
    """A store payload: tensor `name` of the safetensors file at `path` (opened per read)."""

    path: str
    name: str = "tensor"

    @property
    def origin(self) -> str:
        return os.path.dirname(self.path)

    def load(self):
        return load_payload(self.path, self.name)

    def verify(self) -> None:
        verify_payload(self.path)


@dataclass(frozen=True)
class FileTensor:
    """Tensor `name` of an opened `SafetensorsFile` (its header was validated at open)."""

    file: SafetensorsFile
    name: str

    @property
    def origin(self) -> str:
        return self.file.path

    def load(self):
        return self.file.get(self.name)

    def verify(self) -> None:
        """The header was validated when the file was opened."""


@dataclass(frozen=True)
class InMemory:
    """A tensor already in memory (an imported `.pt` file, a state dict, a module)."""

    value: Any = field(repr=False)
    origin: str = ""

    def load(self):
        return as_array(self.value)

    def verify(self) -> None:
        """Nothing to check: the tensor is in memory."""


@dataclass(frozen=True)
class Loader:
    """Any zero-argument callable returning the tensor."""

    fn: Callable = field(repr=False)
    origin: str = ""

    def load(self):
        return self.fn()

    def verify(self) -> None:
        """Nothing to check before loading."""
