"""`ffdebug review`'s generic checks run through ruff and bandit and flag the lines the AST checks did."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ffdebug.cli.app import app
from ffdebug.review import tools
from ffdebug.review.runner import ReviewConfig, review

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures" / "review"
runner = CliRunner()
REAL_COMMAND = tools.command
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
    assert report.not_run == {}
    assert {t.name: t.error for t in report.tools} == {"ruff": None, "bandit": None}
    # every moved finding came from its tool's rules, except the one bandit cannot resolve
    via = {
        (Path(f.path).name, f.line, f.check): f.message.rsplit("(", 1)[-1]
        for f in report.findings
        if f.check in MOVED
    }
    assert via[("silent_except.py", 20, "silent-except")] == "ruff BLE001, S110)"
    assert via[("public_api.py", 15, "public-api-typed")] == "ruff ANN001, ANN201)"
    assert via[("public_api.py", 15, "public-api-docstring")] == "ruff D103)"
    assert via[("torch_load.py", 19, "torch-load-weights-only")] == "bandit B614)"
    assert (
        via[("torch_load_from.py", 8, "torch-load-weights-only")] == "B614 misses it: no `import torch` here)"
    )
    assert sum(v.startswith(("ruff ", "bandit ")) for v in via.values()) == len(RECORDED) - 1


def test_tools_ignore_the_projects_lint_settings_and_suppressions(tmp_path, monkeypatch):
    """ruff runs --isolated and ignores `# noqa`, bandit ignores `# nosec`: only `# ffdebug: ignore`
    silences a review finding. bandit adds torch.serialization.load, which the AST check missed."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.ruff.lint]\nignore = ["ALL"]\n[tool.bandit]\nskips = ["B614"]\n'
    )
    (tmp_path / "mod.py").write_text(
        '"""Doc."""\n\nimport torch\n\n\n'
        "def f(p: str) -> object:\n"
        '    """Doc."""\n'
        "    try:\n"
        "        return torch.serialization.load(p)  # nosec\n"
        "    except:  # noqa: E722\n"
        "        return None\n"
    )
    monkeypatch.chdir(tmp_path)
    report = review(["mod.py"], config=ReviewConfig())
    assert {(f.line, f.check) for f in report.findings} == {
        (9, "torch-load-weights-only"),
        (10, "silent-except"),
    }


def _missing(*names: str):
    """`tools.command` as in an environment without `names` installed."""
    return lambda name: None if name in names else REAL_COMMAND(name)


def test_a_missing_tool_leaves_its_checks_not_run_never_passed(monkeypatch):
    monkeypatch.chdir(ROOT)
    clean = "fixtures/review/license_present.py"  # breaks no rule
    monkeypatch.setattr(tools, "command", _missing("ruff"))
    report = review([clean], config=ReviewConfig())
    hint = "ruff not found: pip install 'ffdebug[review]'"
    assert report.not_run == dict.fromkeys(
        ("silent-except", "public-api-typed", "public-api-docstring"), hint
    )
    assert not report.findings and not report.passed
    status = {i.id: i.status for i in report.checklist}
    assert status["pc.no-silent-fallback"] == "not-run"  # component-hasattr ran and passed: still not ticked
    assert status["pc.typed"] == status["pc.docstrings"] == "not-run"
    assert status["pc.safe-load"] == "ticked"  # bandit ran
    r = runner.invoke(app, ["review", clean])
    text = " ".join(r.output.split())
    assert r.exit_code == 1
    assert hint in text and "not run" in text and "INCOMPLETE" in text and "PASSED" not in text
    out = json.loads(runner.invoke(app, ["review", clean, "--json"]).output)
    assert {c["id"]: c["status"] for c in out["checks"]}["silent-except"] == "not-run"
    assert out["passed"] is False
    md = runner.invoke(app, ["review", clean, "--format", "md"]).output
    assert f"_(auto: not run: {hint})_" in md and "INCOMPLETE" in md
    # bandit missing: only its check is not run; disabling it is the way to accept that
    monkeypatch.setattr(tools, "command", _missing("bandit"))
    report = review([clean], config=ReviewConfig())
    assert list(report.not_run) == ["torch-load-weights-only"]
    assert runner.invoke(app, ["review", clean, "--disable", "torch-load-weights-only"]).exit_code == 0


def test_a_failing_tool_is_reported_with_its_message(monkeypatch):
    monkeypatch.chdir(ROOT)
    broken = [sys.executable, "-c", "import sys; sys.stderr.write('error: no such rule\\n'); sys.exit(2)"]
    monkeypatch.setattr(tools, "command", lambda name: broken if name == "ruff" else None)
    report = review(["fixtures/review/silent_except.py"], config=ReviewConfig())
    assert report.not_run["silent-except"] == "ruff failed (exit 2): error: no such rule"
    assert report.not_run["torch-load-weights-only"].startswith("bandit not found")
    assert not any(f.check == "silent-except" for f in report.findings)
