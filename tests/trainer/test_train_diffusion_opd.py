"""DiffusionOPD: the per-step KL against hand values and Flow-Factory's reduction; the arguments and the
teacher routing are validated with the field named; on the tiny SD3 model the student distils a
different teacher (MMD² and paired MSE to its samples fall), the teachers and frozen components stay
bit-identical, every student parameter changes, the first steps match the golden and two identical
dumped runs compare ``ok`` with every stage tapped (exact resume: test_resume.py)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.trainer.golden_utils import check_golden
from helpers.trainer.trainer_utils import (
    REPO,
    assert_bit_identical,
    assert_every_parameter_changed,
    frozen_state,
    load,
    make_trainer,
    metrics,
    variant_state,
)

from reference_trainer.errors import ConfigError
from reference_trainer.losses.opd import opd_loss

CONFIG = "examples/diffusion_opd/full/sd3_tiny/default.yaml"


def test_opd_loss_hand_values():
    """μ_S = [1, 3], μ_T = [0, 1], s = 2 (one sample): ½·mean((1, 2)²)/4 = ½·2.5/4 = 0.3125;
    ∂L/∂μ_S = (μ_S − μ_T)/(s²·numel) = (1, 2)/8. Two samples with s = (1, 2) and equal gaps 1:
    mean(½·1/1, ½·1/4) = 0.3125. The teacher's mean gets no gradient."""
    student = torch.tensor([[1.0, 3.0]], requires_grad=True)
    teacher = torch.tensor([[0.0, 1.0]], requires_grad=True)
    loss, info = opd_loss(student, teacher, torch.tensor([2.0]))
    loss.backward()
    assert loss.item() == pytest.approx(0.3125) and info["mean_gap_abs"] == pytest.approx(1.5)
    torch.testing.assert_close(student.grad, torch.tensor([[0.125, 0.25]]))
    assert teacher.grad is None
    two, _ = opd_loss(torch.ones(2, 3), torch.zeros(2, 3), torch.tensor([1.0, 2.0]))
    assert two.item() == pytest.approx(0.3125)
    with pytest.raises(ValueError, match="std must be > 0"):
        opd_loss(torch.ones(1, 2), torch.zeros(1, 2), torch.tensor([0.0]))


def flow_factory_distillation_loss(student, teacher, std_dev_t, dt):
    """Flow-Factory-Draft ``trainers/opd/common.py`` ``compute_structured_distillation_loss`` (one
    component, no self-normalisation): the per-sample mean squared error divided by the scheduler's
    ``get_kl_divergence_denominator`` = std_dev_t²·(−dt) clamped at 1e-8; the trainer averages it."""
    per_sample = (student.float() - teacher.float()).square().flatten(1).mean(dim=1)
    denominator = (std_dev_t.float() ** 2 * (-dt.float())).clamp_min(1e-8)
    return (per_sample / denominator).mean()


def test_transcription_of_flow_factory_opd():
    """Ours is ½ × Flow-Factory's reduction (its scheduler documents ``0.5 * ||mu_S - mu_T||^2 / denom``,
    the reduction omits the ½), value and gradient, with s² = σ_t²·(−Δt)."""
    g = torch.Generator().manual_seed(0)
    student = torch.randn(3, 2, 4, 4, generator=g, requires_grad=True)
    reference = student.detach().clone().requires_grad_(True)
    teacher = torch.randn(3, 2, 4, 4, generator=g)
    std_dev_t, dt = torch.tensor([0.5, 0.7, 0.9]), torch.tensor([-0.25, -0.1, -0.3])
    ours, _ = opd_loss(student, teacher, std_dev_t * (-dt).sqrt())
    theirs = flow_factory_distillation_loss(reference, teacher, std_dev_t, dt)
    ours.backward()
    (0.5 * theirs).backward()
    torch.testing.assert_close(ours, 0.5 * theirs)
    torch.testing.assert_close(student.grad, reference.grad)


def test_opd_arguments_and_routing_are_validated_with_the_field_named(tmp_path):
    args = load(REPO / CONFIG).train
    assert args.trained_steps() == 3 and args.teacher_of("a red cat") == 0
    routed = load(
        REPO / CONFIG,
        "train.teachers=[{path: a, prompts: [a red cat]}, {path: b}]",
    ).train
    assert routed.teacher_of("a red cat") == 0 and routed.teacher_of("a blue dog") == 1
    for override, message in [
        ("train.teachers=[]", r"train\.teachers: needs at least one teacher"),
        ("train.teachers=[{path: a}, {path: b}]", r"train\.teachers: teachers \[0, 1\] all take"),
        (
            "train.teachers=[{path: a, prompts: [x]}, {path: b, prompts: [x]}]",
            r"train\.teachers\[1\]\.prompts: 'x' is already routed to teachers\[0\]",
        ),
        ("train.teachers=[{path: a, guidance_scale: 0.5}]", r"train\.teachers\[0\]\.guidance_scale"),
        ("train.timestep_fraction=0.2", r"train\.timestep_fraction: .* trains no step"),
        ("train.gradient_steps_per_iteration=3", r"train\.gradient_steps_per_iteration: must divide"),
        ("train.noise_level=-1", r"train\.noise_level: must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load(REPO / CONFIG, override)
    only = load(REPO / CONFIG, "train.teachers=[{path: a, prompts: [x]}]").train
    with pytest.raises(ConfigError, match=r"train\.teachers: prompt 'y' is routed to no teacher"):
        only.teacher_of("y")
    with pytest.raises(ConfigError, match=r"train\.teachers\[0\]\.path: .* does not exist"):
        make_trainer("diffusion_opd", tmp_path, 1, f"train.teachers.0.path={tmp_path / 'nowhere'}")


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("opd")
    trainer = make_trainer("diffusion_opd", out, 12, "eval.every=12", "eval.samples_per_prompt=4")
    frozen, initial = frozen_state(trainer), variant_state(trainer)
    trainer.start()
    return dict(trainer=trainer, out=out, frozen=frozen, initial=initial)


@pytest.mark.integration
def test_opd_distils_the_teacher_and_keeps_it_frozen(learning_run, capsys):
    """12 steps (6 rollout iterations × 2 minibatches): the student's 8-step ODE samples approach the
    teacher's from the same noise (MMD² and per-noise MSE fall); the teacher snapshot (loaded from its
    folder, not the student's init) and the frozen components are bit-identical; every student
    parameter changed."""
    run = learning_run
    trainer = run["trainer"]
    from safetensors.torch import load_file

    stored = load_file(
        REPO / "reference_trainer/fixtures/sd3_tiny_teacher/transformer/diffusion_pytorch_model.safetensors"
    )
    teacher = trainer.variants.snapshot("teacher_0")
    assert all(torch.equal(teacher[key], stored[key]) for key in teacher)
    assert not all(torch.equal(teacher[key], run["initial"]["student"][key]) for key in teacher)
    start, end = (json.loads(line) for line in (run["out"] / "eval.jsonl").read_text().splitlines())
    with capsys.disabled():
        print(
            f"\nDiffusionOPD student vs teacher: MMD² {start['eval.teacher_mmd']:.4f} -> {end['eval.teacher_mmd']:.4f}, "
            f"paired MSE {start['eval.teacher_paired_mse']:.4f} -> {end['eval.teacher_paired_mse']:.4f}"
        )
    assert end["eval.teacher_mmd"] < 0.8 * start["eval.teacher_mmd"]
    assert end["eval.teacher_paired_mse"] < 0.8 * start["eval.teacher_paired_mse"]
    records = metrics(run["out"])
    assert [r["role"] for r in records] == ["student"] * 12
    assert records[-1]["loss"] < records[0]["loss"]
    assert_bit_identical(run["frozen"], frozen_state(trainer))
    assert_every_parameter_changed(
        trainer, run["initial"]["student"], trainer.variants.variant("student"), "student"
    )


@pytest.mark.numeric
@pytest.mark.integration
def test_opd_goldens(learning_run):
    """The learning run's first 3 steps are the golden's (its evaluation overrides do not touch training)."""
    check_golden("diffusion_opd", metrics(learning_run["out"]), config=CONFIG, overrides=[])


@pytest.mark.integration
def test_two_identical_dumped_runs_compare_ok_with_every_stage_tapped(tmp_path):
    from helpers.trainer.dump_utils import dumped_runs_compare

    result = dumped_runs_compare(tmp_path, REPO / CONFIG, "eval.every=0")
    keys = {stage["key"] for stage in result["stages"]}
    assert result["verdict"] == "ok" and result["first_divergence"] is None
    expected = {
        "rollout.latents",
        "train.student_mean",
        "train.teacher_mean",
        "loss.student",
        "grad_norm.student",
    }
    assert expected <= keys, sorted(expected - keys)
