"""Rewards (pointwise, groupwise, checks) and the AdvantageProcessor, against hand-derived values."""

import io

import pytest
import torch
from PIL import Image

from reference_trainer.advantages import AdvantageConfig, AdvantageProcessor
from reference_trainer.config import RewardSpec
from reference_trainer.rewards import (
    Reward,
    RewardError,
    RewardProcessor,
    build_reward,
    register_reward,
    registered_rewards,
)


def constant_images(*values: float) -> torch.Tensor:
    """[B, 3, 4, 4] images, image i filled with values[i]."""
    return torch.stack([torch.full((3, 4, 4), v) for v in values])


@register_reward("_test_nan")
class _NaNReward(Reward):
    def __call__(self, images, prompts):
        out = torch.zeros(images.shape[0])
        out[-1] = float("nan")
        return out


@register_reward("_test_short")
class _ShortReward(Reward):
    def __call__(self, images, prompts):
        return torch.zeros(images.shape[0] - 1)


CALLS: list[int] = []


@register_reward("_test_record_chunks")
class _RecordChunks(Reward):
    def __call__(self, images, prompts):
        CALLS.append(images.shape[0])
        return images.mean(dim=(1, 2, 3))


def test_registry_lists_kinds():
    listed = registered_rewards()
    assert listed["jpeg_compressibility"] == "pointwise"
    assert listed["brightness"] == "pointwise"
    assert listed["rank_within_group"] == "groupwise"
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        build_reward("nope")


def test_brightness_hand_values():
    """r = −|mean − target|, target 1: constant 0.25 → −0.75; half 0 / half 1 → mean 0.5 → −0.5."""
    half = torch.zeros(1, 3, 4, 4)
    half[..., :2] = 1.0
    images = torch.cat([constant_images(0.25), half])
    assert torch.equal(
        build_reward("brightness", target=1.0)(images, ["a", "b"]), torch.tensor([-0.75, -0.5])
    )


def test_color_target_hand_value():
    """Channel means (1, 0.5, 0), target (1, 0, 0): r = −(0 + 0.5 + 0)/3 = −1/6."""
    image = torch.zeros(1, 3, 2, 2)
    image[0, 0] = 1.0
    image[0, 1] = 0.5
    got = build_reward("color_target", target=(1.0, 0.0, 0.0))(image, ["a"])
    assert got.item() == pytest.approx(-1.0 / 6.0)


def test_jpeg_compressibility_is_minus_jpeg_kilobytes():
    """r = −(bytes of the PIL JPEG encoding at quality 95)/1000; a flat image beats noise."""
    g = torch.Generator().manual_seed(0)
    images = torch.cat([torch.full((1, 3, 16, 16), 0.5), torch.rand(1, 3, 16, 16, generator=g)])
    got = build_reward("jpeg_compressibility")(images, ["a", "b"])
    expected = []
    for image in images:
        array = (image * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=95)
        expected.append(-len(buffer.getvalue()) / 1000.0)
    assert got.tolist() == pytest.approx(expected)
    assert got[0] > got[1]
    assert torch.equal(build_reward("jpeg_incompressibility")(images, ["a", "b"]), -got)


def test_rank_within_group_keeps_unique_id_order():
    """ids [5, 9, 5, 9, 5], brightness means [0.2, 0.9, 0.6, 0.1, 0.6], target 1 → base r = m − 1.

    Group 5 (positions 0, 2, 4): r = [−0.8, −0.4, −0.4] → fractional ranks [0, 1.5, 1.5] → /(K−1 = 2)
    → [0, 0.75, 0.75]. Group 9 (positions 1, 3): r = [−0.1, −0.9] → ranks [1, 0] → /1 → [1, 0].
    Scattered back in input order: [0, 1, 0.75, 0, 0.75].
    """
    processor = RewardProcessor([RewardSpec(name="rank_within_group", kwargs={"base": "brightness"})])
    images = constant_images(0.2, 0.9, 0.6, 0.1, 0.6)
    out = processor(images, ["p"] * 5, [5, 9, 5, 9, 5])
    assert out["rank_within_group"].tolist() == pytest.approx([0.0, 1.0, 0.75, 0.0, 0.75])


def test_pointwise_chunks_may_be_smaller_than_batch_size():
    CALLS.clear()
    processor = RewardProcessor([RewardSpec(name="_test_record_chunks", batch_size=2)])
    out = processor(constant_images(0.1, 0.2, 0.3, 0.4, 0.5), ["p"] * 5, [0, 0, 1, 1, 2])
    assert CALLS == [2, 2, 1]
    assert out["_test_record_chunks"].tolist() == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])


def test_nan_reward_is_an_error_naming_the_reward():
    processor = RewardProcessor([RewardSpec(name="brightness"), RewardSpec(name="_test_nan")])
    with pytest.raises(
        RewardError, match=r"reward '_test_nan' returned non-finite values at positions \[1\]"
    ):
        processor(constant_images(0.1, 0.2), ["a", "b"], [0, 0])


def test_wrong_length_reward_is_an_error_naming_the_reward():
    processor = RewardProcessor([RewardSpec(name="_test_short")])
    with pytest.raises(RewardError, match="reward '_test_short' returned shape"):
        processor(constant_images(0.1, 0.2), ["a", "b"], [0, 0])


def test_images_outside_unit_range_are_rejected():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        RewardProcessor([RewardSpec(name="brightness")])(constant_images(1.5), ["a"], [0])


# --- advantages ------------------------------------------------------------------------------------

EPS = 1e-4
IDS = [7, 3, 7, 3]
R1 = torch.tensor([0.0, 10.0, 2.0, 14.0])


def test_group_normalisation_hand_values():
    """Group 7 = positions 0, 2: r = [0, 2], mean 1, population std 1 → A = ∓1/(1 + eps).
    Group 3 = positions 1, 3: r = [10, 14], mean 12, std 2 → A = ∓2/(2 + eps)."""
    adv, _ = AdvantageProcessor(AdvantageConfig(eps=EPS))({"r": R1}, IDS)
    expected = [-1 / (1 + EPS), -2 / (2 + EPS), 1 / (1 + EPS), 2 / (2 + EPS)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_constant_group_gets_zero_advantage():
    """r = [5, 5] in one group: r − mean = 0 exactly, so A = 0/(0 + eps) = 0."""
    adv, _ = AdvantageProcessor(AdvantageConfig())({"r": torch.tensor([5.0, 5.0])}, [1, 1])
    assert adv.tolist() == [0.0, 0.0]


def test_global_std_hand_values():
    """Means per group as above (1 and 12) but std of the whole batch [0, 10, 2, 14]:
    batch mean 6.5, squared deviations 42.25 + 12.25 + 20.25 + 56.25 = 131, /4 = 32.75 → std √32.75.
    A = [−1, −2, 1, 2]/(√32.75 + eps)."""
    adv, _ = AdvantageProcessor(AdvantageConfig(eps=EPS, global_std=True))({"r": R1}, IDS)
    denom = 32.75**0.5 + EPS
    assert adv.tolist() == pytest.approx([-1 / denom, -2 / denom, 1 / denom, 2 / denom], rel=1e-6)


def test_sum_aggregation_weights_then_normalises():
    """r2 = [1, 1, 3, 1], weights r1: 1, r2: 2 → total = r1 + 2·r2 = [2, 12, 8, 16].
    Group 7: [2, 8], mean 5, std 3 → ∓3/(3+eps); group 3: [12, 16], mean 14, std 2 → ∓2/(2+eps)."""
    r2 = torch.tensor([1.0, 1.0, 3.0, 1.0])
    cfg = AdvantageConfig(eps=EPS, weights={"r1": 1.0, "r2": 2.0})
    adv, _ = AdvantageProcessor(cfg)({"r1": R1, "r2": r2}, IDS)
    assert adv.tolist() == pytest.approx(
        [-3 / (3 + EPS), -2 / (2 + EPS), 3 / (3 + EPS), 2 / (2 + EPS)], rel=1e-6
    )


def test_gdpo_aggregation_normalises_each_reward_then_the_batch():
    """Per reward: A1 = [−1/(1+e), −2/(2+e), 1/(1+e), 2/(2+e)] (above); r2 = [1, 1, 3, 1]:
    group 7 [1, 3] → ∓1/(1+e), group 3 [1, 1] → 0, so A2 = [−1/(1+e), 0, 1/(1+e), 0].
    S = A1 + 2·A2 = [−a, −b, a, b] with a = 3/(1+e), b = 2/(2+e); batch mean 0, population std
    √((a² + b²)/2); A = S/(std + e)."""
    r2 = torch.tensor([1.0, 1.0, 3.0, 1.0])
    cfg = AdvantageConfig(eps=EPS, aggregation="gdpo", weights={"r2": 2.0})
    adv, _ = AdvantageProcessor(cfg)({"r1": R1, "r2": r2}, IDS)
    a, b = 3 / (1 + EPS), 2 / (2 + EPS)
    denom = ((a * a + b * b) / 2) ** 0.5 + EPS
    assert adv.tolist() == pytest.approx([-a / denom, -b / denom, a / denom, b / denom], rel=1e-6)


def test_advantage_config_names_bad_fields():
    with pytest.raises(ValueError, match="aggregation: must be one of"):
        AdvantageConfig(aggregation="mean")
    with pytest.raises(ValueError, match="eps: must be > 0"):
        AdvantageConfig(eps=0.0)
