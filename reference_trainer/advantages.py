"""Advantages from rewards: one ``AdvantageProcessor`` for every reward-based trainer.

Group-relative advantage (GRPO; Shao et al. 2024, arXiv 2402.03300; Flow-GRPO, Liu et al. 2025, eq. 4):
the K samples drawn for one prompt form a group G, and each sample's advantage is its reward
standardised within its group,

    A_i = (r_i − mean_{j∈G} r_j) / (std_{j∈G} r_j + eps).

Variant notes (so two implementations can be compared term by term):
  * std is the *population* std (ddof = 0), as in flow_grpo's ``PerPromptStatTracker`` (``np.std``);
  * eps is added to the std (flow_grpo: ``std + 1e-4``), not used as a floor (Flow-Factory floors the
    std at 1e-6); a group whose rewards are all equal therefore gets A = 0 exactly;
  * ``global_std=True`` keeps the per-group mean but divides by the std of the whole batch (flow_grpo
    ``global_std``), which stops near-constant groups from blowing small reward differences up.

Several rewards are combined in one of two ways (Flow-Factory ``advantage_aggregation``):
  * ``sum``: r = Σ_k w_k r_k first, then the group normalisation above;
  * ``gdpo``: each reward is group-normalised on its own, the weighted sum Σ_k w_k A_k is taken, and
    the result is standardised over the whole batch: (A − mean_B A) / (std_B A + eps).

Advantage clipping (``adv_clip_max``) belongs to the loss, as in flow_grpo, not here.

Distributed: when ``torch.distributed`` is initialised with more than one rank, rewards and group ids
are all-gathered first (every rank must hold the same number of samples), so groups split across
ranks are normalised over all their members; each rank gets back its own slice. Group ids must be
global (``data.repeat_groups(..., first_group)``): equal ids on two ranks are one group. The metrics
(``advantage_mean``, ``advantage_abs_max``) are over every rank's samples.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from reference_trainer.errors import require

AGGREGATIONS = ("sum", "gdpo")


@dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """How ``AdvantageProcessor`` combines and normalises rewards (validated on construction)."""

    aggregation: str = "sum"
    """How several rewards combine: ``sum`` (weight, sum, group-normalise) or ``gdpo`` (see module doc)."""
    global_std: bool = False
    """Divide by the batch std instead of the group std (the mean stays per group)."""
    eps: float = 1e-4
    """Added to the std in the denominator (flow_grpo: 1e-4)."""
    weights: dict[str, float] = field(default_factory=dict)
    """Per-reward weights by reward name; a reward not listed has weight 1."""

    def __post_init__(self) -> None:
        require(
            self.aggregation in AGGREGATIONS,
            "aggregation",
            f"must be one of {AGGREGATIONS}, got {self.aggregation!r}",
        )
        require(self.eps > 0, "eps", f"must be > 0, got {self.eps}")
        for name, weight in self.weights.items():
            ok = isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight == weight
            require(ok, f"weights.{name}", f"must be a number, got {weight!r}")


def group_normalize(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float, global_std: bool
) -> torch.Tensor:
    """A_i = (r_i − mean_G r) / (std_G r + eps), per group G of equal ``group_ids``. [B] -> [B], fp64 inside.

    Args:
        rewards: r per sample, [B].
        group_ids: the group of each sample, [B].
        eps: added to the std.
        global_std: divide by the std of the whole batch instead of the group's.

    Returns:
        A per sample, [B] fp64.
    """
    r = rewards.double()
    advantages = torch.empty_like(r)
    batch_std = r.std(unbiased=False)
    for gid in torch.unique(group_ids):
        members = group_ids == gid
        group = r[members]
        std = batch_std if global_std else group.std(unbiased=False)
        advantages[members] = (group - group.mean()) / (std + eps)
    return advantages


class AdvantageProcessor:
    """Turns per-reward values [B] and group ids [B] into advantages [B] (fp32) plus metrics."""

    def __init__(self, config: AdvantageConfig) -> None:
        self.config = config

    def __call__(
        self, rewards: Mapping[str, torch.Tensor], unique_ids: torch.Tensor | Sequence[int]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if not rewards:
            raise ValueError("AdvantageProcessor needs at least one reward")
        group_ids = torch.as_tensor(unique_ids, dtype=torch.int64)
        for name, values in rewards.items():
            if values.shape != group_ids.shape:
                raise ValueError(
                    f"reward '{name}' has shape {tuple(values.shape)}, unique_ids {tuple(group_ids.shape)}"
                )
        rewards, group_ids, local = self._gather(rewards, group_ids)
        cfg = self.config
        weights = {name: float(cfg.weights.get(name, 1.0)) for name in rewards}
        if cfg.aggregation == "sum":
            total = sum(weights[name] * values.double() for name, values in rewards.items())
            advantages = group_normalize(total, group_ids, cfg.eps, cfg.global_std)
        else:  # gdpo
            summed = sum(
                weights[name] * group_normalize(values, group_ids, cfg.eps, cfg.global_std)
                for name, values in rewards.items()
            )
            advantages = (summed - summed.mean()) / (summed.std(unbiased=False) + cfg.eps)
        everyone = advantages.float()
        metrics = {
            "advantage_mean": everyone.mean().item(),
            "advantage_abs_max": everyone.abs().max().item(),
        }
        return everyone[local], metrics

    @staticmethod
    def _gather(
        rewards: Mapping[str, torch.Tensor], group_ids: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, slice]:
        """All-gather across ranks (same local size everywhere); returns the local slice too."""
        local_n = group_ids.shape[0]
        rank = dist.get_rank() if _distributed() else 0
        gathered = {name: gather_rows(values.double()) for name, values in sorted(rewards.items())}
        return gathered, gather_rows(group_ids), slice(rank * local_n, (rank + 1) * local_n)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` [n, ...] concatenated in rank order (``tensor`` itself at one process);
    every rank must hold the same n."""
    if not _distributed():
        return tensor
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([tensor.shape[0]]))
    if len({int(s) for s in sizes}) != 1:
        raise ValueError(f"every rank must hold the same number of samples, got {[int(s) for s in sizes]}")
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)
