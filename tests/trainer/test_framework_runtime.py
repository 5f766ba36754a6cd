"""Framework invariants: dataset acquisition, roles and ownership, the composite optimizer,
adapters' component runtime, checkpoint publication (incl. a SIGKILL mid-save), and the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import REPO, hang_timeout
from helpers.trainer.trainer_utils import GRPO_CONFIG, load, metrics

SFT_CONFIG = REPO / "examples/sft/full/sd3_tiny/default.yaml"


# ------------------------------------------------------------------------------------- dataset
def test_open_accumulation_window_is_a_config_error_before_training(monkeypatch, tmp_path):
    """8 records, batch 2 -> 4 batches per epoch; gradient_accumulation_steps=3 never closes."""
    from reference_trainer.adapters.sd3 import SD3TinyAdapter
    from reference_trainer.errors import ConfigError
    from reference_trainer.run import build_trainer

    def no_loading(self):
        raise AssertionError("a model loaded before the accumulation check")

    monkeypatch.setattr(SD3TinyAdapter, "load_pipeline", no_loading)
    with pytest.raises(
        ConfigError, match=r"^train\.gradient_accumulation_steps: a rank-local epoch has 4 batches"
    ):
        build_trainer(load(SFT_CONFIG, "train.gradient_accumulation_steps=3"), tmp_path)


def test_distributed_sampler_order_depends_on_epoch_and_resume_skips():
    from reference_trainer.data import DatasetAcquisition

    records = [{"prompt": f"p{i}"} for i in range(8)]
    data = DatasetAcquisition(records, batch_size=2, seed=0, shuffle=True)
    assert isinstance(data.sampler, torch.utils.data.DistributedSampler)
    epoch0 = [batch["prompts"] for batch in data.epoch(0)]
    epoch1 = [batch["prompts"] for batch in data.epoch(1)]
    assert len(epoch0) == data.batches_per_epoch == 4
    assert epoch0 != epoch1 and sorted(sum(epoch0, [])) == sorted(sum(epoch1, []))
    assert [batch["prompts"] for batch in data.epoch(0, skip_batches=3)] == epoch0[3:]
    two_ranks = [
        DatasetAcquisition(records, batch_size=2, seed=0, shuffle=True, rank=r, world_size=2) for r in (0, 1)
    ]
    shards = [sum((batch["prompts"] for batch in d.epoch(0)), []) for d in two_ranks]
    assert not set(shards[0]) & set(shards[1]) and two_ranks[0].batches_per_epoch == 2


# ------------------------------------------------------------------------------------- roles + optim
def _tiny_module():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))


def test_variants_snapshots_and_ownership():
    from reference_trainer.roles import ComponentVariantRegistry, RoleError, check_ownership, role_parameters

    base = _tiny_module()
    registry = ComponentVariantRegistry(base)
    assert registry.declare_variant("generator") is base  # the first declared variant is the base
    fake = registry.declare_variant("fake")
    assert fake is not base and all(torch.equal(a, b) for a, b in zip(fake.parameters(), base.parameters()))
    registry.add_snapshot("reference", "generator")
    with pytest.raises(RoleError, match="already used"):
        registry.declare_variant("reference")
    roles = role_parameters(registry, {"generator": "generator", "fake": "fake"})
    check_ownership(roles, [base, fake])  # disjoint and exhaustive
    with pytest.raises(RoleError, match="owned by both"):
        check_ownership({"a": roles["generator"], "b": roles["generator"][:1]}, [base])
    with pytest.raises(RoleError, match="belongs to no role"):
        check_ownership({"generator": roles["generator"]}, [base, fake])
    # EMA update of a snapshot
    with torch.no_grad():
        base[0].weight.add_(1.0)
    registry.update_snapshot("reference", "generator", decay=0.5)
    assert torch.allclose(registry.snapshot("reference")["0.weight"], base[0].weight - 0.5)


def test_composite_optimizer_muon_split_and_role_steps():
    """Muon takes the 2-D weights of its role, AdamW the remainder and the other role; a phase steps
    only its role; state_dict round-trips."""
    from reference_trainer.config import OptimizerConfig
    from reference_trainer.optim import RoleOptimizer, build_optimizer

    generator, fake = _tiny_module(), _tiny_module()
    roles = {"generator": list(generator.parameters()), "fake": list(fake.parameters())}
    configs = {
        "generator": OptimizerConfig(role="generator", optimizer="muon", lr=0.02),
        "fake": OptimizerConfig(role="fake", lr=0.01),
    }
    optimizer = build_optimizer(roles, configs)
    layout = {(g["optimizer"], g["role"], g["kind"]): g["shapes"] for g in optimizer.describe()}
    assert layout[("Muon", "generator", "muon")] == [[3, 4]]
    assert layout[("AdamW", "generator", "adamw")] == [[3], [3], [3]]
    assert layout[("AdamW", "fake", "adamw")] == [[3, 4], [3], [3], [3]]
    steps = []
    coordinator = RoleOptimizer(
        optimizer, roles, max_grad_norm=1.0, next_step=lambda: len(steps) + 1, on_step=steps.append
    )
    fake_before = [p.detach().clone() for p in fake.parameters()]
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0))
    with coordinator.phase("generator") as phase:
        phase.backward((generator(x) + fake(x)).pow(2).mean())
    assert [p.grad for p in fake.parameters()] == [None] * 4  # cleared at exit
    assert all(torch.equal(a, b) for a, b in zip(fake.parameters(), fake_before))
    assert steps[0].role == "generator" and steps[0].grad_norm > 0 and steps[0].lr == 0.02
    state = optimizer.state_dict()
    rebuilt = build_optimizer(roles, configs)
    rebuilt.load_state_dict(state)
    assert str(rebuilt.state_dict()) == str(state)


def test_non_finite_loss_aborts_with_the_role_named():
    from reference_trainer.config import OptimizerConfig
    from reference_trainer.optim import NonFiniteLossError, RoleOptimizer, build_optimizer

    module = _tiny_module()
    roles = {"policy": list(module.parameters())}
    optimizer = build_optimizer(roles, {"policy": OptimizerConfig(role="policy")})
    coordinator = RoleOptimizer(
        optimizer, roles, max_grad_norm=1.0, next_step=lambda: 7, on_step=lambda r: None
    )
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(NonFiniteLossError, match="loss.policy is nan at optimizer step 7"):
        with coordinator.phase("policy") as phase:
            phase.backward(module(torch.ones(1, 4)).sum() * float("nan"))
    assert all(torch.equal(a, b) for a, b in zip(module.parameters(), before))


# ------------------------------------------------------------------------------------- adapters
@pytest.mark.parametrize("name", ["sd3-tiny", "flux-tiny"])
def test_adapter_component_runtime_and_snapshot_forward(name):
    from reference_trainer.adapters.base import ComponentError
    from reference_trainer.registry import resolve_adapter

    adapter = resolve_adapter(name)()
    adapter.load_pipeline()
    assert adapter.has_component("transformer") and not adapter.has_component("unknown")
    adapter.register_component("text_encoder_2", None)  # declared optional, absent
    assert adapter.get_component("text_encoder_2") is None and not adapter.has_component("text_encoder_2")
    with pytest.raises(ComponentError, match="required but absent"):
        adapter._require_component("text_encoder_2")
    with pytest.raises(ComponentError, match="declares no component"):
        adapter.get_component("unknown")
    condition = adapter.encode_prompt(["a red cat", "a blue dog"])
    trajectory = adapter.inference(
        condition, num_steps=3, noise_level=0.7, generator=torch.Generator().manual_seed(0)
    )
    assert trajectory.latents.shape == (2, 4, 4, 8, 8) and trajectory.log_probs.shape == (2, 3)
    images = adapter.decode_latents(trajectory.final)
    assert images.shape == (2, 3, 32, 32) and 0 <= images.min() and images.max() <= 1
    assert adapter.encode_images((images * 255).to(torch.uint8)).shape == (2, 4, 8, 8)
    # a snapshot forward goes through functional_call and leaves the live weights untouched
    module = adapter.trainable_module()
    live = {k: v.clone() for k, v in module.named_parameters()}
    shifted = {k: v + 0.01 for k, v in live.items()}
    sigma = torch.full((2,), 0.5)
    v_live = adapter.forward(trajectory.latents[:, 1], sigma, condition)
    v_snap = adapter.forward(trajectory.latents[:, 1], sigma, condition, parameters=shifted)
    assert not torch.equal(v_live, v_snap)
    assert all(torch.equal(p, live[k]) for k, p in module.named_parameters())


# ------------------------------------------------------------------------------------- checkpoints
KILL_DRIVER = """
import os, signal, sys
from reference_trainer import checkpoint
original = checkpoint.write_model_export
def write_then_die(directory, *args):
    original(directory, *args)
    if os.environ.get("KILL_AT_SAVE", "step-000002") in str(directory):
        os.kill(os.getpid(), signal.SIGKILL)  # mid-save: model written, state not yet
checkpoint.write_model_export = write_then_die
from reference_trainer.cli import main
sys.argv = ["reference-trainer", *sys.argv[1:]]
main()
"""


@pytest.mark.integration
def test_sigkill_during_checkpoint_save_keeps_the_previous_checkpoint(tmp_path):
    from reference_trainer.checkpoint import list_checkpoints
    from reference_trainer.run import train

    driver = tmp_path / "driver.py"
    driver.write_text(KILL_DRIVER)
    run = tmp_path / "run"
    args = [
        "train",
        str(GRPO_CONFIG),
        "--output-dir",
        str(run),
        "--max-steps",
        "3",
        "--set",
        "checkpoint.every=1",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFDEBUG_")}
    process = subprocess.run([sys.executable, str(driver), *args], cwd=REPO, env=env, capture_output=True)
    assert process.returncode == -signal.SIGKILL
    assert [path.name for path in list_checkpoints(run)] == ["step-000001"]
    assert list((run / "checkpoints").glob(".tmp-step-000002-*")), "the killed save left its temp dir"
    assert [r["optimizer_step"] for r in metrics(run)] == [1, 2]
    trainer = train(load(GRPO_CONFIG, "checkpoint.every=1", max_steps=3), run, resume="latest")
    assert trainer.optimizer_step == 3
    assert [r["optimizer_step"] for r in metrics(run)] == [1, 2, 3]  # record 2 re-done after resume
    assert not list((run / "checkpoints").glob(".tmp-*"))


@pytest.mark.integration
def test_a_run_killed_in_its_first_save_is_started_again_fresh_not_resumed(tmp_path):
    """Killed while publishing its first checkpoint: `--resume latest` says there is nothing to resume
    and what to do (exit 2); the fresh start replaces the killed run's metrics.jsonl row instead of
    appending to it; a later fresh start over the published checkpoints is refused."""
    run = tmp_path / "run"
    args = [
        "train",
        str(GRPO_CONFIG),
        "--output-dir",
        str(run),
        "--max-steps",
        "2",
        "--set",
        "checkpoint.every=1",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFDEBUG_")}
    driver = tmp_path / "driver.py"
    driver.write_text(KILL_DRIVER)
    killed = subprocess.run(
        [sys.executable, str(driver), *args],
        cwd=REPO,
        env={**env, "KILL_AT_SAVE": "step-000001"},
        capture_output=True,
    )
    assert killed.returncode == -signal.SIGKILL and [r["optimizer_step"] for r in metrics(run)] == [1]
    from typer.testing import CliRunner

    from reference_trainer.cli import app

    runner = CliRunner()  # in process from here: the kill needed its own process, these do not
    resumed = runner.invoke(app, [*args, "--resume", "latest"])
    line = resumed.stderr.strip().splitlines()[0]  # then the FFDEBUG_DEBUG hint
    assert resumed.exit_code == 2, resumed.stderr
    assert (
        "no complete checkpoint under" in line and "its metrics.jsonl (1 record) is all that is left" in line
    )
    assert "start the run again without --resume" in line and "replaces metrics.jsonl and eval.jsonl" in line
    fresh = runner.invoke(app, args)
    assert fresh.exit_code == 0, fresh.stderr
    assert f"warning: {run / 'metrics.jsonl'}: replaced by this fresh run" in fresh.stderr
    assert [r["optimizer_step"] for r in metrics(run)] == [1, 2]  # not [1, 1, 2]
    again = runner.invoke(app, args)
    assert (
        again.exit_code == 2
        and "holds 2 checkpoint(s) of an earlier run (newest step-000002)" in again.stderr
    )
    assert "--resume latest" in again.stderr and [r["optimizer_step"] for r in metrics(run)] == [1, 2]


def test_split_join_round_trip_keeps_int_keys_and_tensors():
    import numpy as np

    from reference_trainer.checkpoint import join_tensors, split_tensors

    value = {
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
        "groups": [{"betas": (0.9, 0.99)}],
        "np": np.arange(3),
    }
    tensors: dict = {}
    restored = join_tensors(split_tensors(value, tensors), tensors)
    assert list(restored["state"]) == [0] and torch.equal(restored["state"][0]["exp_avg"], torch.ones(2))
    assert restored["groups"][0]["betas"] == [0.9, 0.99] and (restored["np"] == np.arange(3)).all()


# ------------------------------------------------------------------------------------- CLI
@pytest.mark.integration
def test_cli_list_train_and_diff(tmp_path):
    import json

    from typer.testing import CliRunner

    from reference_trainer.cli import app

    runner = CliRunner()
    listed = runner.invoke(app, ["list", "--json"])
    assert listed.exit_code == 0
    info = json.loads(listed.stdout)
    grpo = next(t for t in info["trainers"] if t["name"] == "grpo")
    assert grpo["contract"] == "generation+runtime_reward" and grpo["roles"] == ["policy"]
    assert {"sd3-tiny", "flux-tiny"} <= set(info["adapters"]) and "brightness" in info["rewards"]

    for name, lr in (("a", "3e-3"), ("b", "3e-3"), ("c", "1e-3")):
        result = runner.invoke(
            app,
            [
                "train",
                str(GRPO_CONFIG),
                "--output-dir",
                str(tmp_path / name),
                "--max-steps",
                "2",
                "--set",
                f"optimizers.0.lr={lr}",
            ],
        )
        assert result.exit_code == 0, result.output
    run_json = json.loads((tmp_path / "a/run.json").read_text())
    assert (
        run_json["config"]["max_steps"] == 2
        and run_json["threads"] == 1
        and len(run_json["identity_hash"]) == 64
    )
    same = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"])
    assert same.exit_code == 0 and json.loads(same.stdout)["identical"]
    differ = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "c"), "--json"])
    first = json.loads(differ.stdout)["first_difference"]
    assert differ.exit_code == 1 and first["optimizer_step"] == 1 and "lr.policy" in first["keys"]

    bad = runner.invoke(
        app, ["train", str(GRPO_CONFIG), "--output-dir", str(tmp_path / "d"), "--set", "train.group_size=1"]
    )
    assert bad.exit_code == 2 and "train.group_size: must be >= 2" in bad.output


@pytest.mark.integration
def test_sigterm_stops_at_a_boundary_and_checkpoints(tmp_path):
    """SIGTERM during training: the run finishes the current cycle, writes a final checkpoint, exits 0."""
    import time

    from reference_trainer.checkpoint import list_checkpoints, read_trainer_state

    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FFDEBUG_")}
    args = [
        "-m",
        "reference_trainer",
        "train",
        str(GRPO_CONFIG),
        "--output-dir",
        str(run),
        "--max-steps",
        "1000",
    ]
    process = subprocess.Popen(
        [sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + hang_timeout(300)
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text()):
        assert time.monotonic() < deadline and process.poll() is None, "training did not start"
        time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=hang_timeout(300))
    assert process.returncode == 0, err.decode()
    assert f"stopped (signal {int(signal.SIGTERM)})" in err.decode()
    assert "Loading weights" not in err.decode()  # transformers' per-component tqdm bars are silenced
    last = list_checkpoints(run)[-1]
    steps = [r["optimizer_step"] for r in metrics(run)]
    assert read_trainer_state(last)["optimizer_step"] == steps[-1] < 1000
