"""Online Diffusion-DPO on tiny SD3: the brightness reward goes up; the reference stays frozen."""

import pytest
import torch
from helpers.trainer.trainer_utils import (
    assert_bit_identical,
    assert_every_parameter_changed,
    frozen_state,
    make_trainer,
    metrics,
    variant_state,
)

from reference_trainer.trainers.online_dpo import best_worst_pairs

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one

EVAL_PROMPTS = ["a red cat", "a blue dog", "a green tree", "a yellow sun"] * 4


def mean_brightness(trainer) -> float:
    """Mean image brightness of a fixed evaluation batch (same prompts, same sampling noise)."""
    condition = trainer.adapter.encode_prompt(EVAL_PROMPTS)
    with torch.no_grad():
        trajectory = trainer.adapter.inference(
            condition,
            num_steps=4,
            noise_level=0.7,
            generator=torch.Generator().manual_seed(1234),
            module=trainer.variants.variant("policy"),
        )
        return trainer.adapter.decode_latents(trajectory.final).mean().item()


def test_best_worst_pairs_hand_example():
    """Groups [0, 0, 0, 1, 1, 2, 2] with A = [0.1, 0.9, −1, 2, −2, 0.5, 0.5]:
    group 0 → chosen 1 (0.9), rejected 2 (−1); group 1 → chosen 3, rejected 4; group 2 is a tie → skipped."""
    advantages = torch.tensor([0.1, 0.9, -1.0, 2.0, -2.0, 0.5, 0.5])
    chosen, rejected = best_worst_pairs(advantages, torch.tensor([0, 0, 0, 1, 1, 2, 2]))
    assert chosen.tolist() == [1, 3] and rejected.tolist() == [2, 4]


def test_online_dpo_raises_mean_reward(tmp_path):
    """30 rollout iterations of 8 groups × 4 samples, brightness reward (target 1).

    Reported: brightness of a fixed evaluation batch before/after, and the rollout reward_mean of the
    first vs last 5 iterations. The first step is at the reference (θ = ref), so its loss is log 2.
    """
    trainer = make_trainer("online_dpo", tmp_path, 30)
    frozen, initial = frozen_state(trainer), variant_state(trainer)
    before = mean_brightness(trainer)
    trainer.start()
    after = mean_brightness(trainer)
    records = metrics(tmp_path)
    first = sum(r["reward_mean"] for r in records[:5]) / 5
    last = sum(r["reward_mean"] for r in records[-5:]) / 5
    print(
        f"online DPO: eval brightness {before:.4f} -> {after:.4f}; rollout reward_mean {first:.4f} -> {last:.4f}"
    )
    assert abs(records[0]["loss"] - 0.6931471805599453) < 1e-5
    # the size of the rise depends on the draws: the per-sample rollout noise of issue 19 changed them
    # (+0.004 at seed 0; the code before it gave +0.017 and +0.004 at seeds 1 and 2): direction only
    assert after > before and last > first
    assert_bit_identical(frozen, frozen_state(trainer))
    assert_every_parameter_changed(trainer, initial["policy"], trainer.variants.variant("policy"), "policy")
