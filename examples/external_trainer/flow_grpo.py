"""A Flow-GRPO trainer written from scratch on the tiny SD3 fixtures: the "your own trainer" of
docs/trainer-taps.md, compared stage by stage with the reference trainer.

It imports nothing from ``reference_trainer``: the models are loaded with diffusers / transformers
from the fixture directory, and the sampler, reward, advantages, loss and optimizer step are written
here from the paper (Liu et al. 2025, arXiv 2505.05470). Its randomness is its own (one
``torch.Generator`` seeded by ``--seed``, in its own order), and so are its stage names: ``taps.txt``
maps them to the contract's for ``--inputs-from`` and ``ffdebug compare``.

    FFDEBUG_FWD_DUMP_DIR=D FFDEBUG_FWD_DUMP_SIDE=target python examples/external_trainer/flow_grpo.py
    FFDEBUG_FWD_DUMP_DIR=D FFDEBUG_FWD_DUMP_SIDE=ref reference-trainer train \\
        examples/external_trainer/reference.yaml --output-dir runs/ext-ref \\
        --inputs-from D/target --inputs-map-file examples/external_trainer/taps.txt
    ffdebug bisect --dir D --alias-file examples/external_trainer/taps.txt

One iteration: P prompts × K samples; a Flow-SDE rollout of T steps (no grad); reward
r = −|mean(image) − 1|; group-normalised advantages; then one optimizer step over every sample and
every step j: L = mean max(−Â·ρ, −Â·clip(ρ, 1 ± ε)) + β·KL(p_θ ‖ p_ref), ρ = p_θ / p_old.
"""

from __future__ import annotations

import argparse
import copy
import math
from dataclasses import dataclass
from pathlib import Path

import torch

import ffdebug

FIXTURES = Path(__file__).resolve().parents[2] / "reference_trainer" / "fixtures" / "sd3_tiny"
PROMPTS = ("a red cat", "a blue dog", "a green tree", "a yellow sun")
TOKENS = 8  # prompt length, padded


@dataclass(frozen=True)
class Settings:
    """The run's hyper-parameters (those of ``reference.yaml``)."""

    steps: int = 3  # optimizer steps, one per iteration
    prompts: int = 2  # P
    group: int = 4  # K
    denoise: int = 4  # T
    noise_level: float = 0.7  # a
    clip: float = 1e-4  # ε
    adv_clip: float = 5.0
    adv_eps: float = 1e-4
    beta: float = 0.01
    lr: float = 3e-3
    max_grad_norm: float = 1.0
    seed: int = 7
    prompt_chunk: int = 1  # prompts CLIP-encoded per call; 0 = all in one batch (a harmless difference)
    shift: float | None = None  # the σ schedule's shift; None = the fixture scheduler's own (3.0)


# ------------------------------------------------------------------------------------------ models
def load_models():
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(FIXTURES / "tokenizer")
    text = CLIPTextModelWithProjection.from_pretrained(FIXTURES / "text_encoder").requires_grad_(False).eval()
    vae = AutoencoderKL.from_pretrained(FIXTURES / "vae").requires_grad_(False).eval()
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(FIXTURES / "scheduler")
    policy = SD3Transformer2DModel.from_pretrained(FIXTURES / "transformer").eval()
    return tokenizer, text, vae, scheduler, policy


@torch.no_grad()
def encode(tokenizer, text, prompts, chunk: int):
    """(token ids [B, L], CLIP penultimate states [B, L, D], pooled [B, D]), `chunk` prompts per
    encoder call (0: all in one)."""
    ids = tokenizer(
        list(prompts), padding="max_length", max_length=TOKENS, truncation=True, return_tensors="pt"
    )
    ids = ids.input_ids
    size = chunk if chunk > 0 else len(ids)
    rows = [ids[i : i + size] for i in range(0, len(ids), size)]
    outs = [text(r, output_hidden_states=True) for r in rows]
    states = torch.cat([o.hidden_states[-2].float() for o in outs])
    pooled = torch.cat([o.text_embeds.float() for o in outs])
    return ids, states, pooled


def velocity(model, x, sigma, cond):
    states, pooled = cond
    out = model(
        hidden_states=x,
        encoder_hidden_states=states,
        pooled_projections=pooled,
        timestep=sigma * 1000.0,
        return_dict=False,
    )
    return out[0].float()


# ------------------------------------------------------------------------------------- Flow-SDE
def sde_moments(v, x, t, t_next, a, t_max):
    """Mean of x_{t+Δt} | x_t (paper eq. 12), σ_t = a·√(t/(1−t)) and Δt < 0, each [B, 1, 1, 1] or [B, ...]."""
    t, t_next = t.view(-1, 1, 1, 1), t_next.view(-1, 1, 1, 1)
    dt = t_next - t
    sig = a * torch.sqrt(t / (1.0 - torch.where(t == 1.0, torch.full_like(t, t_max), t)))
    mean = x * (1.0 + sig**2 / (2.0 * t) * dt) + v * (1.0 + sig**2 * (1.0 - t) / (2.0 * t)) * dt
    return mean, sig, dt


def transition_std(sig, dt):
    """The std of the Gaussian transition: σ_t·√(−Δt)."""
    return sig * torch.sqrt(-dt)


def log_prob(x_next, mean, sig, dt):
    """Mean over latent dims of log N(x_next; mean, (σ_t√(−Δt))²), [B]."""
    std = transition_std(sig, dt)
    per = -((x_next - mean) ** 2) / (2.0 * std**2) - torch.log(std) - 0.5 * math.log(2.0 * math.pi)
    return per.expand(x_next.shape).mean(dim=(1, 2, 3))


@torch.no_grad()
def rollout(model, cond, sigmas, a, rng, batch):
    """x_T ~ N(0, I), then T SDE steps; returns (x_T, ε [B, T, ...], latents [B, T + 1, ...], log p [B, T])."""
    noise = torch.randn(batch, 4, 8, 8, generator=rng)
    x, xs, logps, eps_all = noise, [noise], [], []
    for j in range(len(sigmas) - 1):
        t, t_next = sigmas[j].expand(batch), sigmas[j + 1].expand(batch)
        mean, sig, dt = sde_moments(velocity(model, x, t, cond), x, t, t_next, a, float(sigmas[1]))
        eps = torch.randn(batch, 4, 8, 8, generator=rng)
        x = mean + transition_std(sig, dt) * eps
        xs.append(x)
        eps_all.append(eps)
        logps.append(log_prob(x, mean, sig, dt))
    return noise, torch.stack(eps_all, 1), torch.stack(xs, 1), torch.stack(logps, 1)


# ------------------------------------------------------------------------------ reward, advantage
@torch.no_grad()
def reward(vae, latents):
    cfg = vae.config
    images = vae.decode(latents / cfg.scaling_factor + cfg.shift_factor, return_dict=False)[0]
    images = (images / 2 + 0.5).clamp(0, 1)
    return -(images.float().mean(dim=(1, 2, 3)) - 1.0).abs()


def advantages(r, group: int, eps: float):
    """A = (r − mean_G r) / (std_G r + eps) per group of K contiguous samples (fp64 inside)."""
    g = r.double().view(-1, group)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, unbiased=False, keepdim=True) + eps)).flatten().float()


# ------------------------------------------------------------------------------------- training
def step_loss(policy, frozen, s: Settings, batch, j, sigmas):
    x, x_next = batch["x"][:, j], batch["x"][:, j + 1]
    n = len(x)
    t, t_next = sigmas[j].expand(n), sigmas[j + 1].expand(n)
    mean, sig, dt = sde_moments(
        velocity(policy, x, t, batch["cond"]), x, t, t_next, s.noise_level, float(sigmas[1])
    )
    logp = log_prob(x_next, mean, sig, dt)
    with torch.no_grad():
        ref_mean, _, _ = sde_moments(
            velocity(frozen, x, t, batch["cond"]), x, t, t_next, s.noise_level, float(sigmas[1])
        )
    ratio = torch.exp(logp - batch["logp"][:, j])
    ffdebug.tap("pg.logp", logp)
    ffdebug.tap("pg.ratio", ratio.detach())
    adv = batch["adv"].clamp(-s.adv_clip, s.adv_clip)
    terms = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - s.clip, 1.0 + s.clip))
    kl = kl_term(mean, ref_mean, transition_std(sig, dt))
    ffdebug.tap("pg.kl", kl.detach())
    scale = float((adv.abs() * ratio.detach()).mean()) + s.beta * float(kl.detach())
    return terms.mean() + s.beta * kl, scale


def kl_term(mean, ref_mean, std):
    """KL(N(μ_θ, s²) ‖ N(μ_ref, s²)) = (μ_θ − μ_ref)² / (2s²), averaged over dims and batch."""
    return ((mean - ref_mean) ** 2 / (2.0 * std**2)).expand(mean.shape).mean(dim=(1, 2, 3)).mean()


def tap_deltas(name, params, before):
    ffdebug.tap(name, torch.stack([(p.detach() - b).float().norm() for p, b in zip(params, before)]))


def train(s: Settings) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tokenizer, text, vae, scheduler, policy = load_models()
    policy.requires_grad_(True)
    ffdebug.install(policy)
    frozen = copy.deepcopy(policy).requires_grad_(False)  # after install: installs on the copy once
    ffdebug.install(frozen)
    params = list(policy.parameters())
    optimizer = torch.optim.AdamW(params, lr=s.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    rng = torch.Generator().manual_seed(s.seed)
    if s.shift is not None:  # another schedule: the reference must not adopt it (docs/trainer-taps.md)
        scheduler = type(scheduler).from_config(scheduler.config, shift=s.shift)
    scheduler.set_timesteps(s.denoise)
    sigmas = scheduler.sigmas.to(torch.float32)
    batch_size = s.prompts * s.group
    for it in range(s.steps):
        tags = dict(optimizer_step=it, rollout_iteration=it, data_epoch=0)
        with ffdebug.step(**tags, phase="rollout"):
            picked = torch.randperm(len(PROMPTS), generator=rng)[: s.prompts].tolist()
            prompts = [PROMPTS[i] for i in picked for _ in range(s.group)]
            ids, states, pooled = encode(tokenizer, text, prompts, s.prompt_chunk)
            cond = (states, pooled)
            noise, eps, xs, logps = rollout(policy, cond, sigmas, s.noise_level, rng, batch_size)
            for name, value in (
                ("in.tokens", ids),
                ("in.x_T", noise),
                ("in.eps", eps),
                ("in.sigmas", sigmas),
            ):
                ffdebug.tap(name, value)
            ffdebug.tap("traj.x", xs)
            ffdebug.tap("traj.logp", logps)
            r = reward(vae, xs[:, -1])
            adv = advantages(r, s.group, s.adv_eps)
            ffdebug.tap("score", r)
            ffdebug.tap("adv", adv)
        perm = torch.randperm(batch_size, generator=rng)
        batch = dict(x=xs[perm], logp=logps[perm], adv=adv[perm], cond=(states[perm], pooled[perm]))
        with ffdebug.step(**tags, phase="train"):
            ffdebug.tap("perm", perm)
            for j in range(s.denoise):
                with ffdebug.step(timestep=j, microbatch=j):
                    loss, scale = step_loss(policy, frozen, s, batch, j, sigmas)
                scaled = loss / s.denoise
                ffdebug.tap("objective", scaled, microbatch=j, scale=scale / s.denoise)
                scaled.backward()
            ffdebug.tap_grads("policy", policy.named_parameters())  # opt-in sampled gradients, pre-clip
            frozen_grads = [p.grad.float().pow(2).sum() for p in frozen.parameters() if p.grad is not None]
            frozen_norm = (
                torch.stack(frozen_grads).sum().sqrt() if frozen_grads else torch.zeros(())
            )  # pre-clip
            gnorm = torch.nn.utils.clip_grad_norm_(params, s.max_grad_norm, foreach=False)
            ffdebug.tap("gnorm", gnorm.detach().clone())
            ffdebug.tap("gnorm.frozen", frozen_norm)  # 0: the reference takes no gradient
            before = [p.detach().clone() for p in params]
            frozen_before = [p.detach().clone() for p in frozen.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            tap_deltas("delta.policy", params, before)
            tap_deltas("delta.frozen", list(frozen.parameters()), frozen_before)
        print(
            f"step {it + 1}: reward {float(r.mean()):.4f} loss {float(loss.detach()):.3e} grad {float(gnorm):.3e}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=Settings.steps)
    parser.add_argument("--seed", type=int, default=Settings.seed)
    parser.add_argument("--beta", type=float, default=Settings.beta)
    parser.add_argument("--batched-prompts", action="store_true", help="encode the prompts in one batch")
    parser.add_argument("--prompt-chunk", type=int, default=1, help="prompts per encoder call (default 1)")
    parser.add_argument(
        "--shift", type=float, default=None, help="the σ schedule's shift (default: the fixture's)"
    )
    args = parser.parse_args(argv)
    chunk = 0 if args.batched_prompts else args.prompt_chunk
    train(Settings(steps=args.steps, seed=args.seed, beta=args.beta, prompt_chunk=chunk, shift=args.shift))


if __name__ == "__main__":
    main()
