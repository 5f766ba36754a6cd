"""Every trainer that rolls out taps its inputs (docs/trainer-taps.md "Which trainers tap what"), so
the same-inputs gate of `ffdebug compare` applies to it. The GRPO family and the decoupled trainers
(NFT, AWM, DGPO, CRD) are checked by their dumped-run tests; Online DPO and DMD2 here."""

from __future__ import annotations

import pytest
import torch
from helpers.trainer.trainer_utils import make_trainer

import ffdebug
from ffdebug.arrays import to_torch
from ffdebug.store.reader import open_side

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("name", "inputs"),
    [
        ("online_dpo", ("rollout.prompt_ids", "rollout.noise", "rollout.timesteps")),
        ("dmd2", ("rollout.prompt_ids", "rollout.noise")),  # one step from z: no σ schedule
    ],
)
def test_rolling_out_trainers_tap_their_inputs(tmp_path, name, inputs):
    with ffdebug.capture(dir=str(tmp_path / "dumps"), side="ref"):
        trainer = make_trainer(name, tmp_path / "run", 1, "eval.every=0")
        trainer.start()
    records = [r for r in open_side(tmp_path / "dumps" / "ref").records if r.key.startswith("rollout.")]
    tapped = {r.key: to_torch(r.load()) for r in records}
    assert set(inputs) <= set(tapped), sorted(tapped)
    ids, noise = tapped["rollout.prompt_ids"], tapped["rollout.noise"]
    assert ids.dtype == torch.int64 and ids.shape[0] == noise.shape[0]  # one token row per sample
    assert noise.dtype == torch.float32 and noise.dim() == 4
    if "rollout.timesteps" in inputs:
        sigmas = tapped["rollout.timesteps"]
        assert float(sigmas[0]) == 1.0 and float(sigmas[-1]) == 0.0  # the schedule, 1 -> 0
