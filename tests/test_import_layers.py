"""No import cycle among capture/, weights/ and comparison/, counting every import: module-level and
inside functions (tests/test_architecture.py's cycle check reads module-level imports only, so a
lower layer may reach up lazily there; between these three it may not). What two of them share
sits below all three (`ffdebug/name_rules.py`, `ffdebug/count_sketch.py`; docs/architecture.md)."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterable

from helpers.sources import imported_module, is_type_checking, module_name, parsed

import ffdebug

PACKAGE = pathlib.Path(ffdebug.__file__).parent
UNITS = ("capture", "weights", "comparison")

# (importing unit, imported unit) -> the import statements making that edge, as 'file:line what'
Edges = dict[tuple[str, str], list[str]]


def _all_imports(tree: ast.Module, module: str, is_package: bool) -> list[tuple[int, str, list[str]]]:
    """(line, absolute module, names) of every import statement anywhere in `tree` (functions,
    classes, try / with blocks included), except under `if TYPE_CHECKING:` (its `else` counts)."""
    out: list[tuple[int, str, list[str]]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, imported_module(node, module, is_package), [a.name for a in node.names]))
        elif isinstance(node, ast.If) and is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "ffdebug" and len(parts) > 1 and parts[1] in UNITS else None


def _edges(sources: Iterable[tuple[str, ast.Module]]) -> Edges:
    """The import edges between UNITS, from (path relative to the package's parent, tree) pairs."""
    edges: Edges = {}
    for rel, tree in sources:
        module, is_package = module_name(pathlib.PurePosixPath(rel))
        src = _unit(module)
        if src is None:
            continue
        for line, imported, names in _all_imports(tree, module, is_package):
            dst = _unit(imported)
            if dst is not None and dst != src:
                what = imported + (f" ({', '.join(names)})" if names else "")
                edges.setdefault((src, dst), []).append(f"{rel}:{line} {what}")
    return edges


def _simple_cycles(edges: Edges) -> list[list[str]]:
    """Every elementary cycle of the unit graph, each once, starting at its least unit."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    found: list[list[str]] = []

    def walk(start: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(path[-1], ())):
            if nxt == start:
                found.append(list(path))
            elif nxt > start and nxt not in path:
                walk(start, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def _cycle_report(edges: Edges) -> str:
    """'' when the units form no cycle, else each cycle with the import statements of its edges."""
    out = []
    for cycle in _simple_cycles(edges):
        out.append("cycle: " + " -> ".join(cycle + [cycle[0]]))
        for a, b in zip(cycle, cycle[1:] + cycle[:1]):
            out.extend(f"  {a} -> {b}: {site}" for site in edges[(a, b)])
    return "\n".join(out)


def _package_sources() -> list[tuple[str, ast.Module]]:
    return [(s.path.relative_to(PACKAGE.parent).as_posix(), s.tree) for s in parsed(PACKAGE)]


def test_no_import_cycle_among_capture_weights_comparison():
    """capture, weights and comparison import each other without a cycle, function-level imports
    included: move what two of them share below all three rather than import it lazily."""
    report = _cycle_report(_edges(_package_sources()))
    assert not report, (
        "import cycles among ffdebug/capture, ffdebug/weights and ffdebug/comparison (imports "
        "inside functions count here):\n" + report
    )


def test_import_cycle_check_can_fail():
    """A planted capture -> weights (inside a function) -> comparison -> capture loop is found and
    each edge named by file:line; TYPE_CHECKING imports and a chain are not cycles."""
    planted = {
        "ffdebug/capture/a.py": "def f():\n    from ffdebug.weights.names import parse_map\n",
        "ffdebug/weights/b.py": "import os\n\nfrom ..comparison import metrics\n",
        "ffdebug/comparison/c.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import ffdebug.weights\n"
            "class C:\n    def g(self):\n        import ffdebug.capture.stage_map\n"
        ),
    }
    edges = _edges((rel, ast.parse(text)) for rel, text in planted.items())
    assert ("comparison", "weights") not in edges
    assert _simple_cycles(edges) == [["capture", "weights", "comparison"]]
    report = _cycle_report(edges)
    assert "capture -> weights -> comparison -> capture" in report
    assert "ffdebug/capture/a.py:2 ffdebug.weights.names (parse_map)" in report
    assert "ffdebug/weights/b.py:3 ffdebug.comparison (metrics)" in report
    assert "ffdebug/comparison/c.py:6 ffdebug.capture.stage_map" in report

    chain = {k: v for k, v in planted.items() if not k.startswith("ffdebug/comparison")}
    assert _cycle_report(_edges((rel, ast.parse(text)) for rel, text in chain.items())) == ""
    two = _simple_cycles({("a", "b"): [], ("b", "a"): [], ("b", "c"): [], ("c", "a"): []})
    assert two == [["a", "b"], ["a", "b", "c"]]
