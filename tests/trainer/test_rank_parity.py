"""Every registered trainer logs on two ranks the numbers of one process with the same global batch,
under DDP and under FSDP2 (gloo, two CPU ranks).

Parametrised over the registry: a newly registered trainer is covered by registering it (every example
config of it under ``examples/<name>/full/sd3_tiny/``, ``default.yaml`` and variants such as TDM-R1's
``flow_factory.yaml``: ``trainer_utils.parity_cases``; ``trainer_utils.rank_split`` halves its per-rank
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

The same launch cuts each trainer's trained run after step 2 (inside the cycle of every multi-role
trainer) and resumes it to 3 on two ranks: its metrics and final checkpoint are bit-identical to the
straight run's (one rank, every cut and SIGTERM: ``test_resume.py``).

DeepSpeed is not in the CI lock: with ``FFDEBUG_TEST_DEEPSPEED=1`` (``test_deepspeed.py``) a third launch
runs every trainer under ZeRO-2 by the same rules.
"""

from __future__ import annotations

import pytest
import torch
from helpers.trainer.trainer_utils import (
    PARITY_MODES,
    assert_rank_layout_matches,
    load,
    metrics,
    parity_cases,
    still_overrides,
)
from test_deepspeed import OPT_IN as OPT_IN_DEEPSPEED
from test_distributed import _files, torchrun

from reference_trainer.registry import load_builtins, trainer_names

# one xdist worker runs the whole module: its two launches and one-rank runs are module fixtures
pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("rank_parity")]

STEPS = 3
COMMON = ("eval.every=0", "checkpoint.every=0")
LATER_STEPS_REL = 2e-3
"""Relative tolerance of the ``trained`` mode's steps after the first (module docstring)."""

load_builtins()
TRAINERS = trainer_names()
CASES = parity_cases()


BACKENDS = {"ddp": [], "fsdp2": []}
if OPT_IN_DEEPSPEED:  # not in the CI lock (test_deepspeed.py)
    BACKENDS["deepspeed"] = ["backend.zero_stage=2"]


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def two_ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"parity-{request.param}")
    torchrun("parity", str(out), request.param, str(STEPS), *COMMON, *BACKENDS[request.param])
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
            path = CASES[name]
            config = load(path, *COMMON, *still_overrides(path, mode), max_steps=STEPS)
            train(config, root / mode / name)
            done[name, mode] = metrics(root / mode / name)
        return done[name, mode]

    return run


def _refused(two_ranks, name: str) -> None:
    """A case this backend refuses by a documented plan rule (only DeepSpeed has such for an example:
    Muon) is skipped naming the rule; under DDP and FSDP2 a refusal fails."""
    refusal = two_ranks / "trained" / name / "refused.txt"
    if refusal.exists():
        message = refusal.read_text()
        assert "deepspeed" in two_ranks.name, f"{two_ranks.name} refused {name}: {message}"
        pytest.skip(f"DeepSpeed refuses {name}: {message}")


@pytest.mark.parametrize("mode", PARITY_MODES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_two_ranks_log_the_numbers_of_one(two_ranks, one_rank, name, mode):
    _refused(two_ranks, name)
    single, double = one_rank(name, mode), metrics(two_ranks / mode / name)
    assert [r["optimizer_step"] for r in double] == list(range(1, STEPS + 1))
    if mode == "still":
        assert_rank_layout_matches(single, double)
    else:
        assert_rank_layout_matches(single[:1], double[:1])
        assert_rank_layout_matches(single[1:], double[1:], rel_tol=LATER_STEPS_REL)


@pytest.mark.parametrize("name", sorted(CASES))
def test_two_rank_cut_and_resume_is_bitwise_exact(two_ranks, name):
    _refused(two_ranks, name)
    straight, cut = two_ranks / "trained" / name, two_ranks / "cut" / name
    assert (straight / "metrics.jsonl").read_bytes() == (cut / "metrics.jsonl").read_bytes()
    final = f"checkpoints/step-{STEPS:06d}"
    a, b = _files(straight / final), _files(cut / final)
    assert a.keys() == b.keys() and any(key.startswith("state/") for key in a)
    assert [key for key in a if a[key] != b[key]] == []


def test_every_registered_trainer_has_an_example_that_splits_over_two_ranks():
    from helpers.trainer.trainer_utils import rank_split

    assert set(TRAINERS) <= set(CASES)
    for name, path in CASES.items():
        (override,) = rank_split(path, 2)
        assert override.split("=")[0] in {"train.prompts_per_iteration", "data.batch_size"}, (name, override)
