"""The reference trainer's ffdebug taps of its inputs and of each optimizer step's weight update.

The tap contract (stage names, shapes, dtypes, tags, call order) is ``docs/trainer-taps.md``; the
taps of the model's blocks, rewards, advantages, losses and gradient norms are made where those are
computed. This module owns the two kinds that need more than one line:

* **inputs** of a rollout iteration, tapped first in the rollout phase so ``ffdebug compare`` can
  check that both runs were fed the same ones before any number is compared: ``rollout.prompt_ids``
  (the prompts' token ids [B, L] int64), ``rollout.noise`` (x_0 ~ N(0, I), [B, C, H, W] fp32),
  ``rollout.sde_noise`` (the per-step ε of the Flow-SDE, [B, T, C, H, W] fp32) and
  ``rollout.timesteps`` (the σ schedule, [T + 1] fp32); ``train.order`` (the sample order [B] int64
  of the iteration's minibatches) opens the train phase.
* **gradient norms of the other roles** ``grad_norm.<name>`` of every frozen snapshot (0 when frozen);
* **updates** ``update.<name>``: after an optimizer step of a role, the L2 norm of θ_after − θ_before
  of every parameter tensor, in parameter order ([n_tensors] fp32), for the stepped role *and* for
  every frozen snapshot (``update.reference``): a frozen snapshot's norms must be exactly zero, so a
  reference that trains along with the policy is named as its own weights changing.

Nothing is copied or tapped unless dumps are on (``ffdebug.enabled()``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

import ffdebug
from ffdebug.capture.trainer_inputs import INPUT_KEYS

if TYPE_CHECKING:  # types only
    from reference_trainer.adapters.base import BaseAdapter, Trajectory

INPUT_STAGES = INPUT_KEYS
"""The stages a run's inputs are tapped as (ffdebug's ``capture.trainer_inputs``, the gate's order);
``--inputs-from`` reads the same names."""


def tap_inputs(
    prompt_ids: torch.Tensor,
    noise: torch.Tensor,
    sde_noise: torch.Tensor | None,
    timesteps: torch.Tensor,
    *,
    schedule_from: str,
) -> None:
    """Tap a rollout iteration's inputs (module docstring), before anything computed from them;
    ``schedule_from``: the configuration the σ schedule is computed from (its ``derived_from``)."""
    ffdebug.tap("rollout.prompt_ids", prompt_ids)
    ffdebug.tap("rollout.noise", noise)
    if sde_noise is not None:
        ffdebug.tap("rollout.sde_noise", sde_noise)
    ffdebug.tap("rollout.timesteps", timesteps, derived_from=schedule_from)


def tap_rollout_inputs(
    adapter: BaseAdapter, prompts: Sequence[str], trajectory: Trajectory, *, num_steps_field: str
) -> None:
    """Tap the inputs of a rollout of ``prompts`` (each trainer that rolls out calls this right
    after ``adapter.inference``): nothing when the adapter has no token ids or the trajectory no
    initial noise; ``rollout.sde_noise`` only for a stochastic sampler (noise level > 0).
    ``num_steps_field``: the config field that set the rollout's step count."""
    if not ffdebug.enabled():
        return
    ids = adapter.prompt_token_ids(list(prompts))
    if ids is not None and trajectory.noise is not None:
        schedule_from = f"{num_steps_field}={len(trajectory.sigmas) - 1} and {adapter.schedule_source()}"
        tap_inputs(
            ids, trajectory.noise, trajectory.sde_noise, trajectory.sigmas, schedule_from=schedule_from
        )


def delta_norms(after: Sequence[torch.Tensor], before: Sequence[torch.Tensor]) -> torch.Tensor:
    """‖θ_after − θ_before‖₂ per tensor, [n_tensors] fp32 (the norm of each tensor's update)."""
    return torch.stack([(a.detach() - b).float().norm() for a, b in zip(after, before, strict=True)])


class UpdateTaps:
    """``update.<name>`` around an optimizer step: the weights to watch come from ``watched()``,
    ``{name: tensors}`` (the stepped role's parameters and every snapshot's tensors)."""

    def __init__(self, watched: Callable[[str], Mapping[str, Sequence[torch.Tensor]]]) -> None:
        self.watched = watched

    def other_grad_norms(self, role: str) -> dict[str, torch.Tensor]:
        """``{name: ‖grad‖₂}`` of every watched name but the stepped ``role`` (its snapshots), before the
        step: exactly 0 for a frozen snapshot; tapped as ``grad_norm.<name>``, so a target whose
        reference takes gradients is named at that role's own gradient norm (docs/trainer-taps.md)."""
        if not ffdebug.enabled():
            return {}
        norms = {}
        for name, tensors in self.watched(role).items():
            if name != role:
                squares = [t.grad.detach().float().pow(2).sum() for t in tensors if t.grad is not None]
                norms[name] = torch.stack(squares).sum().sqrt() if squares else torch.zeros(())
        return norms

    @contextmanager
    def around_step(self, role: str) -> Iterator[None]:
        """Copy the watched weights, let the step run, then tap each name's per-tensor update norms."""
        if not ffdebug.enabled():
            yield
            return
        before = {name: [t.detach().clone() for t in tensors] for name, tensors in self.watched(role).items()}
        yield
        for name, tensors in self.watched(role).items():
            ffdebug.tap(f"update.{name}", delta_norms(list(tensors), before[name]))
