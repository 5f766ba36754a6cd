"""`ffdebug review` on this repository's own code: the reference trainer and the review tooling pass."""

from __future__ import annotations

from pathlib import Path

import pytest

from ffdebug.review.runner import ReviewConfig, review

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one

ROOT = Path(__file__).resolve().parents[2]


def _failures(report) -> str:
    return "\n".join(f"{f.location} [{f.check}] {f.message}" for f in report.findings)


def test_reference_trainer_passes_review(monkeypatch):
    monkeypatch.chdir(ROOT)
    report = review(["reference_trainer"], config=ReviewConfig())
    assert len(report.files) > 20
    assert report.passed, "ffdebug review reference_trainer:\n" + _failures(report)


def test_review_tooling_passes_its_own_review(monkeypatch):
    monkeypatch.chdir(ROOT)
    paths = [
        "ffdebug/review",
        "ffdebug/trace.py",
        "ffdebug/cli/playbook_cmd.py",
        "ffdebug/cli/introspect.py",
        "ffdebug/report/playbook_text.py",
        "ffdebug/cli/review_cmd.py",
        "ffdebug/cli/trace_cmd.py",
        "ffdebug/report/review_text.py",
        "ffdebug/report/trace_text.py",
    ]
    report = review(paths, config=ReviewConfig())
    expected = {str(p) for p in Path("ffdebug/review").rglob("*.py")} | set(paths[1:])
    assert set(report.files) == expected  # every file was reviewed: a pass over nothing is no pass
    assert report.passed, _failures(report)
