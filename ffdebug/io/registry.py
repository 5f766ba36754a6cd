"""Importers of foreign dumps and tensor files: one registration each.

`ffdebug.store.reader.open_side(path)` reads an ffdebug store itself; any other path goes to the
first registered importer whose `detect(path)` is true, and its `read(path)` returns the side as a
`SideStore` of typed `Record`s with lazy sources. A new format (a peer engine's dump) is one
`register_importer(Importer(...))` call in a module named in `BUILTIN_MODULES`; modules there are
imported the first time an importer is looked up, so the reader never imports them itself.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from ffdebug.io.side import SideStore

BUILTIN_MODULES = ("ffdebug.io.peers", "ffdebug.store.importers")


@dataclass(frozen=True)
class Importer:
    """`detect(path)`: this importer reads `path`; `read(path)`: the side it holds."""

    name: str
    detect: Callable[[str], bool]
    read: Callable[[str], SideStore]
    accepts: str = ""  # what it reads, for the "not a dump" message, e.g. "a .safetensors file"
    # formats that keep several sides in one directory (ATOM's ref_ files beside its hook files):
    # `sides(dir)` lists them, `read_side(dir, side)` reads one; `DIR/SIDE` then names that side
    sides: Callable[[str], list[str]] | None = None
    read_side: Callable[[str, str], SideStore] | None = None


_IMPORTERS: list[Importer] = []
_loaded = False


def register_importer(importer: Importer) -> Importer:
    """Add `importer` (after those already registered); a second one with its name replaces it."""
    for i, known in enumerate(_IMPORTERS):
        if known.name == importer.name:
            _IMPORTERS[i] = importer
            return importer
    _IMPORTERS.append(importer)
    return importer


def importers() -> tuple[Importer, ...]:
    """Every registered importer, in lookup order (built-in modules imported on first use)."""
    global _loaded
    if not _loaded:
        _loaded = True
        for name in BUILTIN_MODULES:
            importlib.import_module(name)
    return tuple(_IMPORTERS)


def find_importer(path: str) -> Importer | None:
    """The first importer that reads `path`, else None."""
    return next((imp for imp in importers() if imp.detect(path)), None)


def peer_sides(directory: str) -> tuple[Importer, list[str]] | None:
    """(importer, sides) when `directory` is a foreign dump keeping several sides in it."""
    for imp in importers():
        if imp.sides is not None and imp.detect(directory):
            return imp, imp.sides(directory)
    return None
