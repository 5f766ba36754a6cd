"""Golden values of a trainer run: the first optimizer steps' ``loss`` and ``grad_norm`` (not a test module).

A golden file ``tests/trainer/goldens/<name>.json`` holds the values recorded at one thread, with the
torch version, the config and the overrides they came from. ``test_goldens.py`` checks one for every
registered trainer (its example config with ``GOLDEN_OVERRIDES``, 3 steps); the GRPO-Guard and DPPO
learning runs check theirs too (the same first steps of a longer run). ``check_golden`` compares a run's
``metrics.jsonl`` records against it (relative 1e-6: the same maths on another CPU's kernels may move
the last bits, a changed term moves far more) and skips, saying why, on another torch version.

Re-record (after an intended change of the maths, or for a new torch version)::

    REFERENCE_TRAINER_RECORD_GOLDENS=1 OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -p no:cacheprovider \
        tests/trainer/test_goldens.py

(add ``-k <trainer>`` for one trainer) which rewrites the files from the runs the test just made;
review the diff and commit it. A new trainer is recorded the same way.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch

from helpers import TESTS

GOLDENS = TESTS / "trainer" / "goldens"
RECORD_ENV = "REFERENCE_TRAINER_RECORD_GOLDENS"
STEPS = 3

GOLDEN_OVERRIDES: dict[str, list[str]] = {
    # a KL reference, so the KL term is pinned too; two minibatches: step 2 is off-policy (ratio ≠ 1)
    "grpo": ["train.kl_beta=0.001", "train.gradient_steps_per_iteration=2"],
    "grpo_guard": ["train.kl_beta=0.001"],
    "dppo": ["train.kl_beta=0.001"],
    "nft": ["train.kl_beta=0.001"],
    "dgpo": ["train.kl_beta=0.001"],
    "awm": ["train.kl_beta=0.001", "train.ema_kl_beta=0.1"],
    # evaluations off: they do not touch the training numbers, only the time
    "dmd2": ["eval.every=0"],
    "tdm": ["eval.every=0"],
    "tdm_r1": ["eval.every=0"],
    "offline_dpo": ["eval.every=0"],
    "sft": ["eval.every=0"],
}
"""Overrides of each trainer's example config for its golden run (a trainer not listed: none)."""


def golden_values(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The first ``STEPS`` records' ``loss`` and ``grad_norm.<role>`` (pre-clip, of the step's role)."""
    assert len(records) >= STEPS, f"a golden needs {STEPS} optimizer steps, the run made {len(records)}"
    first = records[:STEPS]
    return {
        "loss": [float(r["loss"]) for r in first],
        "grad_norm": [float(r[f"grad_norm.{r['role']}"]) for r in first],
    }


def check_golden(name: str, records: list[dict[str, Any]], *, config: str, overrides: list[str]) -> None:
    """Compare (or, with ``REFERENCE_TRAINER_RECORD_GOLDENS=1``, record) the golden of ``name``."""
    path = GOLDENS / f"{name}.json"
    values = golden_values(records)
    if os.environ.get(RECORD_ENV) == "1":
        path.parent.mkdir(exist_ok=True)
        document = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "config": config,
            "overrides": overrides,
            **values,
        }
        path.write_text(json.dumps(document, indent=2) + "\n")
        return
    assert path.is_file(), (
        f"no golden {path.name}; record it with {RECORD_ENV}=1 (see tests/helpers/trainer/golden_utils.py)"
    )
    golden = json.loads(path.read_text())
    assert (golden["config"], golden["overrides"]) == (config, overrides), "the golden is of another run"
    assert torch.get_num_threads() == golden["threads"] == 1
    if golden["torch"] != torch.__version__:
        pytest.skip(
            f"golden {path.name} was recorded with torch {golden['torch']}, this is torch {torch.__version__}: "
            f"re-record it with {RECORD_ENV}=1 (tests/helpers/trainer/golden_utils.py)"
        )
    for key in ("loss", "grad_norm"):
        assert values[key] == pytest.approx(golden[key], rel=1e-6, abs=1e-9), (
            f"{name} {key}: {values[key]} != golden {golden[key]}"
        )
