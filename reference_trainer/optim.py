"""One optimizer root for every trainable role, and the role phase that performs one optimizer step.

Flow-Factory Draft (``optimizer/composite.py``, ``trainers/role_optimization.py``): every trainable
role has one ``optimizers:`` entry (``adamw`` or ``muon``); everything lives in **one**
``CompositeOptimizer`` whose children are at most one ``torch.optim.AdamW`` and one ``torch.optim.Muon``.
A Muon role puts its 2-D weight matrices in a Muon group and the rest (biases, norms, conv kernels) in
an AdamW group of the same role. Muon settings follow Flow-Factory: momentum 0.95, Nesterov, Newton–
Schulz coefficients (3.4445, −4.7750, 2.0315), 5 steps, eps 1e-7, ``adjust_lr_fn="match_rms_adamw"``
(Moonshot's rule, so the AdamW lr is a sensible Muon lr).

``RoleOptimizer.phase(role)`` is one optimizer step of one role: no stale gradient may exist at entry;
``backward`` is called once per microbatch (a non-finite loss aborts with a message naming the role);
at exit the role's pre-clip gradient norm is computed and clipped, only that role's groups step, and
every gradient is cleared. The backward and the clip-and-step go through the optimizer root
(``CompositeOptimizer.backward`` / ``clip_and_step``), so that a backend whose engines own gradient
reduction and clipping (DeepSpeed ZeRO, ``reference_trainer.zero``) supplies its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

import ffdebug
from reference_trainer.sharding import full_tensor, like

if TYPE_CHECKING:  # types only: the YAML config module is not imported at run time
    from reference_trainer.config import OptimizerConfig
    from reference_trainer.taps import UpdateTaps

MUON_DEFAULTS = dict(nesterov=True, ns_coefficients=(3.4445, -4.7750, 2.0315), eps=1e-7, ns_steps=5)


class NonFiniteLossError(RuntimeError):
    """A loss or gradient norm is NaN/Inf; the run aborts instead of stepping."""


class CompositeOptimizer:
    """The single optimizer root: child optimizers whose param groups carry a ``role`` key."""

    def __init__(self, children: Sequence[torch.optim.Optimizer]):
        if not children:
            raise ValueError("CompositeOptimizer needs at least one child optimizer")
        self.children = list(children)

    @property
    def param_groups(self) -> tuple[dict, ...]:
        """Read-only view over every child's param groups."""
        return tuple(group for child in self.children for group in child.param_groups)

    def roles(self) -> list[str]:
        """Roles with at least one group, in group order."""
        return list(dict.fromkeys(group["role"] for group in self.param_groups))

    def lr(self, role: str) -> float:
        """The learning rate of ``role`` (its first group's)."""
        return float(next(group["lr"] for group in self.param_groups if group["role"] == role))

    @torch.no_grad()
    def step(self, role: str) -> None:
        """Step only ``role``'s groups: the other groups are emptied for the duration of the step."""
        stashed = []
        try:
            for group in self.param_groups:
                if group["role"] != role:
                    stashed.append((group, group["params"]))
                    group["params"] = []
            for child in self.children:
                if any(group["params"] for group in child.param_groups):
                    child.step()
        finally:
            for group, params in stashed:
                group["params"] = params

    def backward(self, role: str, loss: torch.Tensor) -> None:
        """Back-propagate one microbatch ``loss`` of a ``role`` phase."""
        loss.backward()

    def clip_and_step(self, role: str, params: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
        """The pre-clip norm of ``params``' gradients; clip them to ``max_norm`` and step ``role``, unless
        the norm is non-finite (then nothing steps: the caller aborts)."""
        grads = [p.grad for p in params if p.grad is not None]
        # FSDP2: a norm of sharded gradients is a partial DTensor; its full value is the global norm
        grad_norm = full_tensor(torch.nn.utils.get_total_norm(grads, foreach=False))
        if not bool(torch.isfinite(grad_norm)):
            return grad_norm
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, grad_norm, foreach=False)
        self.step(role)
        return grad_norm

    def zero_grad(self) -> None:
        """Clear every child's gradients (set to ``None``)."""
        for child in self.children:
            child.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        """``{"composite": [child state_dict, ...]}`` in child order."""
        return {"composite": [child.state_dict() for child in self.children]}

    def load_state_dict(self, state: Mapping) -> None:
        """Load a ``state_dict()`` result into the children, in order; the child count must match."""
        states = state["composite"]
        if len(states) != len(self.children):
            raise ValueError(
                f"optimizer state has {len(states)} children, the optimizer has {len(self.children)}"
            )
        for child, child_state in zip(self.children, states):
            child.load_state_dict(_sharded_like_params(child, child_state))

    def describe(self) -> list[dict]:
        """Layout for the run identity: child type, role, kind and parameter shapes of every group."""
        return [
            {
                "optimizer": type(child).__name__,
                "role": group["role"],
                "kind": group["kind"],
                "shapes": [list(p.shape) for p in group["params"]],
            }
            for child in self.children
            for group in child.param_groups
        ]


def _sharded_like_params(child: torch.optim.Optimizer, state: Mapping) -> Mapping:
    """A child's state whose full per-parameter tensors (a checkpoint's) are sharded like its ``DTensor``
    parameters (FSDP2); unchanged for plain parameters. Scalars (``step``) stay as they are."""
    params = [p for group in child.param_groups for p in group["params"]]
    ids = [i for group in state.get("param_groups", ()) for i in group["params"]]
    if len(ids) != len(params):
        return state  # load_state_dict names the mismatch
    per_param = dict(state.get("state", {}))
    for param_id, param in zip(ids, params):
        if param_id in per_param:
            per_param[param_id] = {
                key: like(param, value) if isinstance(value, torch.Tensor) and value.ndim else value
                for key, value in per_param[param_id].items()
            }
    return {**state, "state": per_param}


def build_optimizer(
    roles: Mapping[str, list[nn.Parameter]], configs: Mapping[str, OptimizerConfig]
) -> CompositeOptimizer:
    """One ``CompositeOptimizer`` over ``roles`` (``{role: params}``) configured by ``configs``."""
    adamw_groups: list[dict] = []
    muon_groups: list[dict] = []
    for role, params in roles.items():
        config = configs[role]
        adamw = dict(
            lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, role=role
        )
        if config.optimizer == "adamw":
            adamw_groups.append(dict(params=list(params), kind="adamw", **adamw))
            continue
        matrices = [p for p in params if p.ndim == 2]
        remainder = [p for p in params if p.ndim != 2]
        muon_groups.append(
            dict(
                params=matrices,
                lr=config.lr,
                weight_decay=config.weight_decay,
                momentum=config.momentum,
                adjust_lr_fn="match_rms_adamw",
                role=role,
                kind="muon",
                **MUON_DEFAULTS,
            )
        )
        if remainder:
            adamw_groups.append(dict(params=remainder, kind="adamw", **adamw))
    children: list[torch.optim.Optimizer] = []
    if adamw_groups:
        children.append(torch.optim.AdamW(adamw_groups))
    if muon_groups:
        children.append(torch.optim.Muon(muon_groups))
    return CompositeOptimizer(children)


@dataclass
class StepResult:
    """What one role phase did: the logged ``loss.<role>``, ``grad_norm.<role>`` (pre-clip), ``lr.<role>``."""

    role: str
    loss: float
    grad_norm: float
    lr: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RolePhase:
    """One open optimizer step of ``role``; collects the microbatch losses passed to ``backward``."""

    role: str
    optimizer_step: int
    loss: float = 0.0
    backward_calls: int = 0
    metric_sums: dict[str, float] = field(default_factory=dict)
    run_backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    """How a microbatch loss is back-propagated (the optimizer root's ``backward`` for this role)."""

    def backward(
        self,
        loss: torch.Tensor,
        metrics: Mapping[str, float | torch.Tensor] | None = None,
        *,
        scale: float | None = None,
    ) -> None:
        """Back-propagate one microbatch loss (already scaled by 1/num_microbatches by the caller).

        ``loss.<role>`` for the step is the sum of these values; metrics are averaged over calls.
        ``scale``: Σ|terms| of the loss (scaled the same way), tapped so that a loss of cancelling
        terms is judged with an absolute tolerance (docs/trainer-taps.md "Near-zero values").
        """
        if not bool(torch.isfinite(loss)):
            raise NonFiniteLossError(
                f"loss.{self.role} is {loss.item()} at optimizer step {self.optimizer_step} "
                f"(microbatch {self.backward_calls}); aborting"
            )
        extra = {} if scale is None else {"scale": scale}
        ffdebug.tap(f"loss.{self.role}", loss, microbatch=self.backward_calls, **extra)
        self.run_backward(loss)
        self.loss += float(loss.detach())
        self.backward_calls += 1
        for key, value in (metrics or {}).items():
            self.metric_sums[key] = self.metric_sums.get(key, 0.0) + float(value)

    def metrics(self) -> dict[str, float]:
        """Each metric passed to ``backward`` averaged over the backward calls of this phase."""
        return {key: total / self.backward_calls for key, total in self.metric_sums.items()}


class RoleOptimizer:
    """Runs role phases on one ``CompositeOptimizer`` and reports each finished step."""

    def __init__(
        self,
        optimizer: CompositeOptimizer,
        roles: Mapping[str, list[nn.Parameter]],
        *,
        max_grad_norm: float,
        next_step: Callable[[], int],
        on_step: Callable[[StepResult], None],
        update_taps: UpdateTaps | None = None,
        param_names: Mapping[str, list[str]] | None = None,
    ):
        self.optimizer = optimizer
        self.param_names = dict(param_names or {})
        self.update_taps = update_taps
        self.roles = dict(roles)
        self.max_grad_norm = max_grad_norm
        self._next_step = next_step
        self._on_step = on_step

    def _all_params(self) -> Iterator[nn.Parameter]:
        for params in self.roles.values():
            yield from params

    @contextmanager
    def phase(self, role: str) -> Iterator[RolePhase]:
        """One optimizer step of ``role`` (see the module docstring)."""
        if role not in self.roles:
            raise KeyError(f"unknown role {role!r}; roles: {list(self.roles)}")
        stale = [p for p in self._all_params() if p.grad is not None]
        if stale:
            raise RuntimeError(
                f"{len(stale)} parameters hold stale gradients at the start of a {role!r} phase"
            )
        phase = RolePhase(
            role=role,
            optimizer_step=self._next_step(),
            run_backward=lambda loss: self.optimizer.backward(role, loss),
        )
        try:
            yield phase
            if phase.backward_calls == 0:
                raise RuntimeError(f"the {role!r} phase ended without any backward()")
            result = self._finish(phase)
        finally:
            self.optimizer.zero_grad()
        self._on_step(result)

    def _finish(self, phase: RolePhase) -> StepResult:
        params = self.roles[phase.role]
        max_norm = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
        names = self.param_names.get(phase.role) or [f"param{i}" for i in range(len(params))]
        ffdebug.tap_grads(phase.role, zip(names, params, strict=True))  # opt-in: grad.<role>.<group>
        with self.update_taps.around_step(phase.role) if self.update_taps else nullcontext():
            # update.<name>: each watched tensor's update norm around the step, tapped on leaving
            # the block, so after grad_norm (training order: grad, then update; docs/trainer-taps.md)
            # the snapshots' gradient norms (0 when frozen), pre-clip: gradients where none belong
            others = self.update_taps.other_grad_norms(phase.role) if self.update_taps else {}
            grad_norm = self.optimizer.clip_and_step(phase.role, params, max_norm)
            ffdebug.tap(f"grad_norm.{phase.role}", grad_norm.detach().clone())
            for name, norm in others.items():
                ffdebug.tap(f"grad_norm.{name}", norm)
        if not bool(torch.isfinite(grad_norm)):
            raise NonFiniteLossError(
                f"grad_norm.{phase.role} is {grad_norm.item()} at optimizer step {phase.optimizer_step}; aborting"
            )
        return StepResult(
            role=phase.role,
            loss=phase.loss,
            grad_norm=float(grad_norm),
            lr=self.optimizer.lr(phase.role),
            metrics=phase.metrics(),
        )
