"""Goldens of every registered trainer: the first 3 optimizer steps' ``loss`` and ``grad_norm.<role>``.

The parametrisation is the registry (``registry.trainer_names()``): each trainer runs its example config
``examples/<trainer>/full/sd3_tiny/default.yaml`` with the overrides of ``golden_utils.GOLDEN_OVERRIDES``
(none for a trainer not listed) for 3 steps at one thread, and ``golden_utils.check_golden`` compares
the values with ``tests/trainer/goldens/<trainer>.json`` (rel 1e-6), skipping with a message on
another torch version. A new trainer without a recorded golden fails with "no golden <trainer>.json;
record it with REFERENCE_TRAINER_RECORD_GOLDENS=1" (how: ``golden_utils`` docstring).

Where the other tests assert "loss fell" or "reward rose", these pin the numbers: halving a KL term,
dropping a 1/microbatches factor or training one step more moves them far beyond the tolerance.
"""

from __future__ import annotations

import pytest
from helpers import REPO
from helpers.trainer.golden_utils import GOLDEN_OVERRIDES, STEPS, check_golden
from helpers.trainer.trainer_utils import load, metrics

from reference_trainer.registry import trainer_names

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one


@pytest.mark.parametrize("name", trainer_names())
def test_first_steps_match_the_golden(name, tmp_path):
    from reference_trainer.run import train

    config = f"examples/{name}/full/sd3_tiny/default.yaml"
    assert (REPO / config).is_file(), f"registered trainer {name!r} has no example config {config}"
    overrides = GOLDEN_OVERRIDES.get(name, [])
    train(load(REPO / config, *overrides, max_steps=STEPS), tmp_path)
    check_golden(name, metrics(tmp_path), config=config, overrides=overrides)
