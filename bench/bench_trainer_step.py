"""Time per optimizer step: the reference trainer's GRPO vs a minimal hand-written loop (same maths).

    python bench/bench_trainer_step.py [--steps 20] [--warmup 3] [--repeats 5] [--threads 1]

Both sides run Flow-GRPO on the tiny SD3 model from the same fixture weights, with the example config
(``examples/grpo/full/sd3_tiny/default.yaml``: 2 prompts × 4 samples, 4 SDE steps, brightness reward,
AdamW): rollout with per-step log-probs, decode, reward, group-normalised advantages, PPO-clip loss
accumulated over the 4 trained steps, clip, AdamW step. The hand-written loop calls the model and the
maths directly (no registries, roles, phases, taps, metrics file). Printed: ms/step for each and the
ratio framework / hand-written (issue target ≤ 1.15). Not part of CI.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples/grpo/full/sd3_tiny/default.yaml"


def framework_ms_per_step(steps: int, warmup: int) -> float:
    from reference_trainer.config import load_config
    from reference_trainer.run import build_trainer

    output = Path(tempfile.mkdtemp(prefix="bench-framework-"))
    try:
        trainer = build_trainer(load_config(CONFIG, max_steps=warmup), output)
        trainer.start()  # warm-up steps (+ its final checkpoint, outside the timed part)
        trainer.config = load_config(CONFIG, overrides=("checkpoint.every=0",), max_steps=warmup + steps)
        trainer.save = lambda: None  # time the steps, not the end-of-run checkpoint
        start = time.perf_counter()
        trainer.start()
        return (time.perf_counter() - start) / steps * 1e3
    finally:
        shutil.rmtree(output, ignore_errors=True)


def hand_written_ms_per_step(steps: int, warmup: int) -> float:
    """The same Flow-GRPO step written inline on the same model."""
    from reference_trainer.adapters.sd3 import SD3TinyAdapter
    from reference_trainer.sde import flow_sde_step

    adapter = SD3TinyAdapter()
    adapter.load_pipeline()
    model = adapter.trainable_module()
    vae = adapter.get_component("vae")
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    prompts = ["a red cat", "a blue dog", "a green tree", "a yellow sun"]
    conditions = {p: adapter.encode_prompt([p]) for p in prompts}
    sigmas = adapter.sigmas(4)
    group, per_iteration, eta, eps_clip = 4, 2, 0.7, 1e-4

    def velocity(x, sigma, embeds, pooled):
        out = model(
            hidden_states=x,
            encoder_hidden_states=embeds,
            pooled_projections=pooled,
            timestep=sigma * 1000,
            return_dict=False,
        )
        return out[0].float()

    def one_step(iteration: int) -> None:
        generator = torch.Generator().manual_seed(iteration)
        chosen = [
            prompts[i] for i in torch.randperm(len(prompts), generator=generator)[:per_iteration].tolist()
        ]
        batch = [p for p in chosen for _ in range(group)]
        embeds = torch.cat([conditions[p].prompt_embeds for p in batch])
        pooled = torch.cat([conditions[p].pooled for p in batch])
        n = len(batch)
        with torch.no_grad():
            x = torch.randn(n, 4, 8, 8, generator=generator)
            xs, logps = [x], []
            for j in range(4):
                step = flow_sde_step(
                    velocity(x, sigmas[j].expand(n), embeds, pooled),
                    x,
                    sigmas[j].expand(n),
                    sigmas[j + 1].expand(n),
                    eta,
                    sigma_max=float(sigmas[1]),
                    generator=generator,
                )
                x = step.prev_sample
                xs.append(x)
                logps.append(step.log_prob)
            images = (
                vae.decode(x / vae.config.scaling_factor + vae.config.shift_factor).sample / 2 + 0.5
            ).clamp(0, 1)
            reward = -(images.mean(dim=(1, 2, 3)) - 1.0).abs().view(per_iteration, group)
            advantage = (
                (reward - reward.mean(1, keepdim=True)) / (reward.std(1, unbiased=False, keepdim=True) + 1e-4)
            ).flatten()
        order = torch.randperm(n, generator=generator)
        for j in range(4):
            s = order
            step = flow_sde_step(
                velocity(xs[j][s], sigmas[j].expand(n), embeds[s], pooled[s]),
                xs[j][s],
                sigmas[j].expand(n),
                sigmas[j + 1].expand(n),
                eta,
                sigma_max=float(sigmas[1]),
                prev_sample=xs[j + 1][s],
            )
            ratio = torch.exp(step.log_prob - logps[j][s])
            a = advantage[s].clamp(-5, 5)
            loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps_clip, 1 + eps_clip)).mean() / 4
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for i in range(warmup):
        one_step(i)
    start = time.perf_counter()
    for i in range(steps):
        one_step(warmup + i)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description="framework vs hand-written GRPO step time")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions; medians reported")
    parser.add_argument("--threads", type=int, default=1, help="must match the config's runtime.threads (1)")
    args = parser.parse_args()
    # the example config pins 1 thread and deterministic algorithms: give the hand-written loop the same;
    # alternate the two sides and report each side's median and the median of the per-repeat ratios,
    # so neither warm-up order nor a burst of load on a shared machine decides the result
    torch.use_deterministic_algorithms(True)
    hand, framework = [], []
    for _ in range(args.repeats):
        torch.set_num_threads(args.threads)
        hand.append(hand_written_ms_per_step(args.steps, args.warmup))
        framework.append(framework_ms_per_step(args.steps, args.warmup))
    ratios = [f / h for f, h in zip(framework, hand)]
    print(f"hand-written loop: {statistics.median(hand):8.2f} ms/step  {[round(v, 1) for v in hand]}")
    print(
        f"reference trainer: {statistics.median(framework):8.2f} ms/step  {[round(v, 1) for v in framework]}"
    )
    print(
        f"ratio framework / hand-written: median {statistics.median(ratios):.3f} (target <= 1.15), "
        f"per repeat {[round(r, 3) for r in ratios]}"
    )


if __name__ == "__main__":
    main()
