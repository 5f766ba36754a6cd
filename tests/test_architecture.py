"""Structural rules of the package (docs/architecture.md), checked on the source itself."""

from __future__ import annotations

import ast
import pathlib

import ffdebug

PACKAGE = pathlib.Path(ffdebug.__file__).parent
SEVERITY_WORDS = {"ok", "drift", "diverge", "bug", "scramble"}
ANALYSIS = ("compare", "bisect", "weights", "store", "io")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def test_severity_words_only_in_the_verdict_module():
    """Every severity decision goes through ffdebug.verdict: no other module spells a grade."""
    found = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.value!r}"
        for path, tree in _modules()
        if path.name != "verdict.py"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in SEVERITY_WORDS
    ]
    assert not found, "severity literals outside ffdebug/verdict.py (use verdict.Severity):\n" + "\n".join(
        found
    )


def _imported_modules(tree: ast.AST, package: str) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the module's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            out.add(name)
            out.update(f"{name}.{a.name}" for a in node.names)
    return out


def test_analysis_never_imports_report():
    """compare / bisect / weights / store / io build typed results; rendering is report's."""
    offenders = []
    for path, tree in _modules():
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] not in ANALYSIS and rel.name not in ("results.py", "verdict.py"):
            continue
        package = "ffdebug." + ".".join(rel.with_suffix("").parts[:-1])
        if any(
            m == "ffdebug.report" or m.startswith("ffdebug.report.") for m in _imported_modules(tree, package)
        ):
            offenders.append(str(rel))
    assert not offenders, f"analysis modules importing ffdebug.report: {offenders}"


def test_rule_checks_can_fail(tmp_path):
    """The two checks above flag a planted literal and a planted import (they are not vacuous)."""
    tree = ast.parse('from ffdebug.report.text import fmt\nx = "bug"\n')
    assert "ffdebug.report.text" in _imported_modules(tree, "ffdebug.compare")
    assert any(isinstance(n, ast.Constant) and n.value in SEVERITY_WORDS for n in ast.walk(tree))
