"""The verification matrix: one representative trainer per execution composition runs a few steps and a
run cut after its first optimizer step resumes to the same bits.

Compositions (docs/reference-trainer.md "The reference trainer"): coupled generated feedback (GRPO: the loss uses the sampler's own
log-probs), decoupled generated feedback (DGPO: a reward, but a likelihood-free loss on the samples),
generated no feedback (DiffusionOPD: the student's rollouts, a teacher instead of a reward), dataset
no feedback (SFT on demonstrations, offline DPO on preference pairs), and multi-role (TDM-R1: generator,
fake score and surrogate stepping in a three-phase cycle, so the cut lands inside a cycle). Every registered
trainer is cut at every step in ``test_resume.py``; this one is the compact matrix of the seeds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.trainer.trainer_utils import example, load
from safetensors.torch import load_file

STEPS = 3
CUT = 1

# (composition, representative, its contract, the class it must derive from or None, roles)
MATRIX = [
    ("coupled generated feedback", "grpo", "generation+runtime_reward", "GRPOTrainer", ("policy",)),
    ("decoupled generated feedback", "dgpo", "generation+runtime_reward", "DecoupledTrainer", ("policy",)),
    ("generated no feedback", "diffusion_opd", "generation+none", None, ("student",)),
    ("dataset no feedback (demonstrations)", "sft", "dataset+none", None, ("policy",)),
    ("dataset no feedback (preferences)", "offline_dpo", "dataset+none", None, ("policy",)),
    ("multi-role", "tdm_r1", "generation+runtime_reward", "TDMTrainer", ("generator", "fake", "surrogate")),
]


def _run(name: str, out: Path, max_steps: int, resume: str | None = None) -> None:
    from reference_trainer.run import train

    train(load(example(name), "eval.every=0", max_steps=max_steps), out, resume=resume)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("composition", "name", "contract", "base", "roles"), MATRIX, ids=[row[1] for row in MATRIX]
)
def test_each_composition_runs_and_resumes_exactly(composition, name, contract, base, roles, tmp_path):
    from reference_trainer.registry import resolve_trainer

    trainer_cls, _ = resolve_trainer(name)
    assert trainer_cls.execution_contract.describe() == contract, composition
    assert base is None or base in [cls.__name__ for cls in trainer_cls.__mro__], composition
    assert tuple(trainer_cls.roles) == roles, composition

    _run(name, tmp_path / "straight", STEPS)
    _run(name, tmp_path / "cut", CUT)
    _run(name, tmp_path / "cut", STEPS, resume="latest")
    straight, resumed = _records(tmp_path / "straight"), _records(tmp_path / "cut")
    assert [r["optimizer_step"] for r in straight] == list(range(1, STEPS + 1))
    assert resumed == straight, f"{composition}: the resumed run's metrics differ"
    assert {r["role"] for r in straight} == set(roles), composition
    final = f"checkpoints/step-{STEPS:06d}"
    files = sorted(
        p.relative_to(tmp_path / "straight" / final)
        for p in (tmp_path / "straight" / final).rglob("*.safetensors")
    )
    assert files, f"{composition}: no checkpoint tensors"
    for file in files:
        a, b = load_file(tmp_path / "straight" / final / file), load_file(tmp_path / "cut" / final / file)
        assert a.keys() == b.keys(), str(file)
        for key in a:
            assert torch.equal(a[key], b[key]) and a[key].dtype == b[key].dtype, (
                f"{composition}: {file}:{key}"
            )


def test_reference_trainer_list_shows_all_fourteen_trainers():
    """``reference-trainer list`` names the framework's fourteen trainers, the three distillation
    trainers with their roles."""
    from typer.testing import CliRunner

    from reference_trainer.cli import app

    listed = CliRunner().invoke(app, ["list", "--json"])
    assert listed.exit_code == 0, listed.output
    trainers = {t["name"]: t for t in json.loads(listed.stdout)["trainers"]}
    assert sorted(trainers) == [
        "awm", "crd", "dgpo", "diffusion_opd", "dmd2", "dppo", "grpo", "grpo_guard",
        "nft", "offline_dpo", "online_dpo", "sft", "tdm", "tdm_r1",
    ]  # fmt: skip
    assert trainers["diffusion_opd"]["roles"] == ["student"]
    assert trainers["tdm"]["roles"] == ["generator", "fake"]
    assert trainers["tdm_r1"]["roles"] == ["generator", "fake", "surrogate"]
    assert trainers["tdm_r1"]["contract"] == "generation+runtime_reward"
