"""`ffdebug review`: collect files, run the checks, and fill in a playbook checklist.

Files: the given paths (directories are walked for `*.py`, skipping virtualenvs, caches, build
outputs and the configured `exclude` globs; a file named explicitly is always reviewed), or with
`--diff BASE` the Python files added, copied, modified or renamed between BASE and the working tree
plus untracked ones (restricted to PATHS when both are given).

"New" files (for the license-header check): with `--diff`, files added since BASE or untracked;
without it, files untracked or staged as added in git; outside a git work tree every file is new.

Configuration, `[tool.ffdebug.review]` in the nearest `pyproject.toml` above the working directory::

    license-header = "SPDX-License-Identifier: Apache-2.0"   # unset: the license check is skipped
    license-scope = "new"        # or "all"
    license-lines = 10           # the header must appear in the first N lines
    disable = ["public-api-docstring"]
    exclude = ["fixtures/review/*"]
    playbook = "pre-commit"      # the checklist the report fills in
"""

from __future__ import annotations

import fnmatch
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ffdebug.errors import FFDebugError
from ffdebug.review.checks import CHECKS, Check, Finding
from ffdebug.review.source import SourceFile, display_path
from ffdebug.review.tools import RUNNERS, ToolRun

SKIP_DIRS = {
    ".git",
    ".venv",
    "venv",
    "__pycache__",
    "build",
    "dist",
    "node_modules",
    ".mypy_cache",
    ".ruff_cache",
}
_CONFIG_KEYS = {"license-header", "license-scope", "license-lines", "disable", "exclude", "playbook"}


@dataclass
class ReviewConfig:
    """Settings of one review run (pyproject `[tool.ffdebug.review]`, then command-line overrides)."""

    license_header: str | None = None
    license_scope: str = "new"
    license_lines: int = 10
    disable: set[str] = field(default_factory=set)
    exclude: list[str] = field(default_factory=list)
    playbook: str = "pre-commit"
    source: str | None = None  # the pyproject.toml it came from

    def validate(self) -> None:
        """Raise a usage error naming the bad setting."""
        where = self.source or "review settings"
        if self.license_scope not in ("new", "all"):
            raise FFDebugError(f"{where}: license-scope must be 'new' or 'all', got {self.license_scope!r}")
        if not isinstance(self.license_lines, int) or self.license_lines < 1:
            raise FFDebugError(
                f"{where}: license-lines must be a positive integer, got {self.license_lines!r}"
            )
        unknown = sorted(self.disable - set(CHECKS))
        if unknown:
            raise FFDebugError(
                f"{where}: unknown check id(s) to disable: {', '.join(unknown)} (see `ffdebug review --list`)"
            )


def find_pyproject(start: Path) -> Path | None:
    """The nearest pyproject.toml at or above `start`."""
    for d in [start, *start.parents]:
        candidate = d / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def load_config(start: Path | None = None) -> ReviewConfig:
    """`[tool.ffdebug.review]` of the nearest pyproject.toml (defaults when absent)."""
    path = find_pyproject((start or Path.cwd()).resolve())
    if path is None:
        return ReviewConfig()
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: settings need tomli
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            return ReviewConfig()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise FFDebugError(f"{path}: cannot read ({err})") from None
    section = data.get("tool", {}).get("ffdebug", {}).get("review", {})
    unknown = sorted(set(section) - _CONFIG_KEYS)
    if unknown:
        raise FFDebugError(
            f"{path}: [tool.ffdebug.review] has unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_CONFIG_KEYS))})"
        )
    config = ReviewConfig(
        license_header=section.get("license-header"),
        license_scope=section.get("license-scope", "new"),
        license_lines=section.get("license-lines", 10),
        disable=set(section.get("disable", [])),
        exclude=list(section.get("exclude", [])),
        playbook=section.get("playbook", "pre-commit"),
        source=str(path),
    )
    config.validate()
    return config


# ---------------------------------------------------------------------------------------------
# git


def _git(*args: str, cwd: str | None = None) -> str | None:
    try:
        proc = subprocess.run(["git", *args], capture_output=True, text=True, cwd=cwd, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _git_root() -> Path | None:
    out = _git("rev-parse", "--show-toplevel")
    return Path(out.strip()) if out else None


def _git_paths(root: Path, *args: str) -> set[str]:
    out = _git(*args, cwd=str(root)) or ""
    return {str((root / line).resolve()) for line in out.splitlines() if line.strip()}


def changed_files(base: str) -> tuple[set[str], set[str]]:
    """(changed, added) absolute paths between `base` and the working tree, untracked files included."""
    root = _git_root()
    if root is None:
        raise FFDebugError("--diff needs a git work tree (run inside the repository)")
    if _git("rev-parse", "--verify", "--quiet", f"{base}^{{commit}}") is None:
        raise FFDebugError(f"--diff {base!r}: not a commit, branch or tag in this repository")
    untracked = _git_paths(root, "ls-files", "--others", "--exclude-standard")
    changed = _git_paths(root, "diff", "--name-only", "--diff-filter=ACMR", base) | untracked
    added = _git_paths(root, "diff", "--name-only", "--diff-filter=A", base) | untracked
    return changed, added


def new_files_in_worktree() -> set[str] | None:
    """Untracked or staged-as-added files; None outside a git work tree."""
    root = _git_root()
    if root is None:
        return None
    return _git_paths(root, "ls-files", "--others", "--exclude-standard") | _git_paths(
        root, "diff", "--cached", "--name-only", "--diff-filter=A"
    )


# ---------------------------------------------------------------------------------------------
# collecting files


def _excluded(path: Path, excludes: list[str]) -> bool:
    rel = display_path(str(path))
    return any(fnmatch.fnmatch(rel, g) or fnmatch.fnmatch(path.name, g) for g in excludes)


def collect(paths: list[str], excludes: list[str]) -> list[str]:
    """Absolute paths of the Python files to review, sorted; an error naming a missing path."""
    out: set[str] = set()
    for p in paths:
        path = Path(p)
        if not path.exists():
            raise FFDebugError(f"{p}: no such file or directory")
        if path.is_file():
            if path.suffix != ".py":
                raise FFDebugError(f"{p}: not a Python file (ffdebug review reads *.py)")
            out.add(str(path.resolve()))
            continue
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(
                d
                for d in dirnames
                if d not in SKIP_DIRS
                and not d.endswith(".egg-info")
                and not _excluded(Path(dirpath) / d, excludes)
            )
            for name in filenames:
                f = Path(dirpath) / name
                if name.endswith(".py") and not _excluded(f, excludes):
                    out.add(str(f.resolve()))
    return sorted(out)


# ---------------------------------------------------------------------------------------------
# the run


class Project:
    """The scanned files, plus the files of their packages (read only to resolve names across files)."""

    def __init__(self, files: list[SourceFile], config: ReviewConfig) -> None:
        self.files = files
        self.config = config
        self._scanned = {os.path.abspath(f.path) for f in files}
        self._extra: list[SourceFile] | None = None

    def scanned(self, src: SourceFile) -> bool:
        """True when `src` is one of the files under review (findings are reported only there)."""
        return os.path.abspath(src.path) in self._scanned

    def resolution_files(self) -> list[SourceFile]:
        """Scanned files, then the other modules of each scanned file's top-level package."""
        if self._extra is None:
            roots = set()
            for f in self.files:
                d = Path(f.path).resolve().parent
                top = d
                while (top / "__init__.py").is_file() and (top.parent / "__init__.py").is_file():
                    top = top.parent
                roots.add(top if (top / "__init__.py").is_file() else d)
            extra = []
            for root in sorted(roots):
                for p in collect([str(root)], []):
                    if p not in self._scanned:
                        try:
                            extra.append(SourceFile.load(display_path(p)))
                        except FFDebugError:
                            continue  # an unparsable neighbour is not under review
            self._extra = extra
        return self.files + self._extra


@dataclass
class ChecklistItem:
    """One playbook item with the verdict of its automated checks."""

    id: str
    text: str
    checks: list[str]
    status: str  # "ticked" | "failed" | "not-run" | "human" | "skipped"
    findings: list[Finding]

    def to_json(self) -> dict:
        """Stable keys: id, text, check, status, findings."""
        return {
            "id": self.id,
            "text": self.text,
            "check": self.checks,
            "status": self.status,
            "findings": [f.to_json() for f in self.findings],
        }


@dataclass
class ReviewReport:
    """Everything `ffdebug review` prints."""

    files: list[str]
    findings: list[Finding]
    checks_run: list[str]
    skipped: dict[str, str]
    suppressed: int
    playbook: str
    checklist: list[ChecklistItem]
    base: str | None = None
    not_run: dict[str, str] = field(default_factory=dict)  # check id -> why its tool did not run
    tools: list[ToolRun] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """Every enabled check ran and none has an unsuppressed finding."""
        return not self.findings and not self.not_run

    def status(self, cid: str) -> str:
        """ "skipped", "not-run", "failed" or "passed" for the check `cid`."""
        if cid in self.skipped:
            return "skipped"
        if cid in self.not_run:
            return "not-run"
        return "failed" if any(f.check == cid for f in self.findings) else "passed"

    def to_json(self) -> dict:
        """Stable keys: passed, files, base, findings, checks, tools, suppressed, checklist."""
        return {
            "passed": self.passed,
            "files": self.files,
            "base": self.base,
            "findings": [f.to_json() for f in self.findings],
            "checks": [
                {
                    "id": cid,
                    "title": CHECKS[cid].title,
                    "status": self.status(cid),
                    "reason": self.skipped.get(cid) or self.not_run.get(cid),
                }
                for cid in CHECKS
            ],
            "tools": [t.to_json() for t in self.tools],
            "suppressed": self.suppressed,
            "checklist": {"playbook": self.playbook, "items": [i.to_json() for i in self.checklist]},
        }


@dataclass
class CheckResults:
    """The outcome of running the enabled checks over the reviewed files."""

    findings: list[Finding]
    run: list[str]
    skipped: dict[str, str]  # id -> why it was not asked for
    not_run: dict[str, str]  # id -> why its tool could not run
    suppressed: int
    tools: list[ToolRun]


def run_tools(sources: list[SourceFile], checks: list[Check]) -> dict[str, ToolRun]:
    """Each tool the `checks` are backed by, run once over `sources` with the union of their codes."""
    codes: dict[str, list[str]] = {}
    for chk in checks:
        if chk.tool is not None:
            codes.setdefault(chk.tool, []).extend(chk.codes)
    paths = [os.path.abspath(s.path) for s in sources]
    return {tool: RUNNERS[tool](tuple(dict.fromkeys(c)), paths) for tool, c in codes.items()}


def run_checks(sources: list[SourceFile], config: ReviewConfig) -> CheckResults:
    """Run every enabled check (the tool-backed ones on their tool's hits)."""
    skipped: dict[str, str] = {cid: "disabled" for cid in config.disable}
    if not config.license_header:
        skipped.setdefault(
            "license-header", "no license header configured ([tool.ffdebug.review] license-header)"
        )
    enabled = [chk for cid, chk in CHECKS.items() if cid not in skipped]
    tools = run_tools(sources, enabled)
    not_run = {c.id: tools[c.tool].error for c in enabled if c.tool and tools[c.tool].error}
    by_path = {s.path: s for s in sources}
    project = Project(sources, config)
    findings: list[Finding] = []
    suppressed = 0
    run: list[str] = []
    for chk in enabled:
        if chk.id in not_run:
            continue
        run.append(chk.id)
        if chk.tool is not None:
            raw = chk.fn(project, [h for h in tools[chk.tool].hits if h.code in chk.codes])
        elif chk.scope == "project":
            raw = chk.fn(project)
        else:
            raw = [f for s in sources for f in chk.fn(s, config)]
        for f in raw:
            src = by_path.get(f.path)
            if src is not None and src.suppressed(f.line, f.check):
                suppressed += 1
            else:
                findings.append(f)
    findings = sorted(set(findings), key=lambda f: (f.path, f.line, f.col, f.check))
    return CheckResults(findings, run, skipped, not_run, suppressed, list(tools.values()))


def checklist(
    playbook_name: str,
    findings: list[Finding],
    skipped: dict[str, str],
    not_run: dict[str, str] | None = None,
) -> list[ChecklistItem]:
    """The playbook's items, ticked / failed by their checks, not run (a tool is missing), or left for a human."""
    from ffdebug.review.playbooks import load

    not_run = not_run or {}
    items = []
    for item in load(playbook_name).items:
        hits = [f for f in findings if f.check in item.checks]
        if not item.checks:
            status = "human"
        elif hits:
            status = "failed"
        elif any(c in not_run for c in item.checks):
            status = "not-run"
        elif all(c in skipped for c in item.checks):
            status = "skipped"
        else:
            status = "ticked"
        items.append(ChecklistItem(item.id, item.text, list(item.checks), status, hits))
    return items


def review(
    paths: list[str] | None = None,
    diff_base: str | None = None,
    config: ReviewConfig | None = None,
) -> ReviewReport:
    """Review `paths` (default: the working directory) or the files changed since `diff_base`."""
    config = config or load_config()
    config.validate()
    if diff_base is not None:
        changed, added = changed_files(diff_base)
        files = sorted(p for p in changed if p.endswith(".py") and os.path.isfile(p))
        if paths:
            roots = [str(Path(p).resolve()) for p in paths]
            files = [
                f for f in files if any(f == r or f.startswith(r.rstrip(os.sep) + os.sep) for r in roots)
            ]
        files = [
            f
            for f in files
            if not any(part in SKIP_DIRS for part in Path(f).parts) and not _excluded(Path(f), config.exclude)
        ]
        new = added
    else:
        files = collect(paths or ["."], config.exclude)
        worktree_new = new_files_in_worktree()
        new = set(files) if worktree_new is None else worktree_new
    sources = [SourceFile.load(display_path(f), is_new=f in new) for f in files]
    results = run_checks(sources, config)
    return ReviewReport(
        files=[s.path for s in sources],
        findings=results.findings,
        checks_run=results.run,
        skipped=results.skipped,
        suppressed=results.suppressed,
        playbook=config.playbook,
        checklist=checklist(config.playbook, results.findings, results.skipped, results.not_run),
        base=diff_base,
        not_run=results.not_run,
        tools=results.tools,
    )
