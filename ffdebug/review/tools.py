"""The standard linters behind review's generic checks: ruff, and bandit where it adds a rule.

Each tool runs once per review, as a subprocess of the environment ffdebug is installed in (the
script next to `sys.executable`, else `python -m TOOL`), over the reviewed files, with exactly the
rule codes the enabled checks map and isolated from the reviewed project's own settings (ruff
`--isolated --no-cache`; bandit without a config file). The tools' own suppression comments are
ignored (`# noqa`, `# nosec`): a review finding is silenced by `# ffdebug: ignore[check-id]`, which
the report counts. A tool that is not installed, or fails, leaves its checks not run, with the
reason: never passed (docs/playbooks.md "Playbooks, review and trace").
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

INSTALL = "pip install 'ffdebug[review]'"
_CHUNK = 400  # files per command line, far below any ARG_MAX
_TIMEOUT_S = 600


@dataclass(frozen=True)
class ToolHit:
    """One diagnostic of a tool: rule code, absolute path, 1-based line and column, message."""

    code: str
    path: str
    line: int
    col: int
    message: str


@dataclass(frozen=True)
class ToolRun:
    """One tool's outcome: its version and hits, or `error` saying why it did not run."""

    name: str
    codes: tuple[str, ...]
    version: str | None = None
    hits: tuple[ToolHit, ...] = ()
    error: str | None = None

    def to_json(self) -> dict:
        """Stable keys: name, version, codes, status ("ran" / "not-run"), reason."""
        return {
            "name": self.name,
            "version": self.version,
            "codes": list(self.codes),
            "status": "not-run" if self.error else "ran",
            "reason": self.error,
        }


def command(name: str) -> list[str] | None:
    """The argv prefix that runs `name` from this Python's environment; None when it is not installed."""
    script = Path(sys.executable).with_name(name + (".exe" if os.name == "nt" else ""))
    if script.is_file():
        return [str(script)]
    if importlib.util.find_spec(name) is not None:
        return [sys.executable, "-m", name]
    return None


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(name: str, argv: list[str]) -> tuple[str | None, str | None]:
    """(stdout, None) or (None, a one-line reason)."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except OSError as err:
        return None, f"{name} could not start ({err})"
    except subprocess.TimeoutExpired:
        return None, f"{name} did not finish within {_TIMEOUT_S} s"
    if proc.returncode != 0:
        first = next((line for line in proc.stderr.splitlines() if line.strip()), "no message")
        return None, f"{name} failed (exit {proc.returncode}): {first.strip()}"
    return proc.stdout, None


def run_ruff(codes: tuple[str, ...], paths: list[str]) -> ToolRun:
    """`ruff check` with exactly `codes` over `paths`; syntax errors (no code) are left to review."""
    prefix = command("ruff")
    if prefix is None:
        return ToolRun("ruff", codes, error=f"ruff not found: {INSTALL}")
    hits: list[ToolHit] = []
    for start in range(0, len(paths), _CHUNK):  # no paths: nothing to run (ruff would lint the cwd)
        argv = [
            *prefix,
            "check",
            "--isolated",
            "--no-cache",
            "--ignore-noqa",
            "--exit-zero",
            "--output-format",
            "json",
            "--select",
            ",".join(codes),
            "--",
            *paths[start : start + _CHUNK],
        ]
        out, error = _run("ruff", argv)
        if error is None:
            try:
                rows = json.loads(out or "[]")
            except json.JSONDecodeError:
                error = "ruff printed no JSON report (an old ruff? the tested range is ffdebug[review]'s)"
        if error is not None:
            return ToolRun("ruff", codes, _version("ruff"), error=error)
        hits += [
            ToolHit(
                r["code"],
                os.path.abspath(r["filename"]),
                r["location"]["row"],
                r["location"]["column"],
                r["message"],
            )
            for r in rows
            if r.get("code") in codes
        ]
    return ToolRun("ruff", codes, _version("ruff"), tuple(hits))


def run_bandit(codes: tuple[str, ...], paths: list[str]) -> ToolRun:
    """`bandit` with exactly the tests `codes` over `paths`; a file bandit cannot read is an error."""
    prefix = command("bandit")
    if prefix is None:
        return ToolRun("bandit", codes, error=f"bandit not found: {INSTALL}")
    hits: list[ToolHit] = []
    for start in range(0, len(paths), _CHUNK):
        argv = [*prefix, "-q", "-f", "json", "--exit-zero", "--ignore-nosec", "-t", ",".join(codes)]
        out, error = _run("bandit", [*argv, *paths[start : start + _CHUNK]])
        if error is None:
            try:
                data = json.loads(out or "{}")
            except json.JSONDecodeError:
                error = "bandit printed no JSON report"
            else:
                errors = data.get("errors") or []
                if errors:
                    error = f"bandit could not read {errors[0].get('filename')}: {errors[0].get('reason')}"
        if error is not None:
            return ToolRun("bandit", codes, _version("bandit"), error=error)
        hits += [
            ToolHit(
                r["test_id"],
                os.path.abspath(r["filename"]),
                r["line_number"],
                r["col_offset"] + 1,
                r["issue_text"],
            )
            for r in data.get("results", [])
            if r.get("test_id") in codes
        ]
    return ToolRun("bandit", codes, _version("bandit"), tuple(hits))


RUNNERS = {"ruff": run_ruff, "bandit": run_bandit}
