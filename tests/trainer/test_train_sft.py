"""SFT trainer on tiny SD3: the velocity MSE goes down, frozen parts stay bit-identical, the policy moves."""

import pytest
from helpers.trainer.trainer_utils import (
    assert_bit_identical,
    assert_every_parameter_changed,
    frozen_state,
    make_trainer,
    metrics,
    variant_state,
)

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one


def test_sft_lowers_the_flow_matching_loss(tmp_path):
    """24 steps (8 demonstrations, batch 2, no accumulation): mean of the last 6 losses < first 6."""
    trainer = make_trainer("sft", tmp_path, 24, "train.max_epochs=100", "train.gradient_accumulation_steps=1")
    frozen, initial = frozen_state(trainer), variant_state(trainer)
    trainer.start()
    losses = [record["loss"] for record in metrics(tmp_path)]
    first, last = sum(losses[:6]) / 6, sum(losses[-6:]) / 6
    print(f"SFT velocity MSE: first 6 steps {first:.4f} -> last 6 steps {last:.4f}")
    assert len(losses) == 24 and last < 0.8 * first
    assert_bit_identical(frozen, frozen_state(trainer))
    assert_every_parameter_changed(trainer, initial["policy"], trainer.variants.variant("policy"), "policy")
    assert {record["data_epoch"] for record in metrics(tmp_path)} == set(range(6))  # 4 steps per epoch
