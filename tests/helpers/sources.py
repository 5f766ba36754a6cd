"""A package's own source files, read and parsed once per test session: the structural tests
(tests/test_architecture.py, tests/test_import_layers.py, tests/io/test_io_layering.py) walk the same
syntax trees, and name modules and resolve their imports the same way."""

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


def module_name(rel: pathlib.PurePath) -> tuple[str, bool]:
    """(dotted module, is a package) of a source path relative to the package's parent."""
    path = pathlib.PurePosixPath(rel).with_suffix("")
    is_package = path.name == "__init__"
    return ".".join(path.parts[:-1] if is_package else path.parts), is_package


def imported_module(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from … import`` statement of ``module`` reads (relative levels
    resolved against its package)."""
    base = node.module or ""
    if not node.level:
        return base
    parts = (module if is_package else module.rpartition(".")[0]).split(".")
    anchor = parts[: len(parts) - node.level + 1]
    return ".".join(anchor + ([base] if base else []))


def is_type_checking(test: ast.expr) -> bool:
    """An ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) test: its body never runs."""
    return (getattr(test, "id", None) or getattr(test, "attr", None)) == "TYPE_CHECKING"
