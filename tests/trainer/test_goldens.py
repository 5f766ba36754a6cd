"""Goldens of every registered trainer: the first 3 optimizer steps' ``loss`` and ``grad_norm.<role>``
(more where ``golden_utils.GOLDEN_STEPS`` says why).

The parametrisation is the registry (``registry.trainer_names()``): each trainer runs its example config
``examples/<trainer>/full/sd3_tiny/default.yaml`` with the overrides of ``golden_utils.GOLDEN_OVERRIDES``
(none for a trainer not listed) for 3 steps (``golden_steps``) at one thread, and ``golden_utils.check_golden`` compares
the values with ``tests/trainer/goldens/<trainer>.json``, each within the tolerance its file records (10x
the spread measured across CPU dispatch levels, at least 8 float32 ulp), skipping with a message on
another torch version. A new trainer without a recorded golden fails with "no golden <trainer>.json;
record it with ..." (how: ``golden_utils`` docstring).

Where the other tests assert "loss fell" or "reward rose", these pin the numbers: halving a KL term,
dropping a 1/microbatches factor or training one step more moves them far beyond the tolerance, and
``test_every_golden_is_sensitive`` shows that a 0.1 % larger learning rate does too (measured: 1.8x the
tolerance for grpo, the least sensitive, to 630x for dmd2).
"""

from __future__ import annotations

import re

import pytest
import yaml
from helpers import REPO
from helpers.trainer.golden_utils import GOLDEN_OVERRIDES, check_golden, golden_steps
from helpers.trainer.trainer_utils import load, metrics

from reference_trainer.registry import trainer_names

# every test here runs a trainer; numeric: CI runs them again at ATEN_CPU_CAPABILITY=default
pytestmark = [pytest.mark.integration, pytest.mark.numeric]

LR_FACTOR = 1.001


def _run(name, tmp_path, *extra):
    from reference_trainer.run import train

    config = f"examples/{name}/full/sd3_tiny/default.yaml"
    assert (REPO / config).is_file(), f"registered trainer {name!r} has no example config {config}"
    overrides = GOLDEN_OVERRIDES.get(name, [])
    train(load(REPO / config, *overrides, *extra, max_steps=golden_steps(name)), tmp_path)
    return config, overrides


MODEL_STAGE = re.compile(r"^(L\d{3}\.|embed\.|final\.)")
PHASES = ("rollout", "train", "eval")


def _documented_stages(name: str) -> set[str]:
    """The stages docs/trainer-taps.md "Which trainers tap what" lists for ``name``."""
    text = (REPO / "docs/trainer-taps.md").read_text()
    row = re.search(rf"^\| `{re.escape(name)}` \|(.*)\|$", text, re.MULTILINE)
    assert row, f"docs/trainer-taps.md lists no stages for trainer {name!r}"
    return set(re.findall(r"`([^`]+)`", row.group(1)))


@pytest.mark.parametrize("name", trainer_names())
def test_first_steps_match_the_golden(name, tmp_path):
    """The golden run is dumped too (the numbers do not change), and its store is in training
    order: every capture carries ``optimizer_step`` and a ``phase`` of the contract, and every stage
    it dumps besides the model's is the stage list docs/trainer-taps.md gives for this trainer."""
    import ffdebug
    from ffdebug.store.reader import open_side

    with ffdebug.capture(dir=str(tmp_path / "dumps"), side="ref"):
        config, overrides = _run(name, tmp_path / "run")
    check_golden(name, metrics(tmp_path / "run"), config=config, overrides=overrides)
    records = open_side(tmp_path / "dumps" / "ref").records
    assert records, f"{name}: the golden run dumped nothing"
    untagged = [(r.key, r.phase, sorted(r.step)) for r in records if "optimizer_step" not in r.step]
    assert not untagged, f"{name}: captures without optimizer_step: {untagged[:3]}"
    phases = {r.phase for r in records}
    assert phases <= set(PHASES), f"{name}: phases {sorted(map(str, phases))} outside {PHASES}"
    dumped = {r.key for r in records if not MODEL_STAGE.match(r.key)}
    undocumented = sorted(dumped - _documented_stages(name))
    assert not undocumented, f"{name} dumps stages docs/trainer-taps.md does not list: {undocumented}"


@pytest.mark.parametrize("name", trainer_names())
def test_every_golden_is_sensitive(name, tmp_path):
    """The same run with every optimizer's learning rate x 1.001 is outside the golden's tolerance: a
    tolerance loosened until every machine passes would let this through."""
    raw = yaml.safe_load((REPO / f"examples/{name}/full/sd3_tiny/default.yaml").read_text())
    bumped = [f"optimizers.{i}.lr={entry['lr'] * LR_FACTOR!r}" for i, entry in enumerate(raw["optimizers"])]
    config, overrides = _run(name, tmp_path, *bumped)
    with pytest.raises(AssertionError, match="differs from its golden"):
        check_golden(name, metrics(tmp_path), config=config, overrides=overrides)
