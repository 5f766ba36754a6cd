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
runs every trainer under ZeRO-2 by the same rules (a plan refusal, Muon, is listed, not failed).

One test per backend checks every case and reports every failure (case, mode, step, metric): as one
test its launch runs once whatever the xdist layout (measured: 73 s DDP, 123 s FSDP2 on two busy cores).
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

pytestmark = pytest.mark.integration

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


def _one_rank(root, name: str, mode: str) -> list[dict]:
    """The one-process run of case ``name`` in ``mode`` under ``root`` (made once)."""
    from reference_trainer.run import train

    out = root / mode / name
    if not (out / "metrics.jsonl").exists():
        torch.set_num_threads(1)
        path = CASES[name]
        train(load(path, *COMMON, *still_overrides(path, mode), max_steps=STEPS), out)
    return metrics(out)


def _case_failures(two, one, name: str) -> list[str]:
    """What differs for case ``name`` between the two-rank launch ``two`` and one process (``one``):
    each mode's metrics (module docstring), then the two-rank cut and resume against the straight run."""
    failures = []
    for mode in PARITY_MODES:
        single, double = _one_rank(one, name, mode), metrics(two / mode / name)
        try:
            assert [r["optimizer_step"] for r in double] == list(range(1, STEPS + 1)), "steps"
            if mode == "still":
                assert_rank_layout_matches(single, double)
            else:
                assert_rank_layout_matches(single[:1], double[:1])
                assert_rank_layout_matches(single[1:], double[1:], rel_tol=LATER_STEPS_REL)
        except AssertionError as error:
            failures.append(f"{name} {mode}: {error}")
    straight, cut = two / "trained" / name, two / "cut" / name
    if (straight / "metrics.jsonl").read_bytes() != (cut / "metrics.jsonl").read_bytes():
        failures.append(f"{name}: the two-rank cut and resume logs other metrics than the straight run")
    final = f"checkpoints/step-{STEPS:06d}"
    a, b = _files(straight / final), _files(cut / final)
    if a.keys() != b.keys() or not any(key.startswith("state/") for key in a):
        failures.append(f"{name}: the resumed run's final checkpoint has other files")
    elif differ := [key for key in a if a[key] != b[key]]:
        failures.append(f"{name}: the resumed run's final checkpoint differs in {differ}")
    return failures


@pytest.fixture(scope="module")
def one_rank_root(tmp_path_factory):
    """Where the one-process runs go: made once per worker, shared by the backends' tests."""
    return tmp_path_factory.mktemp("parity-one")


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_trainer_on_two_ranks_logs_the_numbers_of_one_and_resumes_exactly(
    backend, tmp_path, one_rank_root
):
    """One test per backend (its launch runs once whatever the xdist layout); every case is checked and
    every failure reported, naming the case, the mode, the step and the metric."""
    two = tmp_path / "two"
    torchrun("parity", str(two), backend, str(STEPS), *COMMON, *BACKENDS[backend])
    failures, refused = [], []
    for name in sorted(CASES):
        refusal = two / "trained" / name / "refused.txt"
        if refusal.exists():  # a documented plan rule; only DeepSpeed has one for an example (Muon)
            refused.append(f"{name}: {refusal.read_text()}")
            continue
        failures += _case_failures(two, one_rank_root, name)
    assert not failures, "\n".join(failures)
    assert backend == "deepspeed" or not refused, refused
    assert len(refused) < len(CASES)


def test_every_registered_trainer_has_an_example_that_splits_over_two_ranks():
    from helpers.trainer.trainer_utils import rank_split

    assert set(TRAINERS) <= set(CASES)
    for name, path in CASES.items():
        (override,) = rank_split(path, 2)
        assert override.split("=")[0] in {"train.prompts_per_iteration", "data.batch_size"}, (name, override)
