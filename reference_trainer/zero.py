"""``backend.kind: deepspeed``: ZeRO-1/2 through ``deepspeed.initialize``, one engine per trainable role.

An optional extra (``DS_BUILD_OPS=0 pip install 'ffdebug[deepspeed]'``, pinned to deepspeed 0.19.8; its
first run JIT-builds a shared-memory op for about a minute); ``deepspeed`` is imported only when this
backend is built, never by CI. Ranks come from ``torch.distributed`` (a gloo group of the torchrun
launch), not from Accelerate's DeepSpeed plugin, which reports ``process_index 0`` on every rank (every
rank would publish checkpoints).

**One engine per role.** A DeepSpeed engine owns one module's gradient reduction and one optimizer, and
its ``step()`` updates every parameter it holds. The trainers step role by role (DMD2: ``fake``, then
``generator``, each with its own AdamW moments); one engine over both variants would apply weight decay
and moment decay to the role that did not train in that phase. So ``DeepSpeedBackend.prepare`` gives
every trainable variant (one per role, ``roles.check_ownership``) its own engine, with a fresh
``torch.optim.AdamW`` over that role's groups (DeepSpeed replaces its client optimizer's parameters by
flat partitions, so the trainer's ``CompositeOptimizer`` is kept untouched as the layout of the state).

Engine settings (``engine_config``): fp32 (no ``fp16`` / ``bf16``), ``gradient_clipping`` =
``train.max_grad_norm``, ``overlap_comm`` off (no side stream: a deterministic reduction order), and
``managed_gradient_accumulation: false``: every ``engine.backward`` accumulates locally and
``engine.step()`` is the accumulation boundary, so a role phase of any number of backward calls is one
step (with DeepSpeed's managed mode and ``gradient_accumulation_steps: 1`` a second backward in the same
step overwrites the first's gradients; measured).

**The role phase** (``optim.RolePhase``) goes through ``ZeroOptimizer``: ``backward`` is
``engine.backward(loss)`` and ``clip_and_step`` is ``engine.step()`` (reduce-scatter of the gradients as a
mean over ranks, global-norm clipping, AdamW on this rank's partition, all-gather of the weights), the
logged norm being ``engine.get_global_grad_norm()`` (pre-clip). The norm is known only inside
``step()``, so a non-finite gradient norm aborts the run *after* the step (fp32 has no overflow skip);
the aborted run writes no checkpoint.

**Checkpoints** hold full state in the layout of every other backend (``BaseTrainer.save``): the
variants' weights are whole on every rank after each step (ZeRO-1/2 partition only optimizer state and
gradients), and ``ZeroOptimizer.state_dict`` gathers each parameter's AdamW moments
(``deepspeed.utils.safe_get_full_optimizer_state``, a collective) into the ``CompositeOptimizer``'s
``state_dict`` layout; rank 0 writes and publishes after a barrier. Resume scatters them back
(``safe_set_full_optimizer_state``) and re-copies the fp32 master partitions from the loaded weights.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from reference_trainer.distributed import ProcessGroupBackend, require_launch
from reference_trainer.errors import ConfigError
from reference_trainer.optim import CompositeOptimizer

if TYPE_CHECKING:
    from reference_trainer.config import BackendConfig

INSTALL = "DS_BUILD_OPS=0 pip install 'ffdebug[deepspeed]'"


def require_deepspeed() -> None:
    """``ConfigError`` naming the install command when the optional extra is missing."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError("backend.kind", f"deepspeed is not installed; install the extra: {INSTALL}")


def engine_config(zero_stage: int, max_grad_norm: float) -> dict[str, Any]:
    """The DeepSpeed config of one role's engine (module docstring)."""
    return {
        "train_micro_batch_size_per_gpu": 1,  # required; read by DeepSpeed's data loader only (unused)
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": float(max_grad_norm),
        "zero_optimization": {"stage": zero_stage, "overlap_comm": False, "contiguous_gradients": False},
        "zero_allow_untested_optimizer": True,  # the client optimizer is torch.optim.AdamW
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }


class EngineModule(nn.Module):
    """Routes a variant's forwards through its DeepSpeed engine; ``module`` is the variant itself (the
    engine is held outside the module tree)."""

    def __init__(self, engine: Any):
        super().__init__()
        self.module = engine.module
        self._engine = (engine,)

    @property
    def engine(self) -> Any:
        """The ``DeepSpeedEngine`` of this variant."""
        return self._engine[0]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The engine's forward (DeepSpeed's wrapper around the variant's module)."""
        return self.engine(*args, **kwargs)


class ZeroOptimizer(CompositeOptimizer):
    """The ``CompositeOptimizer`` interface over one engine per role.

    ``children`` stay the trainer's own optimizers, never stepped: their groups give the roles, the
    learning rates, the layout described in the run identity and the ``state_dict`` skeleton.
    """

    def __init__(self, layout: CompositeOptimizer, engines: Mapping[str, Any]):
        super().__init__(layout.children)
        self.engines = dict(engines)
        self.stepped: list[str] = []
        """Roles in the order of their first step: ``torch.optim.AdamW`` creates its per-parameter
        state in that order, and the checkpoint keeps it (a dict is stored as ordered pairs)."""
        self._reached: set[str] = set()
        for role in self.engines:
            for p in self._role_params(role):
                p.register_hook(self._reach(role))

    def _reach(self, role: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            self._reached.add(role)

        return hook

    def _role_params(self, role: str) -> list[nn.Parameter]:
        return [p for group in self.param_groups if group["role"] == role for p in group["params"]]

    def backward(self, role: str, loss: torch.Tensor) -> None:
        """``engine.backward(loss)`` of ``role``; a loss whose gradient reaches another role's parameters
        is refused: that role's engine would reduce it into its own next step (the other backends drop
        it when the phase clears every gradient)."""
        self._reached.clear()
        self.engines[role].backward(loss)
        others = sorted(self._reached - {role})
        if others:
            raise RuntimeError(
                f"the {role!r} loss back-propagates into the parameters of role(s) {others}; under "
                "deepspeed compute their part without gradient (torch.no_grad() or .detach())"
            )

    def clip_and_step(self, role: str, params: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
        """``engine.step()`` (clipping to the engine's ``gradient_clipping``); the pre-clip global norm."""
        engine = self.engines[role]
        engine.step()
        if role not in self.stepped:
            self.stepped.append(role)
        return torch.as_tensor(float(engine.get_global_grad_norm()), dtype=torch.float32)

    def step(self, role: str) -> None:
        raise RuntimeError("under deepspeed a role steps through its engine (clip_and_step)")

    def zero_grad(self) -> None:
        for engine in self.engines.values():
            engine.zero_grad()

    def state_dict(self) -> dict:
        """The ``CompositeOptimizer`` layout, with every stepped role's full AdamW moments gathered
        (a collective: every rank calls it)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        if len(self.children) != 1:
            raise RuntimeError(f"deepspeed expects one AdamW child, found {len(self.children)}")
        skeleton = self.children[0].state_dict()
        ids = {id(p): i for i, p in enumerate(p for g in self.children[0].param_groups for p in g["params"])}
        state: dict[int, dict[str, torch.Tensor]] = {}
        for role in self.stepped:  # a role that has not stepped has no state, as in torch.optim.AdamW
            step = _partition_step(self.engines[role])
            if step is None:
                raise RuntimeError(f"deepspeed: role {role!r} stepped but its engine holds no AdamW state")
            for p in self._role_params(role):
                state[ids[id(p)]] = {
                    "step": step.clone(),
                    "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                    "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone(),
                }
        return {"composite": [{"state": state, "param_groups": skeleton["param_groups"]}]}

    def load_state_dict(self, state: Mapping) -> None:
        """Scatter a ``state_dict()`` result (full moments) into the engines' partitions, and copy the
        fp32 master partitions from the variants' weights, which ``BaseTrainer.resume`` loads first."""
        from deepspeed.utils import safe_set_full_optimizer_state

        layout = self.children[0]
        super().load_state_dict(state)  # checks the child count and every group's size, names mismatches
        loaded = dict(layout.state)
        layout.state.clear()  # the layout never holds moments
        owner = {id(p): role for role in self.engines for p in self._role_params(role)}
        self.stepped = list(dict.fromkeys(owner[id(p)] for p in loaded))
        for role, engine in self.engines.items():
            params = self._role_params(role)
            with_state = [p for p in params if p in loaded]
            if with_state and len(with_state) != len(params):
                raise ValueError(f"optimizer state covers {len(with_state)} of role {role!r}'s {len(params)}")
            zero = engine.optimizer
            if with_state:
                _init_partition_state(engine, loaded[params[0]]["step"])
                for p in params:
                    for key in ("exp_avg", "exp_avg_sq"):
                        safe_set_full_optimizer_state(p, loaded[p][key], key)
            zero._restore_from_bit16_weights()


def _partition_step(engine: Any) -> torch.Tensor | None:
    """The AdamW ``step`` of an engine's flat partitions (one value for the role), or ``None``."""
    inner = engine.optimizer.optimizer
    steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
    if not steps:
        return None
    if len(steps) != 1:
        raise RuntimeError(f"the partitions of one role are at different steps: {sorted(steps)}")
    return next(s["step"] for s in inner.state.values())


def _init_partition_state(engine: Any, step: torch.Tensor) -> None:
    """Zero AdamW state on an engine's flat partitions at ``step``, linked to the parameters' fragments
    (DeepSpeed links them lazily, at the first step) so that ``safe_set_full_optimizer_state`` can fill
    it. Relies on ``DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state`` (deepspeed 0.19.8)."""
    zero = engine.optimizer
    inner = zero.optimizer
    for group in inner.param_groups:
        for flat in group["params"]:
            inner.state[flat] = {
                "step": step.detach().clone().to(torch.float32),
                "exp_avg": torch.zeros_like(flat),
                "exp_avg_sq": torch.zeros_like(flat),
            }
    zero._hp_optimizer_states_linked = False
    zero._lazy_init_hp_params_optimizer_state()


class DeepSpeedBackend(ProcessGroupBackend):
    """ZeRO-1/2, one ``DeepSpeedEngine`` per trainable variant (module docstring)."""

    kind = "deepspeed"

    def __init__(self, backend: BackendConfig, max_grad_norm: float):
        super().__init__(backend.activation_checkpointing)
        world = require_launch("deepspeed")
        require_deepspeed()
        if os.environ.get("FFDEBUG_FWD_DUMP_GRAD_SAMPLE", "0").strip() not in ("", "0"):
            # ZeRO keeps gradients in partitioned buffers (p.grad is None): samples would read zeros
            # on both sides and compare ok; refused rather than passing silently
            raise ConfigError(
                "FFDEBUG_FWD_DUMP_GRAD_SAMPLE",
                "sampled gradient taps are not supported under deepspeed; unset it or use ddp / fsdp2",
            )
        if backend.zero_stage not in (1, 2):  # check_plan refuses 3 first; a direct caller is checked here
            raise ConfigError("backend.zero_stage", f"must be 1 or 2, got {backend.zero_stage}")
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        if dist.get_world_size() != world:
            raise ConfigError(
                "backend.kind",
                f"deepspeed: the process group has {dist.get_world_size()} ranks for WORLD_SIZE={world}",
            )
        self.rank, self.world_size = dist.get_rank(), world
        self.zero_stage, self.max_grad_norm = backend.zero_stage, max_grad_norm
        self.optimizer: ZeroOptimizer | None = None

    def prepare(
        self, modules: Mapping[str, nn.Module], optimizer: CompositeOptimizer
    ) -> dict[str, nn.Module]:
        """One engine per variant over a fresh AdamW of its role's groups; ``stepping_optimizer`` then
        returns the ``ZeroOptimizer`` over them."""
        import deepspeed

        super().prepare(modules, optimizer)
        if [type(child) for child in optimizer.children] != [torch.optim.AdamW]:
            raise ConfigError(
                "optimizers", "deepspeed steps AdamW only (check_plan refuses muon before anything loads)"
            )
        config = engine_config(self.zero_stage, self.max_grad_norm)
        engines: dict[str, Any] = {}
        prepared: dict[str, nn.Module] = {}
        for name, module in modules.items():
            owned = {id(p) for p in module.parameters()}
            groups = [g for g in optimizer.param_groups if all(id(p) in owned for p in g["params"])]
            roles = {g["role"] for g in groups}
            if len(roles) != 1:
                raise RuntimeError(
                    f"deepspeed: variant {name!r} is optimised by roles {sorted(roles)}, not one"
                )
            client = torch.optim.AdamW([{**g, "params": list(g["params"])} for g in groups])
            engine, *_ = deepspeed.initialize(
                model=module, optimizer=client, config=config, dist_init_required=False
            )
            engines[roles.pop()] = engine
            prepared[name] = EngineModule(engine)
        self.optimizer = ZeroOptimizer(optimizer, engines)
        return prepared

    def stepping_optimizer(self, optimizer: CompositeOptimizer) -> CompositeOptimizer:
        if self.optimizer is None:
            raise RuntimeError("deepspeed: stepping_optimizer before prepare")
        return self.optimizer
