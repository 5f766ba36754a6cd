"""Machine limits of a run, checked before any model loads (``run.build_trainer``).

* ``runtime.threads`` must not exceed the machine's cores (``os.cpu_count()``): torch accepts any
  count and a huge one crashes the process inside its thread pool.
* One rollout must fit in half the physical memory: samples × latent elements × (steps + 1) × 4 bytes
  (``config.RolloutSize``), for the trainer's rollout (``TrainingArguments.rollout_size``) and, with
  evaluation on, for an evaluation's samples. A refusal names the fields that set the size, so a
  ``train.group_size`` of 10⁹ is one line at load instead of a ``MemoryError`` minutes later.

The limits depend on the machine, not on the config alone, which is why they are checked here and
not in the config dataclasses.
"""

from __future__ import annotations

import os

from reference_trainer.config import RolloutSize, RunConfig
from reference_trainer.errors import ConfigError

MEMORY_FRACTION = 0.5
"""A rollout may use at most this fraction of the physical memory."""


def cpu_cores() -> int:
    """The machine's logical cores."""
    return os.cpu_count() or 1


def physical_memory() -> int:
    """The machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3g} GiB"


def check_threads(config: RunConfig) -> None:
    """``runtime.threads`` within the machine's cores."""
    cores = cpu_cores()
    if config.runtime.threads > cores:
        raise ConfigError(
            "runtime.threads",
            f"must be <= {cores} (the cores of this machine), got {config.runtime.threads}",
        )


def check_rollout_memory(size: RolloutSize, latent_elements: int) -> None:
    """``ConfigError`` naming the fields of ``size`` when one rollout needs more than half the memory."""
    limit = int(physical_memory() * MEMORY_FRACTION)
    needed = size.nbytes(latent_elements)
    if needed <= limit:
        return
    factors = " × ".join(f"{name or 'prompts'} {value}" for name, value in size.factors)
    steps_name, steps = size.steps
    raise ConfigError(
        ", ".join(size.fields()),
        f"one rollout needs {factors} × {latent_elements} latent elements × ({steps_name or 'steps'} "
        f"{steps} + 1) × 4 bytes = {_gib(needed)}, more than half the physical memory ({_gib(limit)}); "
        "lower these fields",
    )


def check_resources(config: RunConfig, latent_elements: int | None, eval_prompt_count: int) -> None:
    """Threads, then the training rollout and (with evaluation) the evaluation samples.

    ``latent_elements`` is the element count of one latent (``None``: the adapter cannot tell before
    loading, and the memory check is skipped).
    """
    check_threads(config)
    if latent_elements is None:
        return
    sizes = [config.train.rollout_size()]
    if config.eval.every:
        sizes.append(config.eval.rollout_size(eval_prompt_count))
    for size in sizes:
        if size is not None:
            check_rollout_memory(size, latent_elements)
