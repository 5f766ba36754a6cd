"""`ffdebug review`'s generic checks run through ruff and bandit and flag the lines the AST checks did."""

from __future__ import annotations

from pathlib import Path

import pytest

from ffdebug.review.runner import ReviewConfig, review

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures" / "review"
MOVED = {"silent-except", "torch-load-weights-only", "public-api-typed", "public-api-docstring"}

# (fixture, line, check) of the four generic checks on every fixture, recorded from the AST
# implementation of these checks (commit 307802b) before they moved to ruff / bandit.
RECORDED = {
    ("lint_edges.py", 8, "public-api-typed"),
    ("lint_edges.py", 14, "torch-load-weights-only"),
    ("lint_edges.py", 15, "silent-except"),
    ("lint_edges.py", 22, "public-api-typed"),
    ("lint_edges.py", 26, "public-api-typed"),
    ("lint_edges.py", 35, "silent-except"),
    ("lint_edges.py", 69, "public-api-docstring"),
    ("lint_edges.py", 77, "public-api-typed"),
    ("lint_edges.py", 82, "public-api-typed"),
    ("public_all.py", 6, "public-api-docstring"),
    ("public_all.py", 6, "public-api-typed"),
    ("public_all.py", 14, "public-api-docstring"),
    ("public_all.py", 15, "public-api-typed"),
    ("public_api.py", 6, "public-api-typed"),
    ("public_api.py", 11, "public-api-docstring"),
    ("public_api.py", 15, "public-api-docstring"),
    ("public_api.py", 15, "public-api-typed"),
    ("public_api.py", 26, "public-api-typed"),
    ("public_api.py", 30, "public-api-docstring"),
    ("public_api.py", 42, "public-api-docstring"),
    ("silent_except.py", 12, "silent-except"),
    ("silent_except.py", 20, "silent-except"),
    ("silent_except.py", 30, "silent-except"),
    ("suppressed.py", 13, "torch-load-weights-only"),
    ("torch_load.py", 9, "torch-load-weights-only"),
    ("torch_load.py", 14, "torch-load-weights-only"),
    ("torch_load.py", 19, "torch-load-weights-only"),
    ("torch_load_from.py", 8, "torch-load-weights-only"),
}


def _moved(report) -> set[tuple[str, int, str]]:
    return {
        (Path(f.path).relative_to("fixtures/review").as_posix(), f.line, f.check)
        for f in report.findings
        if f.check in MOVED
    }


def test_generic_checks_flag_the_recorded_lines(monkeypatch):
    monkeypatch.chdir(ROOT)
    report = review(["fixtures/review"], config=ReviewConfig())
    assert _moved(report) == RECORDED
