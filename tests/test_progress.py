"""Progress of long commands (docs/cli.md "Progress"): lines on stderr without a terminal, never on
stdout, every FFDEBUG_PROGRESS_INTERVAL seconds (0: one per item); the interval validated."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time

import pytest
from helpers import hang_timeout
from typer.testing import CliRunner

from ffdebug._env import PROGRESS_INTERVAL_S, progress_interval
from ffdebug.cli.app import app
from ffdebug.errors import FFDebugError
from ffdebug.logs import PROGRESS as LOGGER
from ffdebug.report.progress import Progress, size

STAGES = 4
ROWS, COLS = 64, 32  # float32: 8 KiB per tensor, 16 KiB per stage pair


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Two sides of four float32 stages; the target's third stage is off (a real finding)."""
    import torch

    import ffdebug

    d = tmp_path_factory.mktemp("progress")
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(ROWS, COLS, generator=g) for _ in range(STAGES)]
    for side in ("ref", "target"):
        with ffdebug.capture(dir=str(d), side=side):
            for i, x in enumerate(xs):
                ffdebug.tap(f"stage{i}", -x if (side == "target" and i == 2) else x)
    return d


def _lines(messages: list[str], task: str, unit: str) -> list[tuple[int, int]]:
    """(done, total) of each progress line of `task`, checked against the documented format."""
    pattern = re.compile(
        rf"{task}: (\d+)/(\d+) {unit}(?:, [\d.]+ [KMGT]?i?B/[\d.]+ [KMGT]?i?B, [\d.]+ [KMGT]?i?B/s)?, [\d.]+ s"
    )
    out = []
    for m in messages:
        match = pattern.fullmatch(m)
        assert match, f"not a progress line: {m!r}"
        out.append((int(match.group(1)), int(match.group(2))))
    return out


def test_size_and_line_format():
    """Binary units with three digits; the line says items, bytes of the total, rate and time."""
    assert [size(512), size(9.5 * 1024), size(610 << 20), size(1 << 30)] == [
        "512 B",
        "9.5 KiB",
        "610 MiB",
        "1.0 GiB",
    ]
    p = Progress("compare", "stages", interval=0, tty=False)
    p.begin(200, 1 << 30)
    for _ in range(120):
        p.advance((610 << 20) // 120)
    line = p.line()
    assert line.startswith("compare: 120/200 stages, 610 MiB/1.0 GiB, ") and line.endswith(" s")
    p.begin(3)  # no bytes known: none shown
    assert re.fullmatch(r"compare: 0/3 stages, [\d.]+ s", p.line())


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, PROGRESS_INTERVAL_S), ("0", 0.0), ("2.5", 2.5), ("bad", None), ("-1", None), ("nan", None)],
)
def test_interval_validated(value, expected):
    env = {} if value is None else {"FFDEBUG_PROGRESS_INTERVAL": value}
    if expected is None:
        with pytest.raises(FFDebugError, match="FFDEBUG_PROGRESS_INTERVAL=.* is invalid"):
            progress_interval(env)
    else:
        assert progress_interval(env) == expected


def test_periodic_lines_stop_with_the_work(caplog):
    """Without a terminal, a positive interval gives a line per interval while the work runs, and
    none once the block has exited."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    with Progress("weights-diff", "tensors", interval=0.05, tty=False) as p:
        p.begin(2, 0)
        deadline = time.monotonic() + hang_timeout(60)  # two intervals, however busy the machine
        while len(caplog.messages) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        p.advance()
    n = len(caplog.messages)
    time.sleep(0.15)
    assert 2 <= n == len(caplog.messages)
    assert set(_lines(caplog.messages, "weights-diff", "tensors")) <= {(0, 2), (1, 2)}


def test_bar_on_a_terminal_is_shown_then_removed(capsys, caplog):
    """On a terminal a bar (rich, stderr) replaces the lines; it is gone when the work ends."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    with Progress("inspect", "tensors", interval=0, tty=True, delay=0.0) as p:
        p.begin(2, 1024)
        deadline = time.monotonic() + hang_timeout(60)
        while p._bar is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p._bar is not None
        p.advance(512)
    assert p._bar is None
    assert capsys.readouterr().out == "" and not caplog.messages


@pytest.mark.parametrize(
    ("command", "task", "unit"),
    [
        (["compare", "ref-vs-target", "--dir", "{d}", "--json"], "compare", "stages"),
        (["bisect", "--dir", "{d}", "--json"], "bisect", "stages"),
        (["inspect", "{d}/ref", "--json"], "inspect", "tensors"),
    ],
)
def test_cli_progress_every_item_stdout_unchanged(store, caplog, monkeypatch, command, task, unit):
    """FFDEBUG_PROGRESS_INTERVAL=0: one line per item on the progress logger, done counting up to
    the total; stdout is the same JSON document as without progress lines."""
    args = [a.replace("{d}", str(store)) for a in command]
    caplog.set_level(logging.INFO, logger=LOGGER)
    quiet = CliRunner().invoke(app, args)  # default interval: a fast command writes no line
    assert not caplog.messages
    monkeypatch.setenv("FFDEBUG_PROGRESS_INTERVAL", "0")
    loud = CliRunner().invoke(app, args)
    assert loud.exit_code == quiet.exit_code
    assert json.loads(loud.stdout) == json.loads(quiet.stdout)
    assert _lines(caplog.messages, task, unit) == [(i, STAGES) for i in range(1, STAGES + 1)]
    assert "KiB" in caplog.messages[-1]


def test_weights_diff_progress(tmp_path, caplog, monkeypatch):
    import torch
    from safetensors.torch import save_file

    a = {f"w{i}": torch.full((8, 8), float(i)) for i in range(3)}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file({**a, "w1": -a["w1"]}, str(tmp_path / "b.safetensors"))
    caplog.set_level(logging.INFO, logger=LOGGER)
    monkeypatch.setenv("FFDEBUG_PROGRESS_INTERVAL", "0")
    r = CliRunner().invoke(
        app, ["weights-diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "--json"]
    )
    assert r.exit_code == 1 and json.loads(r.stdout)["verdict"] != "ok"
    assert _lines(caplog.messages, "weights-diff", "tensors") == [(1, 3), (2, 3), (3, 3)]
    assert caplog.messages[-1].startswith("weights-diff: 3/3 tensors, 1.5 KiB/1.5 KiB, ")


@pytest.mark.integration
def test_progress_lines_on_real_stderr_without_a_tty(store):
    """The installed command, stderr a pipe: the lines reach stderr through the standalone
    handler, stdout stays one JSON document."""
    env = dict(os.environ, FFDEBUG_PROGRESS_INTERVAL="0")
    args = [
        sys.executable,
        "-m",
        "ffdebug.cli.app",
        "compare",
        "ref-vs-target",
        "--dir",
        str(store),
        "--json",
    ]
    r = subprocess.run(args, capture_output=True, text=True, env=env)
    assert r.returncode == 1, r.stderr
    assert json.loads(r.stdout)["verdict"] != "ok"
    lines = r.stderr.splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["ffdebug:"] * STAGES
    assert _lines([line.split(" ", 1)[1] for line in lines], "compare", "stages") == [
        (i, STAGES) for i in range(1, STAGES + 1)
    ]


@pytest.mark.parametrize(
    "command", ["compare ref-vs-target --dir {d}", "inspect {d}/ref", "bisect --dir {d}"]
)
def test_bad_interval_is_one_line_exit_2(store, monkeypatch, command):
    """A bad FFDEBUG_PROGRESS_INTERVAL stops the command before any work, naming the variable."""
    monkeypatch.setenv("FFDEBUG_PROGRESS_INTERVAL", "soon")
    r = CliRunner().invoke(app, command.format(d=store).split())
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "ffdebug: error: FFDEBUG_PROGRESS_INTERVAL='soon' is invalid: use seconds >= 0, e.g. 10 (0: a line per item)"
    ]
