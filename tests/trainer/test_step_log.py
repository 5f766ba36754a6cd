"""The trainer's per-step lines without a terminal (docs/reference-trainer.md "The reference trainer": `log.every`)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO

from reference_trainer.steplog import LOGGER, StepLog

GRPO_CONFIG = REPO / "examples" / "grpo" / "full" / "sd3_tiny" / "default.yaml"
LINE = re.compile(
    r"reference-trainer: grpo step (\d+)/2 role=policy loss=(\S+) reward=(\S+) lr=(\S+) grad_norm=(\S+) step_time=([\d.e+-]+)s"
)


def _record(step: int, **extra: float) -> dict:
    return {
        "optimizer_step": step,
        "role": "policy",
        "loss": 0.5,
        "lr.policy": 1e-3,
        "grad_norm.policy": 2.0,
        **extra,
    }


def test_every_n_steps_with_the_window_mean_step_time(caplog, monkeypatch):
    """every=2: lines at steps 2 and 4 only; step_time is the window's seconds over its steps; a
    dataset trainer (no reward_mean) shows no reward."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    clock = iter([100.0, 103.0, 104.0, 105.0])  # created at t=100; steps 2 and 4 end at t=103, t=104
    monkeypatch.setattr("reference_trainer.steplog.time.monotonic", lambda: next(clock))
    log = StepLog("sft", every=2, max_steps=4, start_step=0)
    for step in range(1, 5):
        log.step(_record(step))
    assert caplog.messages == [
        "sft step 2/4 role=policy loss=0.5 lr=0.001 grad_norm=2 step_time=1.5s",
        "sft step 4/4 role=policy loss=0.5 lr=0.001 grad_norm=2 step_time=0.5s",
    ]
    caplog.clear()
    StepLog("sft", every=0, max_steps=4, start_step=0).step(_record(1))
    assert not caplog.messages


def test_log_every_is_validated():
    from helpers.trainer.trainer_utils import load

    from reference_trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=r"log\.every: must be >= 0, got -1"):
        load(GRPO_CONFIG, "log.every=-1")


@pytest.mark.integration
def test_trainer_logs_each_step_without_a_tty(tmp_path):
    """A tiny GRPO run with stdout and stderr piped: one line per optimizer step on stderr, whose
    numbers are the metrics.jsonl record of that step."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("FFDEBUG_", "ATOM_"))}
    args = ["train", str(GRPO_CONFIG), "--output-dir", str(tmp_path / "run"), "--max-steps", "2"]
    done = subprocess.run(
        [sys.executable, "-m", "reference_trainer", *args], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = [m for m in map(LINE.fullmatch, done.stderr.splitlines()) if m]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [int(m.group(1)) for m in lines] == [1, 2] == [r["optimizer_step"] for r in records]
    for m, r in zip(lines, records):
        expected = (r["loss"], r["reward_mean"], r["lr.policy"], r["grad_norm.policy"])
        assert tuple(float(v) for v in m.groups()[1:5]) == pytest.approx(expected, rel=1e-3)
        assert float(m.group(6)) > 0
    assert "grpo step" not in done.stdout


@pytest.mark.parametrize("is_main", [True, False])
def test_only_rank_zero_logs_steps(is_main, monkeypatch):
    """Under torchrun every rank runs the loop; only rank 0 gets a step log (stderr not a terminal)."""
    from types import SimpleNamespace

    from reference_trainer.config import LogConfig
    from reference_trainer.trainers.base import BaseTrainer

    monkeypatch.setattr(  # stderr is not a terminal, even under `pytest -s` in one
        "reference_trainer.trainers.progress.Console", lambda stderr: SimpleNamespace(is_terminal=False)
    )
    fake = SimpleNamespace(
        backend=SimpleNamespace(is_main=is_main),
        registry_name="grpo",
        config=SimpleNamespace(log=LogConfig(every=3), max_steps=9),
        optimizer_step=0,
        _step_log=None,
        _progress=None,
    )
    with BaseTrainer._progress_bar(fake):
        during = fake._step_log
    assert (isinstance(during, StepLog) and during.every == 3) if is_main else during is None
    assert fake._step_log is None
