"""Every registered trainer logs on two ranks the numbers of one process with the same global batch,
under DDP and under FSDP2 (gloo, two CPU ranks).

Parametrised over the registry: a newly registered trainer is covered by registering it (its example
config ``examples/<name>/full/sd3_tiny/default.yaml``; ``trainer_utils.rank_split`` halves its per-rank
batch, read from its rollout size or ``data.batch_size``). One torchrun launch per backend runs every
trainer in turn (``distributed_driver.py parity``), 3 optimizer steps each, in two modes:

* ``still`` (every learning rate 1e-12): the weights stay where they started, so every step of every
  role reads the same weights on both layouts, and what is left between them is the smaller per-rank
  GEMMs and the order of the gradient all-reduce: every float of every step within the default
  rank-layout tolerance (1e-7 + 1e-5·|v|). This is what finds a draw keyed by the rank, a shuffle of
  one rank's samples or a statistic over one rank's batch (before this test: TDM-R1's surrogate step,
  19,000 × the tolerance; DiffusionOPD's first step, 6,900 ×).
* ``trained`` (the example learning rates): the first step as tight; the later ones carry AdamW's
  amplification of last-bit gradient differences (a parameter whose gradient is near 0 takes a step of
  about ±lr whose sign rounding decides): measured worst relative difference 3.2e-4 under DDP and
  2.5e-4 under FSDP2 at ATEN_CPU_CAPABILITY avx2, 1.2e-4 at ``default`` (AMD EPYC; offline DPO's
  ``reward_w`` / ``reward_l``, β-scaled differences of two MSEs); tolerance 1e-7 + 2e-3·|v|. With every
  learning rate at 1e-12 the same steps match at the default tolerance: the spread is the update's.

DeepSpeed is not in the CI lock; ``test_deepspeed.py`` (opt-in) runs its own launch.
"""

from __future__ import annotations

import pytest
import torch
from helpers.trainer.trainer_utils import (
    PARITY_MODES,
    assert_rank_layout_matches,
    example,
    load,
    metrics,
    still_overrides,
)
from test_distributed import torchrun

from reference_trainer.registry import load_builtins, trainer_names

pytestmark = pytest.mark.integration

STEPS = 3
COMMON = ("eval.every=0", "checkpoint.every=0")
LATER_STEPS_REL = 2e-3
"""Relative tolerance of the ``trained`` mode's steps after the first (module docstring)."""

load_builtins()
TRAINERS = trainer_names()


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def two_ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"parity-{request.param}")
    torchrun("parity", str(out), request.param, str(STEPS), *COMMON)
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The one-process runs, made once per (trainer, mode) and shared by both backends."""
    from reference_trainer.run import train

    root = tmp_path_factory.mktemp("parity-one")
    done: dict[tuple[str, str], list[dict]] = {}

    def run(name: str, mode: str) -> list[dict]:
        if (name, mode) not in done:
            torch.set_num_threads(1)
            config = load(example(name), *COMMON, *still_overrides(example(name), mode), max_steps=STEPS)
            train(config, root / mode / name)
            done[name, mode] = metrics(root / mode / name)
        return done[name, mode]

    return run


@pytest.mark.parametrize("mode", PARITY_MODES)
@pytest.mark.parametrize("name", TRAINERS)
def test_two_ranks_log_the_numbers_of_one(two_ranks, one_rank, name, mode):
    single, double = one_rank(name, mode), metrics(two_ranks / mode / name)
    assert [r["optimizer_step"] for r in double] == list(range(1, STEPS + 1))
    if mode == "still":
        assert_rank_layout_matches(single, double)
    else:
        assert_rank_layout_matches(single[:1], double[:1])
        assert_rank_layout_matches(single[1:], double[1:], rel_tol=LATER_STEPS_REL)


def test_every_registered_trainer_has_an_example_that_splits_over_two_ranks():
    from helpers.trainer.trainer_utils import rank_split

    for name in TRAINERS:
        assert example(name).is_file(), name
        (override,) = rank_split(example(name), 2)
        assert override.split("=")[0] in {"train.prompts_per_iteration", "data.batch_size"}, (name, override)
