"""Generated hostile stores and CLI arguments: every run ends with an exit code in 0-4, a one-line
error for exit 2 / 3, no traceback, no hang, and no file opened outside its input
(docs/architecture.md, "Hostile stores"; the cases are in `cases.py`)."""

from __future__ import annotations

import os
import shutil
import signal
import sys

import pytest
import torch
from audit import recording
from cases import cli_cases, prepare_outside, store_cases
from typer.testing import CliRunner

import ffdebug
from ffdebug.cli.app import app

CASE_TIMEOUT_S = 20
STORE_CASES = store_cases()
CLI_CASES = cli_cases()
# Files Python and its libraries may open while a command runs (imports, locale data).
_ALLOWED_PREFIXES = tuple(
    os.path.realpath(p) + os.sep
    for p in {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        os.path.dirname(os.path.dirname(ffdebug.__file__)),
    }
)


def _dump(directory, side: str, bug: bool = False) -> None:
    g = torch.Generator().manual_seed(0)
    with ffdebug.capture(None, dir=directory, side=side):
        ffdebug.tap("embed.input_ids", torch.tensor([[1, 2, 3, 4]]), input_ids=True)
        h = torch.randn(2, 8, generator=g)
        ffdebug.tap("L000.attn_out", h, layer=0)
        ffdebug.tap("L000.ffn_out", h * (1.5 if bug else 1.0), layer=0)
        ffdebug.tap("final.logits", h.sum(0))


@pytest.fixture(scope="session")
def base_dump(tmp_path_factory):
    d = tmp_path_factory.mktemp("base") / "dump"
    _dump(d, "ref")
    _dump(d, "target")
    runner = CliRunner()
    for argv in (["inspect", str(d / "target")], ["compare", str(d / "ref"), str(d / "target")]):
        r = runner.invoke(app, argv)  # warm up: imports happen before anything is recorded
        assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["bisect", str(d / "ref"), str(d / "target")])
    assert r.exit_code in (0, 1), r.output
    return d


class Hung(Exception):
    pass


def _alarm(signum, frame):
    raise Hung(f"a command ran past {CASE_TIMEOUT_S} s")


def _inside(path: str, roots: list[str]) -> bool:
    full = os.path.normpath(os.path.abspath(path))
    real = os.path.realpath(os.path.dirname(full))
    if full.startswith(_ALLOWED_PREFIXES) or real.startswith(_ALLOWED_PREFIXES):
        return True
    return any(full == r or full.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def run_checked(argv: list[str], roots: list[str], forbidden: str):
    """Run the CLI in process under the audit hook and the alarm; assert the contract."""
    runner = CliRunner()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_TIMEOUT_S)
    try:
        with recording() as opened:
            result = runner.invoke(app, argv)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    shown = f"argv={argv!r}\n--- output ---\n{result.output[-3000:]}"
    exc = result.exception
    assert exc is None or isinstance(exc, SystemExit), f"{type(exc).__name__}: {exc}\n{shown}"
    assert 0 <= result.exit_code <= 4, shown
    assert "Traceback" not in result.output, shown
    if result.exit_code in (2, 3):
        err = result.stderr.strip()
        assert err.startswith("ffdebug: error:") and len(err.splitlines()) == 1, shown
    outside = [p for p in opened if not _inside(p, roots)]
    assert not outside, f"opened outside the input: {outside[:5]}\n{shown}"
    assert not any(os.path.abspath(p).startswith(forbidden) for p in opened), shown
    return result


def _case_dirs(tmp_path, base_dump):
    dump = tmp_path / "dump"
    shutil.copytree(base_dump, dump, symlinks=True)
    outside = tmp_path / "outside"
    prepare_outside(str(outside))
    return str(dump), str(outside)


@pytest.mark.parametrize("case", STORE_CASES, ids=[c.name for c in STORE_CASES])
def test_store_mutation(case, tmp_path, base_dump):
    dump, outside = _case_dirs(tmp_path, base_dump)
    case.apply(dump, outside)
    target, ref = os.path.join(dump, "target"), os.path.join(dump, "ref")
    for argv in (["inspect", target], ["inspect", target, "--json"], ["compare", ref, target]):
        run_checked(argv, [dump], outside + os.sep)
    assert not os.path.exists(os.path.join(outside, "pwned")), "a pickle executed code"


@pytest.mark.parametrize("name,build", CLI_CASES, ids=[n for n, _ in CLI_CASES])
def test_cli_arguments(name, build, tmp_path, base_dump):
    dump, outside = _case_dirs(tmp_path, base_dump)
    argv = build(dump, outside)
    roots = [dump]
    if "--html" in argv:  # the report the user asked for is written there
        roots.append(os.path.dirname(os.path.abspath(argv[argv.index("--html") + 1])))
    for a in argv:
        if os.path.isabs(a) and a.startswith(outside):
            roots.append(os.path.dirname(a) if a.endswith((".json", ".html")) else a)
    run_checked(argv, roots, os.path.join(outside, "secret.safetensors"))
    assert not os.path.exists(os.path.join(outside, "pwned")), "a pickle executed code"
