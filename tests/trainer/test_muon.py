"""Muon end to end: Flow-GRPO with ``optimizer: muon`` (``examples/grpo/full/sd3_tiny/muon.yaml``) on the
tiny SD3 model: Muon steps exactly the policy's 2-D weights (AdamW the rest) with orthogonalised
updates at its documented scale, and a cut run resumes bit for bit, Muon's momentum buffers included. Skipped, saying so, where ``torch.optim.Muon``
is absent (it arrived in torch 2.9)."""

from __future__ import annotations

import pytest
import torch
from helpers import REPO
from helpers.trainer.trainer_utils import clone_state, load, metrics

pytestmark = pytest.mark.skipif(
    not hasattr(torch.optim, "Muon"), reason=f"torch {torch.__version__} has no torch.optim.Muon"
)

MUON_CONFIG = REPO / "examples/grpo/full/sd3_tiny/muon.yaml"
LR = 3.0e-3
"""The example's policy lr (Muon and its AdamW remainder share it)."""


@pytest.mark.integration
def test_muon_step_is_orthogonalised_at_its_scale(tmp_path):
    """One Muon step of the trainer, end to end (rollout, rewards, loss, accumulation, optimizer, final
    checkpoint). Muon holds exactly the policy's 2-D weights (AdamW the biases and norms) and replaces
    each matrix's momentum by its Newton–Schulz orthogonalisation, scaled by ``match_rms_adamw``:
    ΔW = −0.2·lr·√max(m, n)·NS(g) with weight decay 0. NS5 with the Keller Jordan coefficients leaves
    the top singular values in about [0.7, 1.2], so σ_max(ΔW)/(0.2·lr·√max(m, n)) ∈ [0.7, 1.25] for
    every updated matrix (measured 1.02 .. 1.20; AdamW's first step, a sign-like update, gives 10 .. 26)."""
    from reference_trainer.run import build_trainer

    trainer = build_trainer(load(MUON_CONFIG, max_steps=1), tmp_path)
    policy = trainer.variants.variant("policy")
    before = clone_state(policy)
    trainer.start()
    (record,) = metrics(tmp_path)
    assert record["role"] == "policy" and torch.isfinite(torch.tensor(record["loss"]))
    assert (tmp_path / "checkpoints/step-000001/state/optimizer.json").is_file()
    muon = [child for child in trainer.optim.optimizer.children if isinstance(child, torch.optim.Muon)]
    assert len(muon) == 1
    trainable = dict(policy.named_parameters())
    matrices = {name for name, p in trainable.items() if p.ndim == 2}
    muon_params = {id(p) for group in muon[0].param_groups for p in group["params"]}
    assert muon_params == {id(trainable[name]) for name in matrices}
    assert all(set(muon[0].state[p]) == {"momentum_buffer"} for p in muon[0].state)
    top = {}
    for name in matrices:
        delta = (trainable[name].detach() - before[name]).double()
        if bool(delta.abs().max() > 0):
            scale = 0.2 * LR * max(delta.shape) ** 0.5
            top[name] = float(torch.linalg.svdvals(delta / scale)[0])
    # all but the context query of SD3's context_pre_only last block (no gradient, test_grpo_trainer)
    assert len(top) == len(matrices) - 1
    outside = {name: value for name, value in top.items() if not 0.7 <= value <= 1.25}
    assert not outside, outside


@pytest.mark.integration
def test_muon_cut_and_resume_is_bitwise_exact(tmp_path):
    """6 steps straight == 3 steps, then ``--resume latest`` to 6: the same metrics and the same final
    checkpoint bit for bit (the optimizer state file holds Muon's momentum buffers)."""
    from test_resume import N, assert_same_run

    from reference_trainer.run import train

    straight, cut = tmp_path / "straight", tmp_path / "cut"
    train(load(MUON_CONFIG, max_steps=N), straight)
    train(load(MUON_CONFIG, max_steps=N // 2), cut)
    assert len(metrics(cut)) == N // 2
    train(load(MUON_CONFIG, max_steps=N), cut, resume="latest")
    assert_same_run(straight, cut)
    optimizer_json = (straight / f"checkpoints/step-{N:06d}/state/optimizer.json").read_text()
    assert "momentum_buffer" in optimizer_json
