"""Generated hostile stores and CLI arguments: every run ends with an exit code in 0-4, a one-line
error for exit 2 / 3, no traceback, no hang, and no file opened outside its input
(docs/architecture.md, "Hostile stores"; the cases are in `cases.py`)."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import zlib

import pytest
import torch
from helpers import hang_timeout
from helpers.fuzz.audit import recording
from helpers.fuzz.cases import cli_cases, prepare_outside, store_cases
from typer.testing import CliRunner

import ffdebug
from ffdebug.cli.app import app

pytestmark = (
    pytest.mark.integration
)  # every test here: a whole CLI command per generated case, with SIGALRM timeouts

CASE_TIMEOUT_S = hang_timeout(120)  # in process: one CLI command, no interpreter start-up
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


# facts about the machine, not anyone's files: compare sizes its worker pool from the tasks runnable now
_MACHINE_FACTS = ("/proc/loadavg",)


def _inside(path: str, roots: list[str]) -> bool:
    if path in _MACHINE_FACTS:
        return True
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


@pytest.fixture(scope="session")
def outside_dir(tmp_path_factory):
    """Files outside every dump (a valid tensor, FIFOs, an evil pickle): never to be opened."""
    outside = tmp_path_factory.mktemp("outside")
    prepare_outside(str(outside))
    return str(outside)


def _case_dirs(tmp_path, base_dump, outside):
    dump = tmp_path / "dump"
    shutil.copytree(base_dump, dump, symlinks=True)
    return str(dump), outside


# What `inspect TARGET` must answer for some cases: (exit code, text in the output).
EXPECT = {
    "file-parent": (2, "not a plain file name"),
    "file-absolute-fifo": (2, "not a plain file name"),
    "file-etc-passwd": (2, "not a plain file name"),
    "fifo-as-payload": (2, "a FIFO"),
    "fifo-as-manifest": (2, "a FIFO"),
    "dir-as-manifest": (2, "a directory"),
    "dir-as-status.json": (2, "a directory"),
    "devzero-as-run.json": (2, "symbolic link"),
    "outside_file-as-payload": (2, "symbolic link"),
    "outside_dir-as-rank": (2, "symbolic link"),
    "deep-line-63": (2, "deeper than 64"),
    "deep-line-62": (0, "deep"),
    "deep-run.json-100000": (2, "deeper than 64"),
    "line-over-1MiB": (2, "at most 1048576"),
    "run.json-huge": (2, "larger than"),
    "status.json-list": (2, "not a JSON object"),
    "key-len-1025": (2, "at most 1024"),
    "key-len-100k": (2, "at most 1024"),
    "key-markup-0": (0, "[/]"),
    "two-writer-ids": (2, "2 writers"),
    "second-run-appended": (2, "2 writers"),
    "duplicate-seq": (2, "appears twice"),
    "field-seq-list": (2, "'seq'"),
    "field-shape-int": (2, "'shape'"),
    "field-step-str": (2, "'step'"),
    "stats-string-value": (2, "stats.mean"),
    "stats-wrong-number": (2, "stats.mean: manifest 12345.0"),
    "shape-disagrees": (2, "disagree"),
    "payload-pickle": (2, "unreadable safetensors"),
    "payload-complex": (0, "comple"),
    "truncate-payload-20": (2, "unreadable safetensors"),
}


def test_expectations_name_real_cases():
    assert set(EXPECT) <= {c.name for c in STORE_CASES}


@pytest.mark.parametrize("case", STORE_CASES, ids=[c.name for c in STORE_CASES])
def test_store_mutation(case, tmp_path, base_dump, outside_dir):
    dump, outside = _case_dirs(tmp_path, base_dump, outside_dir)
    case.apply(dump, outside)
    target, ref = os.path.join(dump, "target"), os.path.join(dump, "ref")
    commands = [["inspect", target], ["compare", ref, target]]
    if case.name.startswith(("key", "field-key", "stats", "step")) or zlib.crc32(case.name.encode()) % 3 == 0:
        commands.append(["inspect", target, "--json"])  # (a third of the cases: the CI budget)
    for argv in commands:
        result = run_checked(argv, [dump], outside + os.sep)
        if argv == ["inspect", target] and case.name in EXPECT:
            code, needle = EXPECT[case.name]
            assert result.exit_code == code and needle in " ".join(result.output.split()), result.output
    assert not os.path.exists(os.path.join(outside, "pwned")), "a pickle executed code"


@pytest.mark.parametrize("name,build", CLI_CASES, ids=[n for n, _ in CLI_CASES])
def test_cli_arguments(name, build, tmp_path, base_dump, outside_dir):
    dump, outside = _case_dirs(tmp_path, base_dump, outside_dir)
    argv = build(dump, outside)
    roots = [dump]
    if "--html" in argv:  # the report the user asked for is written there
        roots.append(os.path.dirname(os.path.abspath(argv[argv.index("--html") + 1])))
    for a in argv:
        if os.path.isabs(a) and a.startswith(outside):
            roots.append(os.path.dirname(a) if a.endswith((".json", ".html")) else a)
    run_checked(argv, roots, os.path.join(outside, "secret.safetensors"))
    assert not os.path.exists(os.path.join(outside, "pwned")), "a pickle executed code"
