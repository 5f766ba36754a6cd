"""Rewards computable offline, their registry, and the ``RewardProcessor`` that routes and checks them.

Two kinds (Flow-Factory's reward contract, seeds ``ff-debug``: "Pointwise rewards return one finite
value per actual input chunk, which may be smaller than batch_size; groupwise rewards preserve
complete unique_id order"; "model NaN/Inf is an error, not a routing sentinel"):

* **pointwise** — ``reward(images, prompts) -> [b]``: one value per image, independent of the others.
  The processor feeds it chunks of at most ``batch_size`` images; the last chunk may be smaller and
  the reward must return exactly one value per image it was given.
* **groupwise** — ``reward(images, prompts) -> [K]``: called once per complete group (the K samples
  sharing a ``unique_id``), values in the order the group's members appear in the batch; the
  processor scatters them back, so the output order always equals the input order.

Every value is checked: wrong shape or a NaN/Inf raises ``RewardError`` naming the reward.

Images are decoded RGB, float, ``[B, 3, H, W]`` in [0, 1] (the adapter's ``decode_latents`` output).

Registered rewards:
  * ``jpeg_compressibility`` — −(JPEG size in kB at quality 95), DDPO (Black et al. 2023, arXiv
    2305.13301; kvablack/ddpo-pytorch ``ddpo_pytorch/rewards.py``); ``jpeg_incompressibility`` = +size;
  * ``brightness`` — −|mean(image) − target|, a smooth toy target for tiny-model tests;
  * ``color_target`` — −(1/3)·Σ_c |mean(image_c) − target_c|;
  * ``rank_within_group`` (groupwise) — the fractional rank of a pointwise base reward inside the
    group, scaled to [0, 1] (the shape of Flow-Factory's ``PickScore_Rank``).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch
from PIL import Image

from reference_trainer.errors import ConfigError

if TYPE_CHECKING:  # a type only: the YAML config module is not imported at run time
    from reference_trainer.config import RewardSpec


REWARD_KINDS = ("pointwise", "groupwise")


class RewardError(ValueError):
    """A reward returned something unusable (wrong shape, NaN/Inf); the message names the reward."""


class Reward:
    """Base of every reward. Subclasses set ``kind`` and implement ``__call__``."""

    kind: ClassVar[str] = "pointwise"
    name: ClassVar[str] = ""

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        raise NotImplementedError


_REWARDS: dict[str, type[Reward]] = {}


def register_reward(name: str) -> Callable[[type[Reward]], type[Reward]]:
    """Class decorator: register a reward under ``name`` (unique).

    Args:
        name: the reward's name (``train.rewards[].name``).

    Returns:
        The class decorator (it returns the class unchanged).
    """

    def decorator(cls: type[Reward]) -> type[Reward]:
        if name in _REWARDS:
            raise ValueError(f"reward {name!r} is already registered by {_REWARDS[name].__qualname__}")
        if cls.kind not in REWARD_KINDS:
            raise ValueError(f"reward {name!r}: kind must be one of {REWARD_KINDS}, got {cls.kind!r}")
        cls.name = name
        _REWARDS[name] = cls
        return cls

    return decorator


def registered_rewards() -> dict[str, str]:
    """Name -> kind of every registered reward (for ``reference-trainer list``).

    Returns:
        ``{name: kind}``, sorted by name.
    """
    return {name: cls.kind for name, cls in sorted(_REWARDS.items())}


def build_reward(name: str, **kwargs: Any) -> Reward:
    """An instance of the reward registered as ``name``, constructed with ``kwargs``.

    Raises ``ValueError`` for an unknown name or arguments the reward does not accept.

    Args:
        name: a registered reward name.
        **kwargs: the reward's constructor arguments.

    Returns:
        The reward instance.
    """
    if name not in _REWARDS:
        raise ValueError(f"unknown reward {name!r}; registered: {sorted(_REWARDS)}")
    try:
        return _REWARDS[name](**kwargs)
    except TypeError as err:  # unknown keyword, or a value of the wrong type inside the constructor
        raise ValueError(f"reward {name!r}: bad arguments {kwargs}: {err}") from err


def check_reward(name: str, kwargs: dict[str, Any]) -> None:
    """``ConfigError`` (field ``name`` or ``kwargs``) unless ``build_reward(name, **kwargs)`` works."""
    if name not in _REWARDS:
        raise ConfigError(
            "name", f"unknown reward {name!r}; registered rewards: {', '.join(sorted(_REWARDS))}"
        )
    try:
        build_reward(name, **kwargs)
    except (TypeError, ValueError) as error:
        raise ConfigError("kwargs", str(error).splitlines()[0]) from None


# ---------------------------------------------------------------------------------------------------
# Pointwise rewards


def _to_uint8_hwc(images: torch.Tensor) -> np.ndarray:
    """[B, 3, H, W] in [0, 1] -> uint8 [B, H, W, 3] (DDPO: ``(images * 255).round().clamp(0, 255)``)."""
    return (
        (images.detach().float() * 255)
        .round()
        .clamp(0, 255)
        .to(torch.uint8)
        .permute(0, 2, 3, 1)
        .cpu()
        .numpy()
    )


def _jpeg_quality(quality: Any) -> int:
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"quality must be an integer in [1, 100] (PIL's JPEG quality), got {quality!r}")
    return quality


def jpeg_size_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """Size of each image's JPEG encoding (PIL, given quality) in kB (1 kB = 1000 bytes). [B] fp32.

    Args:
        images: [B, 3, H, W] in [0, 1].
        quality: PIL's JPEG quality.

    Returns:
        The sizes in kB, [B] fp32.
    """
    sizes = []
    for array in _to_uint8_hwc(images):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


@register_reward("jpeg_compressibility")
class JpegCompressibility(Reward):
    """r = −(JPEG size in kB): smaller files (smoother images) score higher."""

    def __init__(self, quality: int = 95) -> None:
        self.quality = _jpeg_quality(quality)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return -jpeg_size_kb(images, self.quality)


@register_reward("jpeg_incompressibility")
class JpegIncompressibility(Reward):
    """r = +(JPEG size in kB): detailed images score higher."""

    def __init__(self, quality: int = 95) -> None:
        self.quality = _jpeg_quality(quality)

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return jpeg_size_kb(images, self.quality)


@register_reward("brightness")
class Brightness(Reward):
    """r = −|mean over channels and pixels of the image − target|, in [−1, 0]."""

    def __init__(self, target: float = 1.0) -> None:
        if not 0.0 <= target <= 1.0:
            raise ValueError(f"brightness.target must be in [0, 1], got {target}")
        self.target = target

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return -(images.float().mean(dim=(1, 2, 3)) - self.target).abs()


@register_reward("color_target")
class ColorTarget(Reward):
    """r = −(1/3)·Σ_c |mean_{h,w} image[c] − target[c]|, in [−1, 0]."""

    def __init__(self, target: Sequence[float] = (1.0, 0.0, 0.0)) -> None:
        if len(target) != 3 or not all(0.0 <= c <= 1.0 for c in target):
            raise ValueError(f"color_target.target must be 3 values in [0, 1], got {target}")
        self.target = torch.tensor([float(c) for c in target])

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        channel_means = images.float().mean(dim=(2, 3))  # [B, 3]
        return -(channel_means - self.target).abs().mean(dim=1)


# ---------------------------------------------------------------------------------------------------
# Groupwise rewards


def fractional_rank(values: torch.Tensor) -> torch.Tensor:
    """0-based rank with ties sharing their average rank: #{j: v_j < v_i} + (#{j: v_j = v_i} − 1)/2.

    Args:
        values: [N].

    Returns:
        The fractional ranks, [N].
    """
    less = (values.unsqueeze(0) < values.unsqueeze(1)).sum(dim=1)  # [K], row i counts v_j < v_i
    equal = (values.unsqueeze(0) == values.unsqueeze(1)).sum(dim=1)
    return less.double() + (equal.double() - 1.0) / 2.0


@register_reward("rank_within_group")
class RankWithinGroup(Reward):
    """r_i = rank_i / (K − 1) of a pointwise base reward within the group: worst 0, best 1, ties averaged."""

    kind: ClassVar[str] = "groupwise"

    def __init__(self, base: str = "brightness", base_kwargs: dict[str, Any] | None = None) -> None:
        self.base = build_reward(base, **(base_kwargs or {}))
        if self.base.kind != "pointwise":
            raise ValueError(
                f"rank_within_group.base must be a pointwise reward, got {base!r} ({self.base.kind})"
            )

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        k = images.shape[0]
        if k < 2:
            raise RewardError(
                f"reward '{self.name}' ranks within a group and needs groups of >= 2 samples, got {k}"
            )
        base = _checked(self.base, self.base(images, prompts), k)
        return (fractional_rank(base) / (k - 1)).float()


# ---------------------------------------------------------------------------------------------------
# Routing and checks


def _checked(reward: Reward, values: Any, expected: int) -> torch.Tensor:
    """Values must be a 1-D tensor of ``expected`` finite numbers; anything else names the reward."""
    if not isinstance(values, torch.Tensor):
        raise RewardError(f"reward '{reward.name}' returned {type(values).__name__}, expected a tensor")
    if values.shape != (expected,):
        raise RewardError(
            f"reward '{reward.name}' returned shape {tuple(values.shape)} for {expected} inputs"
        )
    bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
    if bad:
        raise RewardError(
            f"reward '{reward.name}' returned non-finite values at positions {bad}: {values[bad].tolist()}"
        )
    return values.detach().float().cpu()


class RewardProcessor:
    """Computes every configured reward for a batch: ``{name: [B] fp32}``, in input order."""

    def __init__(self, specs: Sequence[RewardSpec]) -> None:
        if not specs:
            raise ValueError("RewardProcessor needs at least one reward")
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate reward names in {names}")
        self.specs = tuple(specs)
        self.rewards = {spec.name: build_reward(spec.name, **spec.kwargs) for spec in specs}

    def __call__(
        self, images: torch.Tensor, prompts: Sequence[str], unique_ids: Sequence[int] | torch.Tensor
    ) -> dict[str, torch.Tensor]:
        b = images.shape[0]
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"rewards take decoded RGB images [B, 3, H, W], got {tuple(images.shape)}")
        if bool((images < 0).any()) or bool((images > 1).any()):
            raise ValueError("rewards take images in [0, 1]; decode_latents must map the VAE output there")
        group_ids = torch.as_tensor(unique_ids, dtype=torch.int64)
        if len(prompts) != b or group_ids.shape != (b,):
            raise ValueError(f"{b} images but {len(prompts)} prompts and {tuple(group_ids.shape)} unique_ids")
        out = {}
        for spec in self.specs:
            reward = self.rewards[spec.name]
            if reward.kind == "pointwise":
                out[spec.name] = self._pointwise(reward, spec.batch_size, images, prompts)
            else:
                out[spec.name] = self._groupwise(reward, images, prompts, group_ids)
        return out

    @staticmethod
    def _pointwise(
        reward: Reward, batch_size: int, images: torch.Tensor, prompts: Sequence[str]
    ) -> torch.Tensor:
        chunks = []
        for start in range(0, images.shape[0], batch_size):
            chunk = images[start : start + batch_size]
            chunks.append(
                _checked(reward, reward(chunk, prompts[start : start + batch_size]), chunk.shape[0])
            )
        return torch.cat(chunks)

    @staticmethod
    def _groupwise(
        reward: Reward, images: torch.Tensor, prompts: Sequence[str], group_ids: torch.Tensor
    ) -> torch.Tensor:
        values = torch.empty(images.shape[0], dtype=torch.float32)
        seen = []
        for gid in group_ids.tolist():  # groups in order of first appearance
            if gid not in seen:
                seen.append(gid)
        for gid in seen:
            members = (group_ids == gid).nonzero().flatten()  # ascending = batch order
            group_values = reward(images[members], [prompts[i] for i in members.tolist()])
            values[members] = _checked(reward, group_values, members.numel())
        return values
