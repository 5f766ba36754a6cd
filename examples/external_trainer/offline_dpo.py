"""An offline Diffusion-DPO trainer written from scratch on the tiny SD3 fixtures and the packaged
preference dataset: a *dataset* trainer compared stage by stage with the reference (docs/trainer-taps.md).

It imports nothing from ``reference_trainer``: the records are read from the dataset's files, the
models are loaded with diffusers / transformers (``flow_grpo.load_models``, the same fixtures), and the
loss is written here from the paper (Wallace et al. 2023, arXiv 2311.12908, eq. 14, in its
flow-matching form). Its randomness is its own (one ``torch.Generator`` seeded by ``--seed``: the
epoch order of the records, then σ and ε of each microbatch); it taps the contract's stage names
directly, so no alias file is needed.

    FFDEBUG_FWD_DUMP_DIR=D FFDEBUG_FWD_DUMP_SIDE=target python examples/external_trainer/offline_dpo.py
    FFDEBUG_FWD_DUMP_DIR=D FFDEBUG_FWD_DUMP_SIDE=ref reference-trainer train \\
        examples/external_trainer/offline_dpo.yaml --output-dir runs/dpo-ref --inputs-from D/target
    ffdebug bisect --dir D

One optimizer step = ``accumulation`` microbatches of ``batch`` pairs (x_0^w, x_0^l, prompt c):
σ ~ logit-normal clamped to [0.01, 0.99] and ε ~ N(0, I) shared by both arms; x_σ = (1 − σ)x_0 + σε;
e = mean over C·H·W of ‖v − (ε − x_0)‖² for the policy θ and the frozen reference;
L = −log sigmoid(−β/2 · ((e_θ^w − e_ref^w) − (e_θ^l − e_ref^l))), averaged over the pairs, divided by
``accumulation``; clip to ``max_grad_norm``; AdamW.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import ffdebug

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flow_grpo  # noqa: E402  (the models and the prompt encoder of the Flow-GRPO example)

DATASET = Path(__file__).resolve().parents[2] / "reference_trainer" / "fixtures" / "tiny_dataset"


@dataclass(frozen=True)
class Settings:
    """The run's hyper-parameters (those of ``offline_dpo.yaml``)."""

    steps: int = 3  # optimizer steps
    batch: int = 2  # pairs per microbatch
    accumulation: int = 2  # microbatches per optimizer step
    beta: float = 2000.0
    sigma_min: float = 0.01
    sigma_max: float = 0.99
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    seed: int = 5
    prompt_chunk: int = 1  # prompts CLIP-encoded per call; 0 = all in one batch (a harmless difference)


# ------------------------------------------------------------------------------------------ data
def load_pairs() -> tuple[list[dict], torch.Tensor]:
    """The preference records (prompt, chosen, rejected image indices) and the images, uint8 [N, 3, H, W]."""
    from safetensors.torch import load_file

    records = [json.loads(line) for line in (DATASET / "preferences.jsonl").read_text().splitlines()]
    return records, load_file(DATASET / "images.safetensors")["images"]


@torch.no_grad()
def encode_images(vae, images: torch.Tensor) -> torch.Tensor:
    """uint8 images [B, 3, 32, 32] -> x_0 = (mode q(z | x) − shift)·scale [B, 4, 8, 8] (SD3's latents)."""
    cfg = vae.config
    pixels = images.float() / 255.0 * 2.0 - 1.0
    return (vae.encode(pixels).latent_dist.mode() - cfg.shift_factor) * cfg.scaling_factor


# ------------------------------------------------------------------------------------------ loss
def velocity_target(x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The flow-matching target v* = ε − x_0."""
    return eps - x0


def errors(v: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """e = mean over C·H·W of (v − v*)², [n]."""
    return ((v.float() - target.float()) ** 2).mean(dim=(1, 2, 3))


def dpo_loss(e_w, e_l, e_ref_w, e_ref_l, beta: float) -> torch.Tensor:
    """−log sigmoid(−β/2 · ((e_θ^w − e_ref^w) − (e_θ^l − e_ref^l))), mean over pairs."""
    inside = -0.5 * beta * ((e_w - e_ref_w) - (e_l - e_ref_l))
    return -F.logsigmoid(inside).mean()


def rejected_noise(eps: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
    """The ε of the rejected arm: the chosen arm's (the pair shares its noise)."""
    return eps


def accumulation_divisor(s: Settings) -> int:
    """What each microbatch loss is divided by before backward."""
    return s.accumulation


def copy_reference(policy: torch.nn.Module) -> torch.nn.Module:
    """The frozen reference: a copy of the initial policy."""
    return copy.deepcopy(policy).requires_grad_(False)


def chosen_rejected(images: torch.Tensor, pairs: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen and rejected images of ``pairs``, uint8 [B, 3, H, W] each."""
    return images[[p["chosen"] for p in pairs]], images[[p["rejected"] for p in pairs]]


# ------------------------------------------------------------------------------------- training
def grad_norm(params) -> torch.Tensor:
    grads = [p.grad.detach().float().pow(2).sum() for p in params if p.grad is not None]
    return torch.stack(grads).sum().sqrt() if grads else torch.zeros(())


def tap_deltas(name, params, before):
    ffdebug.tap(name, torch.stack([(p.detach() - b).float().norm() for p, b in zip(params, before)]))


def microbatch_loss(s, models, records, images, ids, rng):
    """One microbatch's DPO loss (taps in the contract's order)."""
    tokenizer, text, vae, policy, reference = models
    pairs = [records[i] for i in ids]
    prompts = [p["prompt"] for p in pairs]
    ffdebug.tap("batch.sample_ids", torch.tensor(ids, dtype=torch.long))
    token_ids, states, pooled = flow_grpo.encode(tokenizer, text, prompts, s.prompt_chunk)
    ffdebug.tap("batch.prompt_ids", token_ids)
    chosen, rejected = chosen_rejected(images, pairs)
    x0_w, x0_l = encode_images(vae, chosen), encode_images(vae, rejected)
    ffdebug.tap("batch.x0_chosen", x0_w)
    ffdebug.tap("batch.x0_rejected", x0_l)
    b = len(ids)
    with ffdebug.step(timestep_draw=0):
        sigma = torch.sigmoid(torch.randn(b, generator=rng)).clamp(s.sigma_min, s.sigma_max)
        eps = torch.randn(b, 4, 8, 8, generator=rng)
        ffdebug.tap("train.sigma", sigma)
        ffdebug.tap("train.noise", eps)
        x0 = torch.cat([x0_w, x0_l])
        noise = torch.cat([eps, rejected_noise(eps, rng)])
        sig = torch.cat([sigma, sigma]).view(-1, 1, 1, 1)
        x_t = (1.0 - sig) * x0 + sig * noise
        cond = (torch.cat([states, states]), torch.cat([pooled, pooled]))
        v = flow_grpo.velocity(policy, x_t, sig.flatten(), cond)
        ffdebug.tap("train.velocity", v)
        with torch.no_grad():
            v_ref = flow_grpo.velocity(reference, x_t, sig.flatten(), cond)
        ffdebug.tap("train.velocity_ref", v_ref)
        target = velocity_target(x0, noise)
        e, e_ref = errors(v, target), errors(v_ref, target)
        ffdebug.tap("train.dpo_errors", torch.stack([e[:b], e[b:], e_ref[:b], e_ref[b:]]))
    return dpo_loss(e[:b], e[b:], e_ref[:b], e_ref[b:], s.beta)


def train(s: Settings) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tokenizer, text, vae, _, policy = flow_grpo.load_models()
    policy.requires_grad_(True)
    ffdebug.install(policy)
    reference = copy_reference(policy)
    if reference is not policy:
        ffdebug.install(reference)
    models = (tokenizer, text, vae, policy, reference)
    params = list(policy.parameters())
    optimizer = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=s.weight_decay)
    records, images = load_pairs()
    rng = torch.Generator().manual_seed(s.seed)
    per_epoch = len(records) // (s.batch * s.accumulation)  # optimizer steps per epoch
    order: list[int] = []
    for step in range(s.steps):
        epoch = step // per_epoch
        if step % per_epoch == 0:  # a new epoch: a new record order
            order = torch.randperm(len(records), generator=rng).tolist()
        with ffdebug.step(optimizer_step=step, rollout_iteration=0, data_epoch=epoch, phase="train"):
            for m in range(s.accumulation):
                start = ((step % per_epoch) * s.accumulation + m) * s.batch
                with ffdebug.step(microbatch=m):
                    loss = microbatch_loss(s, models, records, images, order[start : start + s.batch], rng)
                    scaled = loss / accumulation_divisor(s)
                    ffdebug.tap("loss.policy", scaled)
                    scaled.backward()
            frozen_norm = grad_norm(list(reference.parameters()))  # 0 for a frozen copy
            gnorm = torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm, foreach=False)
            ffdebug.tap("grad_norm.policy", gnorm.detach().clone())
            ffdebug.tap("grad_norm.reference", frozen_norm)
            before = [p.detach().clone() for p in params]
            frozen_before = [p.detach().clone() for p in reference.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            tap_deltas("update.policy", params, before)
            tap_deltas("update.reference", list(reference.parameters()), frozen_before)
        print(f"step {step + 1}: loss {float(loss.detach()):.4e} grad {float(gnorm):.3e}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--seed", type=int, default=Settings.seed)
    parser.add_argument("--batched-prompts", action="store_true", help="encode the prompts in one batch")
    args = parser.parse_args(argv)
    train(Settings(steps=args.steps, seed=args.seed, prompt_chunk=0 if args.batched_prompts else 1))


if __name__ == "__main__":
    main()
