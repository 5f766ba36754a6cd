"""Packaging (docs/install.md "Install and compatibility"): the built wheel's `Requires-Dist` admits the
versions an engine's environment already holds, bounds torch below its next major version, keeps
Accelerate in the `[trainer]` extra and ships `py.typed`; the two constraint files agree with the
declared ranges (CI's exact versions inside them, `constraints/lower.txt` at their lower bounds)."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
# import names that differ from the distribution's
IMPORT_NAME = {"pyyaml": "yaml", "pillow": "PIL"}


def pins(path: Path) -> dict[str, Version]:
    """`name==version` lines of a constraints file, by canonical name."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            out[canonicalize_name(name)] = Version(version)
    return out


def declared() -> dict[str, list[Requirement]]:
    """pyproject.toml's requirements by group: "core" and each extra."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups = {"core": project["dependencies"], **project["optional-dependencies"]}
    return {group: [Requirement(r) for r in reqs] for group, reqs in groups.items()}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("dist")
    try:  # the installed setuptools meets [build-system]: build without an isolated env (seconds)
        import setuptools

        flags = ["--no-build-isolation"] if Version(setuptools.__version__) >= Version("68") else []
    except ImportError:
        flags = []
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *flags, "-w", str(out), str(REPO)],
        check=True,
        capture_output=True,
    )
    (path,) = out.glob("ffdebug-*.whl")
    return zipfile.ZipFile(path)


def requires_dist(wheel: zipfile.ZipFile) -> list[Requirement]:
    (name,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    metadata = Parser().parsestr(wheel.read(name).decode())
    return [Requirement(r) for r in metadata.get_all("Requires-Dist")]


@pytest.mark.integration
def test_the_wheel_admits_an_engines_environment(wheel):
    """The versions that made the pinned install fail with ResolutionImpossible are admitted; torch
    is bounded above by a major version (an unpinned install never jumps to torch 3); Accelerate is
    only in the trainer extra; psutil (never imported) is gone; py.typed is in the wheel."""
    reqs = requires_dist(wheel)
    core = {canonicalize_name(r.name): r for r in reqs if r.marker is None}
    for name, version in (("torch", "2.12.1"), ("transformers", "5.23.0"), ("numpy", "2.3.0")):
        assert core[name].specifier.contains(version), (name, str(core[name].specifier))
    torch = core["torch"].specifier
    assert (
        torch.contains("2.13.0")
        and not torch.contains("3.0.0")
        and not torch.contains("3.0.0a1", prereleases=True)
    )
    assert any(s.operator == "<" and Version(s.version) <= Version("3") for s in torch)
    extras = {canonicalize_name(r.name): str(r.marker) for r in reqs if r.marker and "extra" in str(r.marker)}
    assert "accelerate" not in core and extras["accelerate"] == 'extra == "trainer"'
    assert "psutil" not in core and "psutil" not in extras
    assert {"ffdebug/py.typed", "reference_trainer/py.typed"} <= set(wheel.namelist())


def test_every_runtime_requirement_is_imported():
    """No requirement nobody imports: each core and trainer requirement is imported by the package."""
    sources = "\n".join(
        p.read_text(encoding="utf-8")
        for d in ("ffdebug", "reference_trainer")
        for p in (REPO / d).rglob("*.py")
    )
    groups = declared()
    for req in groups["core"] + groups["trainer"]:
        if req.marker is not None:
            continue  # a backport for older Pythons (tomli), imported in a fallback
        module = IMPORT_NAME.get(canonicalize_name(req.name), canonicalize_name(req.name).replace("-", "_"))
        assert re.search(rf"^\s*(import|from) {module}\b", sources, re.M), f"{req.name} is never imported"


def test_the_constraint_files_agree_with_the_ranges():
    """CI's exact versions lie inside the declared ranges; lower.txt holds exactly the declared
    lower bounds (torch excepted: the job runs torch 2.13.0, its bound is checked from the wheel)."""
    ci, lower = pins(REPO / "constraints/ci.txt"), pins(REPO / "constraints/lower.txt")
    for group, reqs in declared().items():
        for req in reqs:
            name = canonicalize_name(req.name)
            if group == "deepspeed" or req.marker is not None:
                continue  # not in the CI lock (docs/trainer-backends.md); backports for other Pythons
            assert req.specifier.contains(ci[name]), f"constraints/ci.txt {name}=={ci[name]} outside {req}"
            bound = [Version(s.version) for s in req.specifier if s.operator == ">="]
            assert len(bound) == 1, f"{req}: declare one lower bound"
            if name != "torch":
                assert lower.get(name) == bound[0], (
                    f"constraints/lower.txt {name}: {lower.get(name)} != {bound[0]}"
                )
    assert "torch" not in lower


def test_ddp_without_accelerate_names_the_extra(monkeypatch):
    """Accelerate is the [trainer] extra, imported only by the ddp backend: without it, one
    ConfigError naming backend.kind and the install command (the CLI prints it as one line, exit 2)."""
    import importlib.util

    from reference_trainer.distributed import require_accelerate
    from reference_trainer.errors import ConfigError

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else find_spec(name, *a)
    )
    with pytest.raises(ConfigError, match=r"backend.kind: .*accelerate.*pip install 'ffdebug\[trainer\]'"):
        require_accelerate()
