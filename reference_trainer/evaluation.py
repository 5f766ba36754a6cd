"""Periodic evaluation: fixed prompts, fixed noise, and nothing that touches the training trajectory.

``BaseTrainer`` owns the boundary (``eval.every``, ``config.EvalConfig``) and writes one record per
evaluation to ``DIR/eval.jsonl`` (``optimizer_step``, the counters, ``eval.<metric>``); a trainer's
``evaluate()`` composes the pieces below. Evaluation is generation-based for every trainer (seeds
``ff-develop``: "Evaluation remains generation-based, including for SFT and offline DPO"); dataset
trainers add a held-out loss.

* ``eval_prompts``: each evaluation prompt repeated ``samples_per_prompt`` times (one group per prompt);
* ``eval_noise``: the fixed initial noise z ~ N(0, I) [B, C, H, W], drawn from a generator seeded by
  ``eval.seed`` only — the same z at every evaluation, and the first draw ``adapter.inference`` makes
  from an equally seeded generator (so an ODE sample starts from the same z);
* ``reward_metrics``: decode, then the evaluation rewards (``reward_mean`` = their sum's mean, and
  ``reward.<name>``);
* ``mmd``: the squared maximum mean discrepancy with an RBF kernel, a distribution distance between two
  sample sets (Gretton et al. 2012, JMLR 13, eq. 3, biased V-statistic);
* ``heldout_metrics``: a dataset trainer's own batch loss (and its metrics) on the held-out records.

Everything runs under ``torch.no_grad()`` with its own generators: no global RNG is used, no weight and
no counter changes, so a run with evaluation has the same ``metrics.jsonl`` as one without.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from reference_trainer.adapters.base import BaseAdapter
from reference_trainer.config import EvalConfig
from reference_trainer.data import collate, default_prompts, repeat_groups
from reference_trainer.rewards import RewardProcessor


def eval_prompts(config: EvalConfig) -> tuple[list[str], torch.Tensor]:
    """(prompts [B], group ids [B]): each evaluation prompt ``samples_per_prompt`` times, contiguously."""
    return repeat_groups(config.prompts or default_prompts(), config.samples_per_prompt)


def eval_generator(config: EvalConfig) -> torch.Generator:
    """A fresh generator seeded by ``eval.seed`` (the same draws at every evaluation)."""
    return torch.Generator().manual_seed(config.seed)


def eval_noise(config: EvalConfig, batch_size: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
    """The fixed initial noise z [B, C, H, W] (= the first draw of ``eval_generator``)."""
    return torch.randn((batch_size, *latent_shape), generator=eval_generator(config))


@torch.no_grad()
def reward_metrics(
    adapter: BaseAdapter,
    config: EvalConfig,
    latents: torch.Tensor,
    prompts: list[str],
    group_ids: torch.Tensor,
) -> dict[str, float]:
    """Decode clean ``latents`` [B, C, H, W] and score them with the evaluation rewards."""
    images = adapter.decode_latents(latents)
    rewards = RewardProcessor(config.rewards)(images, prompts, group_ids)
    metrics = {f"reward.{name}": float(values.mean()) for name, values in rewards.items()}
    metrics["reward_mean"] = float(sum(values for values in rewards.values()).mean())
    return metrics


def mmd(x: torch.Tensor, y: torch.Tensor, bandwidth: float) -> float:
    """MMD² = mean k(x, x') + mean k(y, y') − 2·mean k(x, y), k(a, b) = exp(−‖a − b‖² / bandwidth).

    x [N, ...], y [M, ...] (flattened per sample), computed in float64.
    """
    x, y = x.flatten(1).double(), y.flatten(1).double()

    def kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.exp(-torch.cdist(a, b).square() / bandwidth)

    return float(kernel(x, x).mean() + kernel(y, y).mean() - 2 * kernel(x, y).mean())


def median_sq_distance(x: torch.Tensor) -> float:
    """Median of the squared pairwise distances between distinct samples of x [N, ...] (a bandwidth)."""
    flat = x.flatten(1).double()
    distances = torch.cdist(flat, flat).square()
    off_diagonal = ~torch.eye(len(flat), dtype=torch.bool)
    return float(distances[off_diagonal].median())


BatchLoss = Callable[[Mapping[str, Any], torch.Generator], tuple[torch.Tensor, dict[str, float]]]


@torch.no_grad()
def heldout_metrics(
    records: list[dict[str, Any]], batch_loss: BatchLoss, config: EvalConfig
) -> dict[str, float]:
    """``heldout.loss`` and ``heldout.<metric>`` of a dataset trainer's ``batch_loss`` on every held-out
    record (one batch), averaged over ``heldout_draws`` (σ, ε) draws from the evaluation generator."""
    batch = collate(records)
    generator = eval_generator(config)
    sums: dict[str, float] = {}
    for _ in range(config.heldout_draws):
        loss, metrics = batch_loss(batch, generator)
        for key, value in {"loss": float(loss), **metrics}.items():
            sums[key] = sums.get(key, 0.0) + value / config.heldout_draws
    return {f"heldout.{key}": value for key, value in sums.items()}
