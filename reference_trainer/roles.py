"""Roles: live trainable variants vs. temporal parameter snapshots, and who owns which parameter.

Vocabulary (Flow-Factory Draft ``models/variants.py``, ``topics/component_variants.md``):

* a **variant** is a *live, trainable* copy of a component (spatial): GRPO has one (``policy``, the
  adapter's own transformer — the base variant, first declared); DMD2 has two (``generator`` and
  ``fake``, full copies). Each trainable role optimises exactly one variant.
* a **snapshot** is a *frozen, temporal* copy of a variant's parameters (``reference``, ``ema``,
  ``old``): a plain dict of detached tensors, never a module and never a variant, used through
  ``torch.func.functional_call`` (``adapter.forward(..., parameters=snapshot)``) so the live weights
  are never swapped in place (no autograd version-counter hazards, no restore bugs).

``check_ownership`` enforces that role parameter ownership is *disjoint* (no parameter in two roles)
and *exhaustive* (every ``requires_grad`` parameter of every variant belongs to a role, and nothing
else requires grad).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from reference_trainer.sharding import copy_into, full_tensor


class RoleError(ValueError):
    """Invalid variant / snapshot / role declaration."""


class ComponentVariantRegistry:
    """Live trainable variants of one component, plus named snapshots of their parameters."""

    def __init__(self, base: nn.Module, component: str = "transformer"):
        self.component = component
        self._base = base
        self._variants: dict[str, nn.Module] = {}
        self._routes: dict[str, nn.Module] = {}
        self._snapshots: dict[str, dict[str, torch.Tensor]] = {}

    # ---------------------------------------------------------------- variants
    def declare_variant(self, name: str) -> nn.Module:
        """Declare a live variant. The first declared *is* the base module; later ones are deep copies
        of the base's current (initial) weights."""
        if name in self._variants or name in self._snapshots:
            raise RoleError(f"variant name {name!r} is already used")
        module = self._base if not self._variants else copy.deepcopy(self._base)
        module.requires_grad_(True)
        self._variants[name] = module
        return module

    def variant(self, name: str) -> nn.Module:
        """The module that runs variant ``name``'s forwards: the prepared one (``route``) once the
        backend prepared it, else the live module itself."""
        if name not in self._variants:
            raise RoleError(f"unknown variant {name!r}; declared: {list(self._variants)}")
        return self._routes.get(name, self._variants[name])

    def route(self, prepared: Mapping[str, nn.Module]) -> None:
        """After the backend's prepare: forwards of each variant go to its prepared module (a DDP
        wrapper of the same parameters); state, snapshots and exports keep reading the live module."""
        unknown = sorted(set(prepared) - set(self._variants))
        if unknown:
            raise RoleError(f"prepared modules for undeclared variants {unknown}")
        self._routes.update(prepared)

    @property
    def variants(self) -> dict[str, nn.Module]:
        """Declared variants (the live, unwrapped modules) in declaration order (the first is the base)."""
        return dict(self._variants)

    # ---------------------------------------------------------------- snapshots
    def add_snapshot(self, name: str, source: str) -> dict[str, torch.Tensor]:
        """Freeze a copy of variant ``source``'s parameters as snapshot ``name``."""
        if name in self._snapshots or name in self._variants:
            raise RoleError(f"snapshot name {name!r} is already used")
        self.variant(source)  # an unknown name is a RoleError
        module = self._variants[source]
        # full tensors also under FSDP2 (a collective then): snapshots are never sharded
        self._snapshots[name] = {key: full_tensor(p.detach()).clone() for key, p in module.named_parameters()}
        return self._snapshots[name]

    def snapshot(self, name: str) -> Mapping[str, torch.Tensor]:
        """The parameters of snapshot ``name`` (read-only by convention; detached)."""
        if name not in self._snapshots:
            raise RoleError(f"unknown snapshot {name!r}; declared: {list(self._snapshots)}")
        return self._snapshots[name]

    @torch.no_grad()
    def update_snapshot(self, name: str, source: str, decay: float) -> None:
        """EMA update: s ← decay·s + (1 − decay)·θ_source (``decay = 0`` copies)."""
        snapshot = self.snapshot(name)
        self.variant(source)  # an unknown name is a RoleError
        for key, p in self._variants[source].named_parameters():
            snapshot[key].mul_(decay).add_(full_tensor(p.detach()), alpha=1.0 - decay)  # type: ignore[index]

    @property
    def snapshots(self) -> dict[str, dict[str, torch.Tensor]]:
        """All snapshots (name -> parameter dict)."""
        return dict(self._snapshots)

    # ---------------------------------------------------------------- checkpoint state
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Flat ``{"variant.<name>.<param>": t, "snapshot.<name>.<param>": t}`` for checkpoints (under
        FSDP2 a variant's parameters are this rank's ``DTensor`` shards: ``sharding.full_tensors``)."""
        tensors = {}
        for name, module in self._variants.items():
            for key, value in module.state_dict().items():
                tensors[f"variant.{name}.{key}"] = value.detach()
        for name, params in self._snapshots.items():
            for key, value in params.items():
                tensors[f"snapshot.{name}.{key}"] = value
        return tensors

    @torch.no_grad()
    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Restore variants and snapshots in place from ``state_tensors`` output (exact copy); full
        tensors are sharded like a ``DTensor`` parameter (``sharding.copy_into``)."""
        expected = set(self.state_tensors())
        if set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
            raise RoleError(f"variant state mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
        for name, module in self._variants.items():
            for key, target in module.state_dict(keep_vars=True).items():
                copy_into(target, tensors[f"variant.{name}.{key}"])
        for name, params in self._snapshots.items():
            for key, value in params.items():
                value.copy_(tensors[f"snapshot.{name}.{key}"])


def role_parameters(
    registry: ComponentVariantRegistry, role_variants: Mapping[str, str]
) -> dict[str, list[nn.Parameter]]:
    """``{role: trainable parameters of its variant}`` for ``role_variants`` = ``{role: variant}``."""
    return {
        role: [p for p in registry.variants[variant].parameters() if p.requires_grad]
        for role, variant in role_variants.items()
    }


def role_parameter_names(
    registry: ComponentVariantRegistry, role_variants: Mapping[str, str]
) -> dict[str, list[str]]:
    """``{role: names of the parameters role_parameters lists}``, in the same order (the names
    ``ffdebug.tap_grads`` groups and seeds its gradient samples by)."""
    return {
        role: [name for name, p in registry.variants[variant].named_parameters() if p.requires_grad]
        for role, variant in role_variants.items()
    }


def check_ownership(roles: Mapping[str, list[nn.Parameter]], modules: Iterable[nn.Module]) -> None:
    """Raise ``RoleError`` unless role ownership is disjoint and exhaustive over ``modules``.

    ``modules``: every module of the run (variants and frozen components). Exhaustive: each parameter
    with ``requires_grad`` belongs to a role, and each role parameter requires grad.
    """
    owner: dict[int, str] = {}
    for role, params in roles.items():
        if not params:
            raise RoleError(f"role {role!r} owns no parameters")
        for p in params:
            if id(p) in owner:
                raise RoleError(
                    f"a parameter {tuple(p.shape)} is owned by both {owner[id(p)]!r} and {role!r}"
                )
            if not p.requires_grad:
                raise RoleError(f"role {role!r} owns a parameter {tuple(p.shape)} that does not require grad")
            owner[id(p)] = role
    seen: set[int] = set()
    for module in modules:
        for name, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad and id(p) not in owner:
                raise RoleError(f"trainable parameter {name} of {type(module).__name__} belongs to no role")
