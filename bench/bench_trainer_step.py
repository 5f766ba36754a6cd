"""Time per optimizer step: the reference trainer's GRPO vs a minimal hand-written loop (same maths).

    python bench/bench_trainer_step.py [--steps 10] [--warmup 3] [--repeats 15] [--threads 1] [--profile]

Both sides run Flow-GRPO on the tiny SD3 model from the same fixture weights, with the example config
(``examples/grpo/full/sd3_tiny/default.yaml``: 2 prompts × 4 samples, 4 SDE steps, brightness reward,
AdamW): rollout with per-step log-probs, decode, reward, group-normalised advantages, PPO-clip loss
accumulated over the 4 trained steps, clip, AdamW step. The hand-written loop calls the model and the
maths directly (no registries, roles, phases, taps, metrics file). Printed: ms/step for each and the
ratio framework / hand-written (issue target ≤ 1.15). Not part of CI.

Method: both sides are built once, warmed up, then run in alternating blocks of ``--steps`` optimizer
steps (which side goes first alternates too); a framework block is one ``trainer.start()`` with
``max_steps`` raised by ``--steps`` (its per-start cost, ~1.5 ms, is counted). Each block is timed by
the wall clock and by the process CPU clock; the ratio of each pair of neighbouring blocks is reported
with its median and its spread. On a shared machine the CPU-clock ratios are the steadier ones: a
block that waited for a core does not count the wait. ``--profile`` adds a cProfile of one framework
block and of one hand-written block: the per-step self time of the functions that differ most.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples/grpo/full/sd3_tiny/default.yaml"


class Framework:
    """The reference trainer on the example config, checkpoints off."""

    def __init__(self, output: Path) -> None:
        from reference_trainer.config import load_config
        from reference_trainer.run import build_trainer

        self.load_config = load_config
        self.trainer = build_trainer(
            load_config(CONFIG, overrides=("checkpoint.every=0",), max_steps=1), output
        )
        self.trainer.save = lambda: None  # time the steps, not the end-of-run checkpoints

    def block(self, steps: int) -> Callable[[], None]:
        """Raise ``max_steps`` by ``steps`` (not timed) and return the timed part: one ``trainer.start()``."""
        done = self.trainer.optimizer_step
        self.trainer.config = self.load_config(
            CONFIG, overrides=("checkpoint.every=0",), max_steps=done + steps
        )
        return self.trainer.start


def hand_written_step() -> Callable[[int], None]:
    """The same Flow-GRPO step written inline on the same model: ``one_step(iteration)``."""
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

    return one_step


def timed(block: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of ``block()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    block()
    return time.perf_counter() - wall, time.process_time() - cpu


def profile_block(block: Callable[[], None], steps: int) -> dict[str, float]:
    """Self time per step (ms) of every function called by ``block()``, keyed ``file:function``."""
    profiler = cProfile.Profile()
    profiler.runcall(block)
    per_step: dict[str, float] = {}
    for (filename, _, name), (_, _, self_time, _, _) in pstats.Stats(profiler).stats.items():  # type: ignore[attr-defined]
        key = f"{Path(filename).name}:{name}"
        per_step[key] = per_step.get(key, 0.0) + self_time / steps * 1e3
    return per_step


def print_profile_difference(framework: dict[str, float], hand: dict[str, float], rows: int = 20) -> None:
    total_f, total_h = sum(framework.values()), sum(hand.values())
    print(f"cProfile self time per step: framework {total_f:.2f} ms, hand-written {total_h:.2f} ms")
    keys = sorted(set(framework) | set(hand), key=lambda k: -abs(framework.get(k, 0) - hand.get(k, 0)))
    for key in keys[:rows]:
        f, h = framework.get(key, 0.0), hand.get(key, 0.0)
        print(f"  {f - h:+7.3f} ms  (framework {f:6.3f}, hand {h:6.3f})  {key}")


def summary(name: str, values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{name}: median {statistics.median(values):.3f}, range {low:.3f}-{high:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description="framework vs hand-written GRPO step time")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per timed block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=15, help="pairs of blocks; medians reported")
    parser.add_argument("--threads", type=int, default=1, help="must match the config's runtime.threads (1)")
    parser.add_argument("--profile", action="store_true", help="also cProfile one block of each side")
    args = parser.parse_args()
    # the example config pins 1 thread and deterministic algorithms: give the hand-written loop the same
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(args.threads)
    output = Path(tempfile.mkdtemp(prefix="bench-framework-"))
    try:
        framework = Framework(output)
        hand_step = hand_written_step()
        hand_done = 0

        def hand_block(steps: int = args.steps) -> None:
            nonlocal hand_done
            for _ in range(steps):
                hand_step(hand_done)
                hand_done += 1

        framework.block(args.warmup)()
        hand_block(args.warmup)
        blocks = {"framework": [], "hand": []}
        for repeat in range(args.repeats):
            order = ("hand", "framework") if repeat % 2 == 0 else ("framework", "hand")
            for side in order:
                blocks[side].append(timed(hand_block if side == "hand" else framework.block(args.steps)))
        if args.profile:
            print_profile_difference(
                profile_block(framework.block(args.steps), args.steps),
                profile_block(hand_block, args.steps),
            )
    finally:
        shutil.rmtree(output, ignore_errors=True)
    for clock, index in (("wall", 0), ("cpu", 1)):
        hand = [block[index] / args.steps * 1e3 for block in blocks["hand"]]
        fw = [block[index] / args.steps * 1e3 for block in blocks["framework"]]
        ratios = [f / h for f, h in zip(fw, hand)]
        print(f"[{clock} clock] {summary('hand-written ms/step', hand)}; {summary('framework ms/step', fw)}")
        print(
            f"[{clock} clock] {summary('ratio framework / hand-written', ratios)} (target <= 1.15); "
            f"per repeat {[round(r, 3) for r in ratios]}"
        )


if __name__ == "__main__":
    main()
