"""Which noise levels the decoupled trainers train at: the originals' timestep samplers.

Each function returns, for one draw, the schedule indices j (into the rollout's σ_0 = 1 > … > σ_T = 0)
or, for the continuous sampler, the σ values themselves; the trainers key the generator by the counters
and by the sample, minibatch or iteration the original shares a draw over (``trainers.decoupled``).

    fixed        j = 0 .. K − 1, K = int(T·f)                                   (flow_grpo, Flow-Factory)
    shuffle      a random permutation of 0 .. T − 1 per sample, its first K       (NFT, f = 0.99)
    subset       M of 0 .. trunc drawn without replacement, shared                (DGPO)
    stratified   S strata of [lo, K): boundaries linspace(lo, K, S + 1) as integers,
                 one index drawn uniformly inside each                            (AWM "discrete", lo 0;
                                                                                   "discrete_wo_init", lo 1)
    logit_normal t_s = sigmoid(Φ⁻¹((s + u_s)/S)) in a random order, shifted
                 shift·t/(1 + (shift − 1)·t), at least 0.01                       (AWM "logit_normal")

Sources: NVlabs/DiffusionNFT @ 24af5554 ``scripts/train_nft_sd3.py`` (``perms_time = torch.stack([
torch.randperm(num_timesteps_filtered, ...) for _ in range(total_batch_size_filtered)])``, then the first
``num_train_timesteps = int(config.sample.num_steps * config.train.timestep_fraction)``);
Luo-Yihong/DGPO @ 01ceb4b8 ``scripts/train_sd3_dgpo.py`` (``train_timesteps = [step_index for
step_index in range(config.trunc_steps + 1)]``, ``random.sample(train_timesteps, M)`` broadcast from
rank 0); scxue/advantage_weighted_matching @ be513723 ``scripts/train_sd3_awm.py`` (``time_type``
``discrete`` / ``discrete_wo_init``: ``boundaries = torch.linspace(0, int(config.sample.num_steps *
config.train.timestep_fraction), steps=config.train.train_timesteps + 1)``, ``t_indices = lower_bounds
+ (rand_u * (upper_bounds - lower_bounds)).long()``; ``logit_normal``: ``base_uniform_vector =
(torch.arange(T) + torch.rand(T)) / T``, ``normal_dist.icdf``, ``torch.randperm(T)``, ``torch.sigmoid``,
``shift * t_vector / (1 + (shift - 1) * t_vector)``, ``torch.clamp(timesteps, min=0.01)``).
"""

from __future__ import annotations

import torch


def shuffled_indices(num_steps: int, kept: int, generator: torch.Generator) -> torch.Tensor:
    """The first ``kept`` of a random permutation of 0 .. T − 1 (one sample's NFT timesteps), [kept]."""
    return torch.randperm(num_steps, generator=generator)[:kept]


def subset_indices(trunc_steps: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` distinct indices of 0 .. trunc_steps in the order drawn (DGPO), [count]."""
    return torch.randperm(trunc_steps + 1, generator=generator)[:count]


def stratified_indices(low: int, high: int, strata: int, generator: torch.Generator) -> torch.Tensor:
    """One index inside each of ``strata`` equal integer strata of [low, high) (AWM ``discrete``), [strata].

    Raises:
        ValueError: a stratum would be empty (fewer indices than strata).
    """
    if high - low < strata:
        raise ValueError(
            f"{strata} strata of the {high - low} indices {low} .. {high - 1}: a stratum would be empty"
        )
    boundaries = torch.linspace(low, high, strata + 1)
    lower, upper = boundaries[:-1].long(), boundaries[1:].long()
    return lower + (torch.rand(strata, generator=generator) * (upper - lower)).long()


def logit_normal_sigmas(strata: int, shift: float, generator: torch.Generator) -> torch.Tensor:
    """Stratified logit-normal σ (m = 0, s = 1) in a random order, time-shifted, ≥ 0.01 (AWM), [strata]."""
    base = (torch.arange(strata) + torch.rand(strata, generator=generator)) / strata
    u = torch.distributions.Normal(0.0, 1.0).icdf(base)
    t = torch.sigmoid(u[torch.randperm(strata, generator=generator)])
    return (shift * t / (1.0 + (shift - 1.0) * t)).clamp_min(0.01)
