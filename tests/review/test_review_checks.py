"""`ffdebug review`: each fixture in fixtures/review/ is flagged exactly at its `# expect:` lines."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ffdebug.cli.app import app
from ffdebug.review.checks import CHECKS
from ffdebug.review.runner import ReviewConfig, review

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures" / "review"
EXPECT = re.compile(r"#\s*expect:\s*([a-z0-9, -]+)")
runner = CliRunner()


def expected(paths: list[Path]) -> set[tuple[str, int, str]]:
    out = set()
    for p in paths:
        for lineno, line in enumerate(p.read_text().splitlines(), start=1):
            m = EXPECT.search(line)
            if m:
                for cid in m.group(1).split(","):
                    out.add((p.name, lineno, cid.strip()))
    return out


def found(report) -> set[tuple[str, int, str]]:
    return {(Path(f.path).name, f.line, f.check) for f in report.findings}


LICENSE = ReviewConfig(license_header="SPDX-License-Identifier: Apache-2.0", license_scope="all")


@pytest.mark.parametrize(
    "fixture",
    sorted(p.name for p in FIXTURES.glob("*.py")),
)
def test_fixture_flagged_at_expected_lines(fixture, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = FIXTURES / fixture
    report = review([str(path)], config=LICENSE if fixture.startswith("license") else ReviewConfig())
    assert found(report) == expected([path])


def test_trainer_checks_across_files(monkeypatch):
    monkeypatch.chdir(ROOT)
    algos = FIXTURES / "trainers" / "algos.py"
    report = review([str(algos)], config=ReviewConfig())
    assert found(report) == expected([algos])
    # the whole package: base.py is clean, findings stay where they are
    report = review([str(FIXTURES / "trainers")], config=ReviewConfig())
    assert found(report) == expected([algos])


def test_every_check_has_a_fixture_that_breaks_it():
    ids = {cid for _, _, cid in expected([*FIXTURES.glob("*.py"), *FIXTURES.glob("trainers/*.py")])}
    assert ids == set(CHECKS)


def test_suppression_is_counted():
    report = review([str(FIXTURES / "suppressed.py")], config=ReviewConfig())
    assert report.suppressed == 1
    assert len(report.findings) == 1


def test_license_header_is_configurable_and_skipped_when_unset(tmp_path, monkeypatch):
    f = tmp_path / "mod.py"
    f.write_text('"""Doc."""\n')
    report = review([str(f)], config=ReviewConfig())
    assert report.skipped["license-header"].startswith("no license header configured")
    item = next(i for i in report.checklist if i.id == "pc.license")
    assert item.status == "skipped"
    (tmp_path / "pyproject.toml").write_text('[tool.ffdebug.review]\nlicense-header = "Copyright ACME"\n')
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["review", "mod.py", "--json"])  # outside git: every file counts as new
    out = json.loads(r.output)
    assert r.exit_code == 1
    assert [(f["check"], f["line"]) for f in out["findings"]] == [("license-header", 1)]
    r = runner.invoke(app, ["review", "mod.py", "--license-header", "Doc."])
    assert r.exit_code == 0, r.output
    (tmp_path / "pyproject.toml").write_text("[tool.ffdebug.review]\nlicence = 1\n")
    r = runner.invoke(app, ["review", "mod.py"])
    assert r.exit_code == 2 and "unknown key(s) licence" in r.output


def test_cli_exit_codes_json_and_markdown(monkeypatch):
    monkeypatch.chdir(ROOT)
    bad = str(FIXTURES / "torch_load.py")
    r = runner.invoke(app, ["review", bad, "--json"])
    assert r.exit_code == 1
    out = json.loads(r.output)
    assert out["passed"] is False
    assert {c["id"]: c["status"] for c in out["checks"]}["torch-load-weights-only"] == "failed"
    item = next(i for i in out["checklist"]["items"] if i["id"] == "pc.safe-load")
    assert item["status"] == "failed" and item["findings"][0]["line"] == 9
    r = runner.invoke(app, ["review", bad])
    text = " ".join(r.output.split())
    assert "fixtures/review/torch_load.py:9" in text and "FAILED" in text
    r = runner.invoke(app, ["review", bad, "--format", "md"])
    assert "- [ ] Every torch.load passes weights_only=True. _(auto: failed)_" in r.output
    assert "- [x] No loss term is computed" in r.output
    clean = str(FIXTURES / "license_present.py")
    r = runner.invoke(app, ["review", clean])
    assert r.exit_code == 0 and "PASSED" in r.output
    r = runner.invoke(app, ["review", bad, "--disable", "torch-load-weights-only"])
    assert r.exit_code == 0
    assert runner.invoke(app, ["review", "no/such/path.py"]).exit_code == 2
    assert runner.invoke(app, ["review", bad, "--disable", "no-such-check"]).exit_code == 2
    listing = runner.invoke(app, ["review", "--list", "--json"])
    assert {c["id"] for c in json.loads(listing.output)["checks"]} == set(CHECKS)


def test_syntax_error_is_a_usage_error(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("def f(:\n")
    r = runner.invoke(app, ["review", str(f)])
    assert r.exit_code == 2 and "broken.py:1: not valid Python" in r.output


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_diff_reviews_changed_and_untracked_files_only(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    (repo / "old.py").write_text(
        'import torch\n\n\ndef f(p: str) -> object:\n    """Old."""\n    return torch.load(p)\n'
    )
    (repo / "kept.py").write_text('"""Kept."""\n')
    _git(repo, "add", ".")
    _git(repo, "commit", "-q", "-m", "base")
    (repo / "kept.py").write_text('"""Kept, edited."""\n\ntry:\n    x = 1\nexcept:\n    x = 0\n')
    (repo / "new.py").write_text('"""New."""\n')
    monkeypatch.chdir(repo)
    config = ReviewConfig(license_header="SPDX")
    report = review([], "main", config)
    assert sorted(report.files) == ["kept.py", "new.py"]  # old.py unchanged: not reviewed
    assert found(report) == {("kept.py", 5, "silent-except"), ("new.py", 1, "license-header")}
    (repo / "pyproject.toml").write_text('[tool.ffdebug.review]\nexclude = ["new.py"]\n')
    report = review([], "main", None)
    assert sorted(report.files) == ["kept.py"]  # excluded by the project's settings
    r = runner.invoke(app, ["review", "--diff", "no-such-branch"])
    assert r.exit_code == 2 and "not a commit" in r.output
