"""Sampled gradients of a training step: `grad.<role>.<group>` and `grad_norm.<role>.<group>`
(docs/trainer-taps.md "Sampled gradients").

A parameter's **group** is its name up to the first index: `transformer_blocks.3.attn.to_q.weight`
is in `transformer_blocks.3`, `proj_out.weight` in `proj_out` (the name's first part, plus the
second when that is a number). Groups keep the order in which their first parameter comes.

From each parameter tensor of n elements, min(N, n) elements are sampled at indices that depend on
nothing but the parameter's name and shape, so two trainers that name their parameters alike
sample the same elements whatever their RNG:

    seed = first 8 bytes (big-endian) of sha256("<name>:<d0>x<d1>x...") mod 2^63
    indices = sorted(randperm(n, generator=Generator().manual_seed(seed))[:N])

`grad.<role>.<group>` is the group's samples, concatenated in parameter order ([Σ min(N, n)] fp32);
`grad_norm.<role>.<group>` is the group's gradient L2 norm ([] fp32), over every element. A
parameter with no gradient contributes zeros (and nothing to the norm).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache


def group_of(name: str) -> str:
    """`transformer_blocks.3.attn.to_q.weight` -> `transformer_blocks.3`; `proj_out.weight` -> `proj_out`."""
    parts = name.split(".")
    if len(parts) > 2 and parts[1].isdigit():
        return ".".join(parts[:2])
    return parts[0] if len(parts) > 1 else name


def seed_of(name: str, shape: tuple[int, ...]) -> int:
    """The sample seed of a parameter (module docstring)."""
    text = f"{name}:{'x'.join(str(d) for d in shape)}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % (2**63)


@lru_cache(maxsize=4096)
def sample_indices(name: str, shape: tuple[int, ...], count: int):
    """The flat indices sampled from a parameter of `shape` (module docstring)."""
    import torch

    numel = 1
    for d in shape:
        numel *= d
    if count >= numel:
        return torch.arange(numel)
    generator = torch.Generator().manual_seed(seed_of(name, shape))
    return torch.randperm(numel, generator=generator)[:count].sort().values


def tap_grads(session, role: str, named_parameters, count: int) -> None:
    """Tap each group's sampled gradient and norm into `session` (module docstring)."""
    import torch

    groups: dict[str, list] = {}
    for name, p in named_parameters:
        groups.setdefault(group_of(name), []).append((name, p))
    for group, params in groups.items():
        samples, squares = [], []
        for name, p in params:
            index = sample_indices(name, tuple(p.shape), count)
            if p.grad is None:
                samples.append(torch.zeros(len(index)))
                continue
            grad = p.grad.detach()
            if hasattr(grad, "full_tensor"):  # FSDP2: a sharded DTensor (a collective: every rank taps)
                grad = grad.full_tensor()
            flat = grad.reshape(-1).float()
            samples.append(flat[index.to(flat.device)].cpu())
            squares.append(flat.square().sum())
        norm = torch.stack(squares).sum().sqrt().cpu() if squares else torch.zeros(())
        session.tap(f"grad.{role}.{group}", torch.cat(samples), {})
        session.tap(f"grad_norm.{role}.{group}", norm, {})
