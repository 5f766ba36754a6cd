"""Exact resume for every registered trainer: N steps in one go == a cut or signalled run + resume.

The trainers come from the registries (``registry.trainer_names()``), each run from its example config
``examples/<trainer>/full/sd3_tiny/default.yaml``: a new trainer is covered by registering it and adding
its example, without editing this file. For each trainer:

* every cut ``0 < M < N``: ``--max-steps M``, then resume to N (``--max-steps`` is exact, so M falls
  on cycle boundaries and inside rollout iterations / data epochs alike);
* SIGTERM, sent to the process during the first backward of optimizer step N/2 (inside an
  accumulation window for dataset trainers): the run stops at the end of that cycle, then resumes.

An interrupted run must equal the uninterrupted one bit for bit: every ``metrics.jsonl`` record, the
uninterrupted run's ``eval.jsonl`` records, and every file of the final checkpoint (each tensor
compared as raw bits). The resumed process must execute exactly the remaining optimizer steps,
counted at ``CompositeOptimizer.step`` (a resume that silently restarted from step 0 would reproduce
the same numbers).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch
from helpers import REPO
from helpers.trainer.trainer_utils import load, metrics
from safetensors.torch import load_file

from reference_trainer.registry import resolve_trainer, trainer_names

pytestmark = (
    pytest.mark.numeric
)  # bit-exact resume on every CPU; CI runs it again at ATEN_CPU_CAPABILITY=default

N = 6
"""Optimizer steps of every uninterrupted run."""
SIGNAL_STEP = N // 2
"""The optimizer step during whose first backward SIGTERM is sent."""
TRAINERS = trainer_names()


def example_config(name: str) -> Path:
    path = REPO / "examples" / name / "full" / "sd3_tiny" / "default.yaml"
    assert path.is_file(), f"registered trainer {name!r} has no example config {path.relative_to(REPO)}"
    return path


FAST_EVAL = ("eval.num_inference_steps=2",)
"""Cheaper evaluations (their records are still compared); the only override, the same for every trainer."""


def run(name: str, output_dir: Path, max_steps: int, *, resume: str | None = None):
    from reference_trainer.run import train

    config = load(example_config(name), *FAST_EVAL, max_steps=max_steps)
    return train(config, output_dir, resume=resume)


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """``straight_runs(name)``: the directory of the uninterrupted N-step run of ``name`` (run once)."""
    runs: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in runs:
            runs[name] = tmp_path_factory.mktemp(f"straight-{name}")
            run(name, runs[name], N)
        return runs[name]

    return get


@pytest.fixture
def optimizer_steps(monkeypatch):
    """The roles of the optimizer steps actually taken from now on (``CompositeOptimizer.step``)."""
    from reference_trainer.optim import CompositeOptimizer

    roles: list[str] = []
    step = CompositeOptimizer.step

    def counted(self, role):
        roles.append(role)
        return step(self, role)

    monkeypatch.setattr(CompositeOptimizer, "step", counted)
    return roles


# --------------------------------------------------------------------------------------------------
# comparison of two run directories
# --------------------------------------------------------------------------------------------------


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_files(left: Path, right: Path) -> None:
    """The same files under both directories; tensors equal bit for bit, everything else byte for byte."""
    files = sorted(path.relative_to(left) for path in left.rglob("*") if path.is_file())
    assert files == sorted(path.relative_to(right) for path in right.rglob("*") if path.is_file())
    for name in files:
        if name.suffix != ".safetensors":
            assert (left / name).read_bytes() == (right / name).read_bytes(), str(name)
            continue
        a, b = load_file(left / name), load_file(right / name)
        assert a.keys() == b.keys(), str(name)
        for key in a:
            assert (a[key].dtype, a[key].shape) == (b[key].dtype, b[key].shape), f"{name}:{key}"
            assert _bits(a[key]) == _bits(b[key]), f"{name}:{key} differs"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def assert_same_run(straight: Path, resumed: Path) -> None:
    from reference_trainer.cli import first_difference

    a, b = metrics(straight), metrics(resumed)
    assert len(a) == N and [r["optimizer_step"] for r in a] == list(range(1, N + 1))
    assert first_difference(a, b) is None, first_difference(a, b)
    # every evaluation of the straight run, identical (the interrupted one adds one where it stopped)
    evaluations = {record["optimizer_step"]: record for record in read_jsonl(resumed / "eval.jsonl")}
    for record in read_jsonl(straight / "eval.jsonl"):
        assert evaluations.get(record["optimizer_step"]) == record
    final = f"checkpoints/step-{N:06d}"
    assert_same_files(straight / final, resumed / final)


# --------------------------------------------------------------------------------------------------
# every registered trainer
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize("cut", range(1, N))
@pytest.mark.parametrize("name", TRAINERS)
def test_cut_and_resume_is_bitwise_exact(name, cut, tmp_path, straight_runs, optimizer_steps):
    straight = straight_runs(name)
    first = run(name, tmp_path, cut)
    assert first.optimizer_step == cut and len(metrics(tmp_path)) == cut  # --max-steps is exact
    optimizer_steps.clear()
    run(name, tmp_path, N, resume="latest")
    assert optimizer_steps == [record["role"] for record in metrics(straight)[cut:]]
    assert_same_run(straight, tmp_path)


def expected_signal_stop(name: str, records: list[dict]) -> int:
    """Where a run signalled during step SIGNAL_STEP stops: at the end of the cycle of that step
    (generation: its rollout iteration; dataset: its accumulation window, i.e. the step itself)."""
    trainer_cls, _ = resolve_trainer(name)
    if trainer_cls.execution_contract.acquisition == "dataset":
        return SIGNAL_STEP
    iteration = records[SIGNAL_STEP - 1]["rollout_iteration"]
    return max(r["optimizer_step"] for r in records if r["rollout_iteration"] == iteration)


@pytest.mark.integration
@pytest.mark.parametrize("name", TRAINERS)
def test_sigterm_and_resume_is_bitwise_exact(name, tmp_path, monkeypatch, straight_runs, optimizer_steps):
    from reference_trainer.checkpoint import list_checkpoints, read_trainer_state
    from reference_trainer.optim import RolePhase

    assert threading.current_thread() is threading.main_thread()  # else SIGTERM would end pytest
    straight = straight_runs(name)
    stop = expected_signal_stop(name, metrics(straight))
    assert stop < N, f"{name}: a cycle ends only at step {stop}; raise N so that the resume has work"
    sent: list[tuple[int, int]] = []
    backward = RolePhase.backward

    def signalling(self, loss, step_metrics=None, **kwargs):
        if self.optimizer_step == SIGNAL_STEP and not sent:
            sent.append((self.optimizer_step, self.backward_calls))
            os.kill(os.getpid(), signal.SIGTERM)  # handled by the trainer: stop at the next boundary
        return backward(self, loss, step_metrics, **kwargs)

    monkeypatch.setattr(RolePhase, "backward", signalling)
    stopped = run(name, tmp_path, N)
    monkeypatch.setattr(RolePhase, "backward", backward)
    assert sent == [(SIGNAL_STEP, 0)] and stopped._stop_signal == signal.SIGTERM
    assert stopped.optimizer_step == stop and len(metrics(tmp_path)) == stop
    assert read_trainer_state(list_checkpoints(tmp_path)[-1])["optimizer_step"] == stop
    optimizer_steps.clear()
    run(name, tmp_path, N, resume="latest")
    assert optimizer_steps == [record["role"] for record in metrics(straight)[stop:]]
    assert_same_run(straight, tmp_path)


def test_every_registered_trainer_is_covered():
    """The parametrisation is the registry itself, and each trainer has the example config it runs."""
    from reference_trainer import registry

    assert TRAINERS == sorted(set(registry.TRAINERS) & set(registry.ARGUMENTS)) and len(TRAINERS) >= 5
    for name in TRAINERS:
        assert load(example_config(name)).trainer == name


# --------------------------------------------------------------------------------------------------
# cycle positions in checkpoints
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_resume_inside_a_rollout_iteration_with_a_reference_snapshot(tmp_path, optimizer_steps):
    """GRPO with 2 optimizer steps per rollout iteration and a KL reference snapshot, cut after the
    first step of the first iteration: the resume replays that iteration's rollout from its start
    weights and finishes it."""
    from reference_trainer.checkpoint import read_trainer_state
    from reference_trainer.run import train

    config = REPO / "examples/grpo/full/sd3_tiny/default.yaml"
    overrides = ("train.kl_beta=0.01", "train.gradient_steps_per_iteration=2")
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    train(load(config, *overrides, max_steps=4), straight)
    train(load(config, *overrides, max_steps=1), cut)
    assert read_trainer_state(cut / "checkpoints/step-000001")["cycle"] == {"steps_done": 1}
    optimizer_steps.clear()
    train(load(config, *overrides, max_steps=4), cut, resume="latest")
    assert optimizer_steps == ["policy"] * 3
    from reference_trainer.cli import first_difference

    assert first_difference(metrics(straight), metrics(cut)) is None
    assert_same_files(straight / "checkpoints/step-000004", cut / "checkpoints/step-000004")


@pytest.mark.integration
def test_max_steps_stops_inside_a_cycle_and_records_its_position(tmp_path):
    """DMD2 with 3 optimizer steps per rollout iteration and --max-steps 4: exactly 4 steps run; the
    final checkpoint is step 4, in rollout iteration 1 with 1 of its 3 steps done, and it carries the
    generator/fake weights of that iteration's start (= the weights after step 3)."""
    from reference_trainer.checkpoint import list_checkpoints, read_trainer_state
    from reference_trainer.run import train

    config_path = REPO / "examples/dmd2/full/sd3_tiny/default.yaml"
    train(load(config_path, "checkpoint.every=3", max_steps=4), tmp_path)
    records = metrics(tmp_path)
    assert [r["role"] for r in records] == ["fake", "fake", "generator", "fake"]
    assert [r["rollout_iteration"] for r in records] == [0, 0, 0, 1]
    assert [path.name for path in list_checkpoints(tmp_path)] == ["step-000003", "step-000004"]
    state = read_trainer_state(tmp_path / "checkpoints/step-000004")
    assert state["optimizer_step"] == 4 and state["rollout_iteration"] == 1
    assert state["cycle"] == {"steps_done": 1}
    assert read_trainer_state(tmp_path / "checkpoints/step-000003")["cycle"] == {"steps_done": 0}
    cycle_start = load_file(tmp_path / "checkpoints/step-000004/state/cycle_start.safetensors")
    after_step_3 = load_file(tmp_path / "checkpoints/step-000003/state/variants.safetensors")
    assert cycle_start.keys() == after_step_3.keys()
    assert all(torch.equal(cycle_start[key], after_step_3[key]) for key in cycle_start)
    assert not (tmp_path / "checkpoints/step-000003/state/cycle_start.safetensors").exists()


@pytest.mark.integration
def test_dataset_checkpoints_record_the_sampler_position_and_no_open_cycle(tmp_path):
    """SFT, 8 records in batches of 2 with 2 batches per optimizer step (2 steps per data epoch),
    a checkpoint after every step: each is between cycles (``steps_done`` 0, no cycle-start weights)
    and records the sampler position (data_epoch, batches consumed in it) after that step."""
    from reference_trainer.checkpoint import list_checkpoints, read_trainer_state
    from reference_trainer.run import train

    train(load(example_config("sft"), "checkpoint.every=1", max_steps=5), tmp_path)
    states = [read_trainer_state(path) for path in list_checkpoints(tmp_path)]
    assert [s["optimizer_step"] for s in states] == [1, 2, 3, 4, 5]
    assert [s["cycle"] for s in states] == [{"steps_done": 0}] * 5
    assert [(s["sampler"]["data_epoch"], s["sampler"]["batches_in_epoch"]) for s in states] == [
        (0, 2),
        (1, 0),
        (1, 2),
        (2, 0),
        (2, 2),
    ]
    assert not list(tmp_path.glob("checkpoints/*/state/cycle_start.safetensors"))


# --------------------------------------------------------------------------------------------------
# run identity
# --------------------------------------------------------------------------------------------------


@pytest.mark.integration
def test_resume_refuses_a_different_run_before_loading(tmp_path, monkeypatch):
    """A changed objective (train.kl_beta) is refused with the field named, before any model loads."""
    from reference_trainer.adapters.sd3 import SD3TinyAdapter
    from reference_trainer.checkpoint import CheckpointError
    from reference_trainer.run import train

    config_path = REPO / "examples/grpo/full/sd3_tiny/default.yaml"
    train(load(config_path, "train.kl_beta=0.01", max_steps=1), tmp_path)

    def no_loading(self):
        raise AssertionError("model weights loaded before the identity check")

    monkeypatch.setattr(SD3TinyAdapter, "load_pipeline", no_loading)
    with pytest.raises(CheckpointError, match=r"train\.kl_beta"):
        train(load(config_path, "train.kl_beta=0.5", max_steps=2), tmp_path, resume="latest")
    with pytest.raises(CheckpointError, match=r"runtime\.threads"):
        train(
            load(config_path, "train.kl_beta=0.01", "runtime.threads=2", max_steps=2),
            tmp_path,
            resume="latest",
        )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _change(path: Path) -> None:
    """Change one file's contents, keeping it valid for the loader."""
    if path.suffix == ".jsonl":
        lines = path.read_text().splitlines()
        first = json.loads(lines[0])
        first["prompt"] += " at dusk"
        path.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    else:
        from safetensors.torch import save_file

        images = load_file(path)["images"].clone()
        images[0, 0, 0, 0] ^= 1
        save_file({"images": images}, path)


@pytest.mark.integration
@pytest.mark.parametrize(
    "name", ["demonstrations.jsonl", "demonstrations_heldout.jsonl", "images.safetensors"]
)
def test_resume_refuses_a_changed_dataset_file(name, tmp_path, monkeypatch):
    """The identity holds the sha256 of each dataset file: one file changed in place (same path, same
    config) is refused on resume, naming that file's identity field, before any model loads; the CLI
    exits 2."""
    from typer.testing import CliRunner

    from reference_trainer.adapters.sd3 import SD3TinyAdapter
    from reference_trainer.checkpoint import CheckpointError
    from reference_trainer.cli import app
    from reference_trainer.data import TINY_DATASET
    from reference_trainer.run import train

    dataset, out = tmp_path / "dataset", tmp_path / "run"
    shutil.copytree(TINY_DATASET, dataset)
    overrides = (f"data.dataset={dataset}",)
    first = train(load(example_config("sft"), *overrides, max_steps=1), out)
    assert first.identity["inputs"]["dataset"][name] == _sha256(dataset / name)
    _change(dataset / name)
    monkeypatch.setattr(SD3TinyAdapter, "load_pipeline", lambda self: pytest.fail("loaded before the check"))
    field = "inputs.dataset." + name
    with pytest.raises(
        CheckpointError, match=rf"{field}: checkpoint '[0-9a-f]{{64}}', now '{_sha256(dataset / name)}'"
    ):
        train(load(example_config("sft"), *overrides, max_steps=2), out, resume="latest")
    args = [
        "train",
        str(example_config("sft")),
        "--output-dir",
        str(out),
        "--max-steps",
        "2",
        "--resume",
        "latest",
    ]
    result = CliRunner().invoke(app, [*args, "--set", overrides[0]])
    assert result.exit_code == 2 and field in result.output and "CheckpointError" in result.output


@pytest.mark.integration
def test_identity_covers_the_packaged_prompt_file(tmp_path, monkeypatch):
    """A generation run whose prompts default to the packaged list holds that file's hash; a changed
    prompt file is refused on resume with the field named."""
    from reference_trainer import data
    from reference_trainer.checkpoint import CheckpointError
    from reference_trainer.run import train

    prompts = tmp_path / "prompts.txt"
    shutil.copy(data.PROMPTS_FILE, prompts)
    monkeypatch.setattr(data, "PROMPTS_FILE", prompts)
    config = REPO / "examples/grpo/full/sd3_tiny/default.yaml"
    first = train(load(config, "data.prompts=[]", max_steps=1), tmp_path / "run")
    assert first.prompts.prompts == data.default_prompts()  # the run really read the packaged list
    assert first.identity["inputs"]["prompts"] == {"prompts.txt": _sha256(prompts)}
    prompts.write_text(prompts.read_text() + "a purple fox\n")
    with pytest.raises(CheckpointError, match=r"inputs\.prompts\.prompts\.txt: checkpoint"):
        train(load(config, "data.prompts=[]", max_steps=2), tmp_path / "run", resume="latest")
