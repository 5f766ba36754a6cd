"""The reference trainer on two CPU ranks (gloo, ``torchrun --nproc-per-node 2``) and the backend rules.

torchrun launches (``distributed_driver.py``), one per execution composition plus one probe, ~90 s in all:

* probe: the DDP gradient of each rank's 2 samples equals one process's gradient on the concatenated
  4 (``torch.allclose``, rtol 1e-5, atol 1e-6 × the largest gradient entry; measured max |Δ| 3e-8 of
  0.17), while the un-reduced local gradient differs by 2e-2; prompts ``a`` (rank 0) and ``b`` (rank 1)
  get ±1 advantages per group (hand-derived: ±std/(std + eps)); the sampler shards are disjoint;
* one trainer per execution composition — ``grpo`` (generation + runtime reward), ``dmd2`` (generation
  without feedback, two roles, cut inside a rollout iteration), ``sft`` (dataset) — runs N steps
  straight and M steps then resumed to N: metrics, evaluations and the final checkpoint (export and
  state) must be bitwise equal; the straight run must match a one-process run with the same global
  batch (every float within 1e-7 + 1e-5·|value|; measured worst relative difference 2e-6).

In-process: every plan rule fires with a one-line ``ConfigError`` before any file of the model fixture
is opened (an audit hook watches the fixture directory), and a world-size change on resume is refused
naming both sizes.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import REPO, TESTS, hang_timeout, subprocess_env
from helpers.trainer.trainer_utils import assert_rank_layout_matches, example, load, metrics

DRIVER = TESTS / "helpers" / "trainer" / "distributed_driver.py"
TIMEOUT = hang_timeout(900)  # a two-rank run: 20-40 s idle, several minutes at load 10
FAST_EVAL = "eval.num_inference_steps=2"
COMPOSITIONS = {
    # trainer: (N, M, two-rank overrides, one-rank overrides with the same global batch)
    "grpo": (4, 2, ["train.prompts_per_iteration=1", "checkpoint.every=0"], ["checkpoint.every=0"]),
    "dmd2": (4, 2, ["train.prompts_per_iteration=2"], []),
    "sft": (3, 1, ["data.batch_size=1"], []),
}


NATIVE_CRASH = re.compile(r"exitcode\s*:\s*-(?:11|7|6)\b")
"""A rank killed by SIGSEGV / SIGBUS / SIGABRT in torchrun's failure table: a crash below Python, not a
wrong number. Seen in CI on a loaded machine: SIGSEGV once in gloo under FSDP2, and SIGABRT once
(``terminate called without an active exception``, a C++ thread left joinable) in a rank of the DDP
probe; neither reproduced in 4 idle launches. A Python error exits 1 and is never retried."""


def torchrun(*args: str, driver: Path = DRIVER) -> float:
    """Run ``driver`` on two ranks (free rendezvous port, loopback only); its wall time in seconds.

    Every rank runs with ``PYTHONFAULTHANDLER=1``, so a native crash prints each rank's Python stack. A
    launch in which a rank died of a native crash (``NATIVE_CRASH``) is reported as a warning, with that
    stack, and run once more from an empty output directory (``args[1]``, every driver mode's OUT); any
    other failure, or a second crash, fails the test."""
    env = {
        **subprocess_env(),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "PYTHONFAULTHANDLER": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(driver), *args]
    start = time.monotonic()
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    if done.returncode != 0 and NATIVE_CRASH.search(done.stderr):
        warnings.warn(
            f"torchrun {' '.join(args[:2])}: a rank crashed natively; run again:\n{done.stderr[-6000:]}",
            stacklevel=2,
        )
        shutil.rmtree(args[1], ignore_errors=True)
        start = time.monotonic()
        done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-4000:]
    return time.monotonic() - start


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe")
    torchrun("probe", str(out))
    return json.loads((out / "probe.json").read_text())


@pytest.fixture(scope="module", params=sorted(COMPOSITIONS))
def two_rank(request, tmp_path_factory):
    name = request.param
    n, m, overrides, _ = COMPOSITIONS[name]
    out = tmp_path_factory.mktemp(f"two-rank-{name}")
    torchrun("resume", str(out), name, str(n), str(m), FAST_EVAL, *overrides)
    return name, out


@pytest.mark.integration
def test_ddp_gradient_equals_single_process_gradient(probe):
    assert probe["world_size"] == 2
    assert probe["prepared_type"] == "DistributedDataParallel" and probe["routed"]
    assert probe["optimizer_children"] == ["AcceleratedOptimizer"]
    assert probe["grad_allclose"], probe
    assert probe["grad_max_abs_difference"] <= 1e-6 * probe["grad_max_abs"]
    # without the all-reduce the gradient is far off: the comparison can fail
    assert probe["local_grad_max_abs_difference"] > 1e-3 * probe["grad_max_abs"]


@pytest.mark.integration
def test_two_prompts_on_two_ranks_get_plus_minus_one_per_group(probe):
    eps = 1e-4  # AdvantageConfig default
    a, b = 0.5 / (0.5 + eps), 1.0 / (1.0 + eps)  # rewards [0, 1] (std 0.5) and [5, 7] (std 1)
    assert probe["advantages"] == pytest.approx([-a, a, -b, b], rel=1e-6)
    # the old rank-local ids put both prompts in group 0: normalised together, not ±1
    assert probe["advantages_rank_local_ids"] != pytest.approx([-a, a, -b, b], rel=1e-2)


@pytest.mark.integration
def test_sampler_shards_are_disjoint(probe):
    for epoch, (rank0, rank1) in probe["shards"].items():
        assert not set(rank0) & set(rank1), epoch
        assert sorted(rank0 + rank1) == list(range(8)), epoch


def _files(checkpoint: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(checkpoint)): p.read_bytes() for p in sorted(checkpoint.rglob("*")) if p.is_file()
    }


@pytest.mark.integration
def test_two_rank_exact_resume(two_rank):
    name, out = two_rank
    n = COMPOSITIONS[name][0]
    straight, cut = out / "straight", out / "cut"
    assert (straight / "metrics.jsonl").read_bytes() == (cut / "metrics.jsonl").read_bytes()
    records = metrics(straight)
    assert [r["optimizer_step"] for r in records] == list(range(1, n + 1))  # one writer, one row a step
    if (straight / "eval.jsonl").exists():
        resumed = (cut / "eval.jsonl").read_text().splitlines()
        assert set((straight / "eval.jsonl").read_text().splitlines()) <= set(resumed)
    final = f"checkpoints/step-{n:06d}"
    a, b = _files(straight / final), _files(cut / final)
    assert a.keys() == b.keys() and any(key.startswith("state/") for key in a)
    assert [key for key in a if a[key] != b[key]] == []
    assert json.loads((straight / "run.json").read_text())["backend"] == {"kind": "ddp", "world_size": 2}


@pytest.mark.integration
def test_two_ranks_match_one_rank_with_the_same_global_batch(two_rank, tmp_path):
    from reference_trainer.run import train

    name, out = two_rank
    n, _, _, one_rank = COMPOSITIONS[name]
    torch.set_num_threads(1)
    train(load(example(name), FAST_EVAL, *one_rank, max_steps=n), tmp_path / "one")
    single, double = metrics(tmp_path / "one"), metrics(out / "straight")
    assert len(single) == len(double) == n
    assert_rank_layout_matches(single, double)


@pytest.mark.integration
def test_world_size_change_on_resume_is_refused(two_rank, tmp_path):
    from reference_trainer.checkpoint import CheckpointError
    from reference_trainer.run import build_trainer

    name, out = two_rank
    n, _, overrides, _ = COMPOSITIONS[name]
    shutil.copytree(out / "cut", tmp_path / "run")
    config = load(example(name), FAST_EVAL, *overrides, max_steps=n + 1)
    with pytest.raises(CheckpointError, match="world size 2, this launch has world size 1"):
        build_trainer(config, tmp_path / "run", resume="latest")


# ------------------------------------------------------------------------------------------ rules
class FixtureOpens:
    """Records every file opened under the packaged fixtures (a ``sys.addaudithook`` cannot be
    removed, so one hook records only while ``watching``)."""

    def __init__(self):
        from reference_trainer.adapters.base import FIXTURES

        self.root = str(FIXTURES)
        self.opened: list[str] = []
        self.watching = False
        sys.addaudithook(self.hook)

    def hook(self, event: str, args: tuple) -> None:
        if self.watching and event == "open" and isinstance(args[0], str | Path):
            if str(args[0]).startswith(self.root):
                self.opened.append(str(args[0]))


@pytest.fixture(scope="module")
def fixture_opens():
    return FixtureOpens()


RULES = [
    (
        "grpo",
        ["backend.kind=deepspeed", "backend.zero_stage=3"],
        "backend.zero_stage: got 3: ZeRO-3 is refused",
    ),
    ("dmd2", ["backend.kind=deepspeed", "backend.zero_stage=3"], "several trainable roles (generator, fake)"),
    ("grpo", ["backend.kind=fsdp"], "backend.kind: FSDP1 ('fsdp') is refused"),
    ("grpo", ["backend.kind=fsdp2", "backend.use_orig_params=true"], "backend.use_orig_params: is an FSDP1"),
    (
        "grpo",
        ["optimizers.0.optimizer=muon", "backend.kind=deepspeed", "backend.zero_stage=1"],
        "optimizers[0].optimizer: muon is refused with backend.kind deepspeed",
    ),
    ("grpo", ["backend.kind=fsdp2"], "backend.kind: fsdp2 needs a launch of several processes"),
    ("grpo", ["backend.kind=deepspeed", "backend.zero_stage=2"], "backend.kind: deepspeed needs a launch of"),
    ("grpo", ["backend.kind=deepspeed"], "backend.zero_stage: kind deepspeed needs an explicit zero_stage"),
    ("grpo", ["backend.zero_stage=1"], "backend.zero_stage: is read by kind deepspeed only"),
    ("grpo", ["backend.kind=ddp"], "backend.kind: ddp needs a launch of several processes"),
    ("grpo", ["backend.activation_checkpointing=some"], "backend.activation_checkpointing: must be one of"),
]


@pytest.mark.parametrize(
    "trainer, overrides, message", RULES, ids=[m.split(":")[0] + str(i) for i, (_, _, m) in enumerate(RULES)]
)
def test_rule_fires_before_any_model_file_is_opened(fixture_opens, tmp_path, trainer, overrides, message):
    from reference_trainer.errors import ConfigError
    from reference_trainer.run import build_trainer

    fixture_opens.opened.clear()
    fixture_opens.watching = True
    try:
        with pytest.raises(ConfigError) as error:
            build_trainer(load(example(trainer), *overrides), tmp_path / "run")
    finally:
        fixture_opens.watching = False
    assert message in str(error.value) and "\n" not in str(error.value)
    assert fixture_opens.opened == []


def test_muon_refused_without_torch_muon(fixture_opens, tmp_path, monkeypatch):
    from reference_trainer.errors import ConfigError
    from reference_trainer.run import build_trainer

    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    fixture_opens.opened.clear()
    fixture_opens.watching = True
    try:
        with pytest.raises(ConfigError, match=r"optimizers\[0\].optimizer: muon needs torch.optim.Muon"):
            build_trainer(load(example("grpo"), "optimizers.0.optimizer=muon"), tmp_path / "run")
    finally:
        fixture_opens.watching = False
    assert fixture_opens.opened == []


def test_single_backend_under_a_multi_process_launch_is_refused(tmp_path, monkeypatch):
    from reference_trainer.errors import ConfigError
    from reference_trainer.run import build_trainer

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="backend.kind: single, but this process is one of 2 torchrun"):
        build_trainer(load(example("sft")), tmp_path / "run")


def test_cli_rule_is_one_line_and_exit_2(tmp_path, capsys):
    from reference_trainer.cli import main

    code = main(
        ["train", str(example("dmd2")), "--output-dir", str(tmp_path / "run"), "--set", "backend.kind=fsdp1"]
    )
    lines = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("reference-trainer: error:")
    ]
    assert code == 2 and len(lines) == 1 and "backend.kind: FSDP1 ('fsdp1') is refused" in lines[0]


def test_fixture_watch_sees_a_model_load(fixture_opens, tmp_path):
    """The control of the rule tests: building a valid run opens the fixture's files."""
    from reference_trainer.run import build_trainer

    fixture_opens.opened.clear()
    fixture_opens.watching = True
    try:
        build_trainer(load(example("sft")), tmp_path / "run")
    finally:
        fixture_opens.watching = False
    assert any(path.endswith(".safetensors") for path in fixture_opens.opened)
