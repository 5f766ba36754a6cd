"""Flow-GRPO end to end on the tiny SD3 model: it learns, and only the trainable role changes."""

from __future__ import annotations

import pytest
import torch
from helpers.trainer.trainer_utils import GRPO_CONFIG, clone_state, eval_reward, load, metrics, state_digest

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one


def test_grpo_raises_mean_reward_and_keeps_frozen_roles(tmp_path, capsys):
    """30 GRPO steps (brightness reward, KL to a reference snapshot) raise the fixed-noise mean reward;
    the VAE, the text encoder and the reference snapshot stay bit-identical; the policy changes."""
    from reference_trainer.run import build_trainer

    trainer = build_trainer(load(GRPO_CONFIG, "train.kl_beta=0.001", max_steps=30), tmp_path)
    frozen = {name: state_digest(trainer.adapter.get_component(name)) for name in ("vae", "text_encoder")}
    reference = {key: value.clone() for key, value in trainer.variants.snapshot("reference").items()}
    policy_before = clone_state(trainer.variants.variant("policy"))
    before = eval_reward(trainer)

    trainer.start()

    after = eval_reward(trainer)
    with capsys.disabled():
        print(f"\nGRPO tiny SD3, 30 steps: fixed-noise mean brightness reward {before:.4f} -> {after:.4f}")
    assert after > before + 0.025
    records = metrics(tmp_path)
    assert [r["optimizer_step"] for r in records] == list(range(1, 31))
    assert all(r["role"] == "policy" and "reward_mean" in r and "kl" in r for r in records)
    # frozen roles bit-identical; every trainable parameter tensor changed
    assert frozen == {
        name: state_digest(trainer.adapter.get_component(name)) for name in ("vae", "text_encoder")
    }
    for key, value in trainer.variants.snapshot("reference").items():
        assert torch.equal(value, reference[key]), key
    policy_after = trainer.variants.variant("policy").state_dict()
    trainable = {name for name, p in trainer.variants.variant("policy").named_parameters() if p.requires_grad}
    unchanged = sorted(name for name in trainable if torch.equal(policy_after[name], policy_before[name]))
    # SD3's last block is ``context_pre_only``: its context-query projection feeds only the discarded
    # context output, so it gets no gradient (and AdamW with weight_decay 0 leaves it). Everything else moves.
    last = trainer.variants.variant("policy").config.num_layers - 1
    dead = [
        f"transformer_blocks.{last}.attn.add_q_proj.bias",
        f"transformer_blocks.{last}.attn.add_q_proj.weight",
    ]
    assert unchanged == dead, f"trainable parameters that did not change: {unchanged[:5]}"
    # the reference is used through functional_call: the KL is non-zero once the policy moved
    assert records[0]["kl"] == 0.0 and records[-1]["kl"] > 0.0


def test_grpo_flux_adapter_runs_the_same_contracts(tmp_path):
    """The same GRPO config on the tiny Flux adapter: two steps, finite metrics, a final checkpoint."""
    from reference_trainer.run import train

    train(load(GRPO_CONFIG, "model.adapter=flux-tiny", max_steps=2), tmp_path)
    records = metrics(tmp_path)
    assert [r["optimizer_step"] for r in records] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    assert (tmp_path / "checkpoints/step-000002/model/policy/diffusion_pytorch_model.safetensors").is_file()
