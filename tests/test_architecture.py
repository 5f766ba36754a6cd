"""Structural rules of the package (docs/architecture.md), checked on the source itself."""

from __future__ import annotations

import ast
import pathlib

import ffdebug

PACKAGE = pathlib.Path(ffdebug.__file__).parent
SEVERITY_WORDS = {"ok", "drift", "diverge", "bug", "scramble"}


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


def test_literal_check_can_fail():
    """The check above flags a planted literal (it is not vacuous); the import rule (analysis
    never imports report) is tests/io/test_io_layering.py's."""
    tree = ast.parse('x = "bug"\n')
    assert any(isinstance(n, ast.Constant) and n.value in SEVERITY_WORDS for n in ast.walk(tree))
