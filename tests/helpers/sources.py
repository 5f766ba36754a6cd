"""A package's own source files, read and parsed once per test session: the structural tests
(tests/test_architecture.py, tests/io/test_io_layering.py) walk the same syntax trees."""

from __future__ import annotations

import ast
import functools
import pathlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Source:
    """One module: its path, its text and its syntax tree."""

    path: pathlib.Path
    text: str
    tree: ast.Module


@functools.cache
def parsed(package: pathlib.Path) -> tuple[Source, ...]:
    """Every ``*.py`` under ``package`` (sorted by path), parsed."""
    out = []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        out.append(Source(path, text, ast.parse(text, filename=str(path))))
    return tuple(out)
