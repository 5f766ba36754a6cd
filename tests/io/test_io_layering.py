"""Import layering read from the source (AST, function-level imports included): the store reader and
the importers do not import each other, and analysis does not import rendering."""

from __future__ import annotations

import ast
import pathlib

import pytest
from helpers.sources import parsed

import ffdebug

ROOT = pathlib.Path(ffdebug.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.Module) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in out if m == "ffdebug" or m.startswith("ffdebug.")}


GRAPH = {_module_name(s.path): _imports(s.tree) for s in parsed(ROOT)}


def _reaches(start: str, target: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        for dep in GRAPH.get(m, ()):
            if dep == target:
                return True
            if dep in GRAPH and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return False


def test_reader_and_importers_do_not_import_each_other():
    reader, importers = "ffdebug.store.reader", "ffdebug.store.importers"
    assert importers not in GRAPH[reader] and reader not in GRAPH[importers]
    assert not _reaches(reader, importers), "store.reader reaches store.importers through imports"
    assert not _reaches(importers, reader), "store.importers reaches store.reader through imports"


def test_one_torch_load():
    """Only ffdebug/io/torchfile.py calls torch.load, and always with weights_only=True."""
    calls = []
    for source in parsed(ROOT):
        for node in ast.walk(source.tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "load"
            ):
                if isinstance(node.func.value, ast.Name) and node.func.value.id == "torch":
                    kw = {k.arg: k.value for k in node.keywords}
                    only = kw.get("weights_only")
                    calls.append(
                        (_module_name(source.path), isinstance(only, ast.Constant) and only.value is True)
                    )
    assert calls == [("ffdebug.io.torchfile", True)]


ANALYSIS = ["store", "io", "weights", "comparison"]


@pytest.mark.parametrize(
    "package",
    [
        *ANALYSIS,
        "bisection",
        "hunt",
    ],
)
def test_analysis_does_not_import_report(package):
    assert (ROOT / package).is_dir(), f"ffdebug/{package}/ is gone: update this list"
    offenders = sorted(
        m
        for m, deps in GRAPH.items()
        if m.startswith(f"ffdebug.{package}.") or m == f"ffdebug.{package}"
        if any(d == "ffdebug.report" or d.startswith("ffdebug.report.") for d in deps)
    )
    assert offenders == []
