"""The periodic evaluation boundary: fixed-noise rewards checked against an independent ODE sampler,
no effect on the training trajectory, held-out losses for dataset trainers (SFT, offline DPO)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.trainer.trainer_utils import GRPO_CONFIG, load, metrics

EVAL = ("eval.every=2", "eval.samples_per_prompt=2", "eval.num_inference_steps=3", "eval.seed=5")


def eval_records(run) -> list[dict]:
    return [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]


@torch.no_grad()
def independent_brightness(prompts: list[str], samples: int, steps: int, seed: int) -> float:
    """Mean −|mean(image) − 1| of Euler-ODE samples of the *fixture* transformer written out by hand:
    z ~ N(0, I) from a generator seeded ``seed``; x_{j+1} = x_j + (σ_{j+1} − σ_j)·v(x_j, σ_j), σ from
    diffusers' ``FlowMatchEulerDiscreteScheduler``."""
    from reference_trainer.adapters.sd3 import SD3TinyAdapter

    adapter = SD3TinyAdapter()
    adapter.load_pipeline()
    repeated = [prompt for prompt in prompts for _ in range(samples)]
    condition = torch.cat([adapter.encode_prompt([p]).prompt_embeds for p in repeated])
    pooled = torch.cat([adapter.encode_prompt([p]).pooled for p in repeated])
    model, vae = adapter.trainable_module(), adapter.get_component("vae")
    x = torch.randn((len(repeated), 4, 8, 8), generator=torch.Generator().manual_seed(seed))
    scheduler = adapter.get_component("scheduler")
    scheduler.set_timesteps(steps)
    sigmas = scheduler.sigmas  # diffusers' own shifted schedule, 1 -> 0
    for j in range(steps):
        sigma = sigmas[j].expand(len(repeated))
        v = model(
            hidden_states=x,
            encoder_hidden_states=condition,
            pooled_projections=pooled,
            timestep=sigma * 1000,
            return_dict=False,
        )[0]
        x = x + (sigmas[j + 1] - sigmas[j]) * v
    images = vae.decode(x / vae.config.scaling_factor + vae.config.shift_factor).sample / 2 + 0.5
    return float(-(images.clamp(0, 1).mean(dim=(1, 2, 3)) - 1.0).abs().mean())


@pytest.mark.integration
def test_eval_boundary_rewards_and_no_effect_on_training(tmp_path):
    """GRPO, 4 steps, eval.every=2: evaluations at steps 0, 2, 4; the step-0 reward equals a hand-written
    ODE sampler's on the fixture weights; metrics.jsonl equals the run without evaluation bit for bit."""
    from reference_trainer.cli import first_difference
    from reference_trainer.run import train

    prompts = ["a red cat", "a blue dog", "a green tree"]
    prompt_set = "eval.prompts=[" + ", ".join(f"'{p}'" for p in prompts) + "]"
    train(load(GRPO_CONFIG, *EVAL, prompt_set, max_steps=4), tmp_path / "with_eval")
    train(load(GRPO_CONFIG, max_steps=4), tmp_path / "without")
    assert first_difference(metrics(tmp_path / "with_eval"), metrics(tmp_path / "without")) is None
    assert not (tmp_path / "without/eval.jsonl").exists()
    records = eval_records(tmp_path / "with_eval")
    assert [r["optimizer_step"] for r in records] == [0, 2, 4]
    assert [r["rollout_iteration"] for r in records] == [0, 2, 4]
    expected = independent_brightness(prompts, samples=2, steps=3, seed=5)
    print(f"GRPO eval brightness: {[round(r['eval.reward.brightness'], 4) for r in records]}")
    assert records[0]["eval.reward.brightness"] == pytest.approx(expected, abs=1e-5)
    assert records[0]["eval.reward_mean"] == records[0]["eval.reward.brightness"]
    assert records[2]["eval.reward.brightness"] != records[0]["eval.reward.brightness"]


def test_eval_needs_heldout_records_before_any_model_loads(tmp_path, monkeypatch):
    """A dataset without ``demonstrations_heldout.jsonl`` and eval.every > 0: a config error naming
    data.dataset, raised before the weights load."""
    import shutil

    from helpers.trainer.trainer_utils import example

    from reference_trainer.adapters.sd3 import SD3TinyAdapter
    from reference_trainer.data import TINY_DATASET
    from reference_trainer.errors import ConfigError
    from reference_trainer.run import build_trainer

    dataset = tmp_path / "data"
    shutil.copytree(TINY_DATASET, dataset)
    (dataset / "demonstrations_heldout.jsonl").unlink()

    def no_loading(self):
        raise AssertionError("a model loaded before the held-out check")

    monkeypatch.setattr(SD3TinyAdapter, "load_pipeline", no_loading)
    with pytest.raises(ConfigError, match=r"^data\.dataset: .*demonstrations_heldout\.jsonl not found"):
        build_trainer(load(example("sft"), f"data.dataset={dataset}", "eval.every=2"), tmp_path / "run")


@pytest.mark.integration
def test_sft_evaluation_lowers_the_heldout_velocity_mse(tmp_path):
    """SFT, 24 steps, eval.every=12: the velocity MSE on the 4 held-out demonstrations (colours never
    trained on; fixed σ, ε) falls from the initial weights to the end."""
    from helpers.trainer.trainer_utils import make_trainer

    overrides = ("train.max_epochs=100", "train.gradient_accumulation_steps=1", "eval.every=12")
    make_trainer("sft", tmp_path, 24, *overrides).start()
    losses = [r["eval.heldout.loss"] for r in eval_records(tmp_path)]
    print(f"SFT held-out velocity MSE at steps 0, 12, 24: {[round(v, 4) for v in losses]}")
    assert len(losses) == 3 and losses[2] < losses[1] < losses[0]
