"""`ffdebug isolate`: which of several fixes matters (fix-isolation revert; docs/hunt.md "Hunt: from
symptom to root cause").

The fixes are git commits already in HEAD, or patch files applied on top of HEAD. The target runs
once with every fix and once per fix with that fix alone reverted, each in its own git worktree
under `DIR/worktrees/` (the user's checkout is never touched). Its command runs with the worktree
as working directory and `PYTHONPATH=<worktree>` first; `{worktree}` in the command is replaced by
the path. A probe on the path records where the worktree's top-level packages were imported from:
a run that imported one from elsewhere compared the wrong code and is reported.

Each run's final output (`final.*`) is compared with the all-fixes run:

| revert leaves the output        | class       |
|---------------------------------|-------------|
| outside the ok band             | critical    |
| not bit-equal, inside the ok band | fine-tuning |
| bit-equal                       | no effect   |
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field

from ffdebug.errors import FFDebugError
from ffdebug.hunt.runner import fresh_dir, run_side
from ffdebug.verdict import Severity

CRITICAL, FINE_TUNING, NO_EFFECT = "critical", "fine-tuning", "no effect"

_PROBE = """import atexit, json, os, sys
def _ffdebug_isolate_probe():
    names = [n for n in os.environ.get("FFDEBUG_ISOLATE_PACKAGES", "").split(",") if n]
    found = {n: getattr(sys.modules[n], "__file__", None) for n in names if n in sys.modules}
    with open(os.environ["FFDEBUG_ISOLATE_PROBE"], "w") as f:
        json.dump(found, f)
atexit.register(_ffdebug_isolate_probe)
"""


@dataclass(frozen=True)
class Fix:
    spec: str  # as given
    commit: str | None  # full sha, for a commit
    patch: str | None  # absolute path, for a patch file


@dataclass
class FixOutcome:
    fix: str
    effect: str  # critical | fine-tuning | no effect
    cos: float | None
    rel: float | None
    bit_equal: float | None
    severity: Severity
    outside_imports: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "fix": self.fix,
            "class": self.effect,
            "cos": self.cos,
            "rel": self.rel,
            "bit_equal": self.bit_equal,
            "severity": self.severity.value,
            "outside_imports": self.outside_imports,
        }


@dataclass
class IsolateResult:
    stage: str
    fixes: list[FixOutcome]
    all_fixes_equal_reference: bool
    reference_severity: Severity
    outside_imports: dict[str, str] = field(default_factory=dict)  # of the all-fixes run

    def to_json(self) -> dict:
        return {
            "stage": self.stage,
            "fixes": [f.to_json() for f in self.fixes],
            "all_fixes_equal_reference": self.all_fixes_equal_reference,
            "reference_severity": self.reference_severity.value,
            "outside_imports": self.outside_imports,
        }


def _git(repo: str, *args: str, what: str) -> str:
    proc = subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise FFDebugError(f"{what}: git {' '.join(args)} failed: {proc.stderr.strip()[:200]}")
    return proc.stdout.strip()


def resolve_fixes(repo: str, specs: list[str]) -> list[Fix]:
    """Each --fix as a commit in HEAD or an existing patch file (one line naming a bad one)."""
    out = []
    for spec in specs:
        if os.path.isfile(spec):
            out.append(Fix(spec, None, os.path.abspath(spec)))
            continue
        proc = subprocess.run(
            ["git", "-C", repo, "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}"],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise FFDebugError(f"--fix {spec}: neither a commit of {repo} nor a patch file")
        sha = proc.stdout.strip()
        ancestor = subprocess.run(["git", "-C", repo, "merge-base", "--is-ancestor", sha, "HEAD"])
        if ancestor.returncode != 0:
            raise FFDebugError(
                f"--fix {spec}: commit {sha[:12]} is not in HEAD; check out the branch holding every fix"
            )
        out.append(Fix(spec, sha, None))
    if not out:
        raise FFDebugError("give at least one --fix REV (a commit in HEAD or a patch file)")
    return out


def _worktree(repo: str, path: str, fixes: list[Fix], reverted: Fix | None) -> str:
    """A detached worktree of HEAD with every patch but `reverted`'s applied, and `reverted`'s
    commit reverted (uncommitted)."""
    _git(repo, "worktree", "add", "--detach", "--quiet", path, "HEAD", what="isolate")
    what = f"--fix {reverted.spec}" if reverted else "all fixes"
    for fix in fixes:
        if fix.patch and fix is not reverted:
            _git(path, "apply", fix.patch, what=what)
    if reverted is not None and reverted.commit:
        _git(
            path,
            "-c",
            "user.name=ffdebug",
            "-c",
            "user.email=ffdebug@localhost",
            "revert",
            "--no-commit",
            reverted.commit,
            what=f"{what} (revert conflicts: revert it by hand as a patch)",
        )
    return path


def top_level_packages(root: str) -> list[str]:
    """Importable names at the top of a checkout (or of its `src/`)."""
    names = []
    for base in (root, os.path.join(root, "src")):
        if not os.path.isdir(base):
            continue
        for name in sorted(os.listdir(base)):
            full = os.path.join(base, name)
            if os.path.isfile(os.path.join(full, "__init__.py")) and name.isidentifier():
                names.append(name)
    return names


def _outside(probe: str, worktree: str) -> dict[str, str]:
    try:
        with open(probe, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    root = os.path.realpath(worktree) + os.sep
    return {n: p for n, p in found.items() if p and not os.path.realpath(p).startswith(root)}


def _run_target(cfg, name: str, worktree: str, dumps: str, probe_dir: str) -> dict[str, str]:
    probe = os.path.join(dumps, f"{name}.probe.json")
    env = {
        "FFDEBUG_FWD_DUMP_DIR": dumps,
        "FFDEBUG_FWD_DUMP_SIDE": name,
        "FFDEBUG_FWD_DUMP_STAGES": "final.*",
        "FFDEBUG_ISOLATE_PACKAGES": ",".join(top_level_packages(worktree)),
        "FFDEBUG_ISOLATE_PROBE": probe,
        "PYTHONPATH": os.pathsep.join(p for p in (worktree, probe_dir, os.environ.get("PYTHONPATH")) if p),
    }
    command = cfg.target.replace("{worktree}", worktree)
    run_side(command, env, os.path.join(dumps, f"{name}.log"), f"target ({name})", cwd=worktree)
    return _outside(probe, worktree)


def _final_pair(dumps: str, a: str, b: str):
    """The final-output records of sides `a` and `b` (final.logits, else final.out, else any final.*)."""
    from ffdebug.store.reader import open_side

    ra = {r.key: r for r in open_side(os.path.join(dumps, a)).records if r.key.startswith("final.")}
    rb = {r.key: r for r in open_side(os.path.join(dumps, b)).records if r.key.startswith("final.")}
    common = [k for k in ("final.logits", "final.out") if k in ra and k in rb] or sorted(set(ra) & set(rb))
    if not common:
        raise FFDebugError(
            f"{dumps}: sides {a} and {b} share no final output (final.logits / final.out); the command "
            "must call ffdebug.install(model) and run a forward"
        )
    key = common[0]
    return key, ra[key], rb[key]


def _effect(dumps: str, base: str, other: str):
    from ffdebug.comparison.engine import compare_records

    key, ra, rb = _final_pair(dumps, base, other)
    e = compare_records(ra, rb)
    if (e.bit_equal or 0.0) >= 1.0:
        effect = NO_EFFECT
    elif e.severity is Severity.OK:
        effect = FINE_TUNING
    else:
        effect = CRITICAL
    return key, e, effect


@dataclass(frozen=True)
class IsolateConfig:
    ref: str
    target: str
    fixes: tuple[str, ...]
    dir: str
    repo: str = "."


def isolate(cfg: IsolateConfig) -> IsolateResult:
    """Run the target with all fixes and with each reverted alone; class each fix."""
    repo = _git(cfg.repo, "rev-parse", "--show-toplevel", what=f"--repo {cfg.repo}")
    fixes = resolve_fixes(repo, list(cfg.fixes))
    root = os.path.abspath(cfg.dir)
    dumps, trees = fresh_dir(os.path.join(root, "dumps")), fresh_dir(os.path.join(root, "worktrees"))
    probe_dir = fresh_dir(os.path.join(root, "probe"))
    with open(os.path.join(probe_dir, "sitecustomize.py"), "w", encoding="utf-8") as f:
        f.write(_PROBE)
    _git(repo, "worktree", "prune", what="isolate")  # forget worktrees of an earlier, killed run
    made: list[str] = []
    try:
        run_side(
            cfg.ref,
            {
                "FFDEBUG_FWD_DUMP_DIR": dumps,
                "FFDEBUG_FWD_DUMP_SIDE": "ref",
                "FFDEBUG_FWD_DUMP_STAGES": "final.*",
            },
            os.path.join(dumps, "ref.log"),
            "reference",
        )
        made.append(_worktree(repo, os.path.join(trees, "all"), fixes, None))
        outside_all = _run_target(cfg, "all", made[-1], dumps, probe_dir)
        outcomes = []
        for i, fix in enumerate(fixes):
            made.append(_worktree(repo, os.path.join(trees, f"revert-{i}"), fixes, fix))
            outside = _run_target(cfg, f"revert-{i}", made[-1], dumps, probe_dir)
            _, e, effect = _effect(dumps, "all", f"revert-{i}")
            outcomes.append(FixOutcome(fix.spec, effect, e.cos, e.rel, e.bit_equal, e.severity, outside))
        key, ref_e, _ = _effect(dumps, "ref", "all")
    finally:
        for path in made:
            subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", path], capture_output=True)
        shutil.rmtree(trees, ignore_errors=True)
        subprocess.run(["git", "-C", repo, "worktree", "prune"], capture_output=True)
    return IsolateResult(
        stage=key,
        fixes=outcomes,
        all_fixes_equal_reference=(ref_e.bit_equal or 0.0) >= 1.0,
        reference_severity=ref_e.severity,
        outside_imports=outside_all,
    )
