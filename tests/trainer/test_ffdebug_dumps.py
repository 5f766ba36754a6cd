"""Two trainer runs dumped with ffdebug compare ``ok``; a KL term computed under ``no_grad`` is named.

Each side runs in its own process (one process = one side, docs/dumping.md "Dumping your own runs"), configured only by env vars.
The injected bug (Flow-Factory issues #122-#124) leaves every *value* unchanged at the first step —
policy and reference coincide — and removes the KL gradient from the second step on, so the first
divergent stage is ``grad_norm.policy`` of the second optimizer step (tag ``optimizer_step=1``:
one step done).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO
from helpers.trainer.trainer_utils import GRPO_CONFIG

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one

BUGGY_DRIVER = """
import sys, torch
from reference_trainer.losses import grpo
correct_kl = grpo.sde_kl
def kl_under_no_grad(*args, **kwargs):
    with torch.no_grad():  # the one-line bug
        return correct_kl(*args, **kwargs)
grpo.sde_kl = kl_under_no_grad
from reference_trainer.cli import main
sys.argv = ["reference-trainer", *sys.argv[1:]]
main()
"""


def _train(tmp_path, dump_dir, side, name, *, buggy=False):
    env = {key: value for key, value in os.environ.items() if not key.startswith(("FFDEBUG_", "ATOM_"))}
    env.update(FFDEBUG_FWD_DUMP_DIR=str(dump_dir), FFDEBUG_FWD_DUMP_SIDE=side, HF_HUB_OFFLINE="1")
    if buggy:
        driver = tmp_path / "buggy_driver.py"
        driver.write_text(BUGGY_DRIVER)
        entry = [str(driver)]
    else:
        entry = ["-m", "reference_trainer"]
    args = ["train", str(GRPO_CONFIG), "--output-dir", str(tmp_path / name), "--max-steps", "2"]
    args += ["--set", "train.kl_beta=1.0"]
    subprocess.run([sys.executable, *entry, *args], env=env, cwd=REPO, check=True, capture_output=True)


def _compare(ref_side, target_side):
    from typer.testing import CliRunner

    from ffdebug.cli.app import app

    result = CliRunner().invoke(app, ["compare", str(ref_side), str(target_side), "--json"])
    return result.exit_code, json.loads(result.stdout)


def test_same_config_compares_ok_and_injected_kl_bug_is_located(tmp_path):
    dumps, buggy_dumps = tmp_path / "dumps", tmp_path / "buggy_dumps"
    _train(tmp_path, dumps, "ref", "run_ref")
    _train(tmp_path, dumps, "target", "run_target")
    _train(tmp_path, buggy_dumps, "target", "run_buggy", buggy=True)

    code, clean = _compare(dumps / "ref", dumps / "target")
    assert code == 0 and clean["verdict"] == "ok" and clean["first_divergence"] is None
    keys = {stage["key"] for stage in clean["stages"]}
    expected_taps = {
        "rollout.latents",
        "rollout.log_prob",
        "reward",
        "advantage",
        "loss.policy",
        "grad_norm.policy",
    }
    assert expected_taps <= keys
    assert any(key.startswith("L000.") for key in keys), "block forwards were not dumped"

    code, buggy = _compare(dumps / "ref", buggy_dumps / "target")
    assert code == 1 and buggy["verdict"] != "ok"
    first = buggy["first_divergence"]
    assert first["key"] == "grad_norm.policy"
    assert first["step"]["optimizer_step"] == 1
