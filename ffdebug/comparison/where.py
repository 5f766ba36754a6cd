"""Where inside a tensor the error sits (README "Comparing"): per head, per token, and the
coordinate of the largest error named by its axes.

Layer stages are laid out by role (README "Role sub-stages"): block stages `[batch, token,
channel]`, attention sub-stages `[batch, token, head, head_dim]`. For those layouts:

    per_token_rel[s] = ‖t[:, s] − r[:, s]‖ / ‖r[:, s]‖         (over batch, heads, channels)
    per_head_rel[h]  = ‖t[:, :, h] − r[:, :, h]‖ / ‖r[:, :, h]‖  (attention sub-stages only)

and the error "rises from token N" when token N is the first whose rel exceeds `RISE` x every
earlier token's (and earlier tokens exist): a window, a cache or a position offset that goes wrong
past some length. Computed in float64 on the loaded pair, only for stages that are not bit-equal.
"""

from __future__ import annotations

from dataclasses import dataclass

RISE = 10.0  # a token whose error is this many times every earlier token's starts a rise
MAX_ELEMENTS = 1 << 26  # larger stages are not broken down (two float64 copies)


@dataclass(frozen=True)
class Where:
    """The breakdown of one stage's error (None where the layout does not say)."""

    axes: tuple[str, ...]
    per_token_rel: list[float | None]
    per_head_rel: list[float | None] | None
    rise_from: int | None


def axes_of(key: str, shape: list[int] | None) -> tuple[str, ...] | None:
    """The axis names of a layer stage's layout, None for other stages or shapes."""
    if shape is None or not key.startswith("L"):
        return None
    if len(shape) == 4 and ".attn." in f".{key.split('.', 1)[-1]}":
        return ("batch", "token", "head", "channel")
    if len(shape) == 3:
        return ("batch", "token", "channel")
    return None


def _rel(diff2, ref2) -> list[float | None]:
    return [
        float((d / r).sqrt()) if float(r) > 0 else (0.0 if float(d) == 0 else None)
        for d, r in zip(diff2, ref2)
    ]


def _rise(per_token: list[float | None]) -> int | None:
    worst_before = None
    for s, rel in enumerate(per_token):
        if rel is None:
            return None
        if worst_before is not None and rel > 0 and rel > RISE * worst_before:
            return s
        worst_before = rel if worst_before is None else max(worst_before, rel)
    return None


def breakdown(key: str, ref, target) -> Where | None:
    """Per-token (and per-head) error of a layer stage; None when the layout is not known, the
    tensors are too large or hold non-finite values."""
    import torch

    axes = axes_of(key, list(ref.shape))
    if axes is None or ref.numel() > MAX_ELEMENTS or tuple(ref.shape) != tuple(target.shape):
        return None
    r, t = ref.detach().to(torch.float64), target.detach().to(torch.float64)
    if not (bool(torch.isfinite(r).all()) and bool(torch.isfinite(t).all())):
        return None
    d2, r2 = (t - r).pow(2), r.pow(2)
    others = [i for i in range(r.dim()) if i != 1]
    per_token = _rel(d2.sum(others), r2.sum(others))
    per_head = None
    if "head" in axes:
        per_head = _rel(d2.sum((0, 1, 3)), r2.sum((0, 1, 3)))
    return Where(axes, per_token, per_head, _rise(per_token))


def named(axes: tuple[str, ...], at: list[int] | None) -> dict | None:
    """The max-error coordinate as `{"batch": b, "token": s, ...}`."""
    if at is None or len(at) != len(axes):
        return None
    return dict(zip(axes, at))
