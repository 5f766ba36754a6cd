"""A trainer's trainable roles: their one optimizer root, its taps, and their placement on the backend.

``RoleSetup`` is the part of ``BaseTrainer`` that turns the ``{role: variant}`` of ``setup_roles()``
into the ``RoleOptimizer`` (ownership checked: variants vs snapshots, disjoint and exhaustive), records
the parameter and optimizer layout in the run identity (``_schema``), and prepares the variants on the
backend (``prepare_backend``; under FSDP2 the roles and optimizer are rebuilt on the sharded parameters).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch

from reference_trainer.optim import RoleOptimizer, build_optimizer
from reference_trainer.roles import check_ownership, role_parameter_names, role_parameters
from reference_trainer.sharding import check_sharded_optimizer
from reference_trainer.taps import UpdateTaps

if TYPE_CHECKING:  # types only
    from reference_trainer.adapters.base import BaseAdapter
    from reference_trainer.config import RunConfig
    from reference_trainer.distributed import Backend
    from reference_trainer.roles import ComponentVariantRegistry


class RoleSetup:
    """The roles and optimizer side of ``BaseTrainer`` (module docstring)."""

    roles: ClassVar[tuple[str, ...]]
    config: RunConfig
    args: Any
    adapter: BaseAdapter
    backend: Backend
    variants: ComponentVariantRegistry
    role_variants: dict[str, str]
    optim: RoleOptimizer
    optimizer_step: int

    def _build_optimizer(self) -> RoleOptimizer:
        """The one optimizer root over the declared roles, once their ownership is checked."""
        if set(self.role_variants) != set(self.roles):
            raise RuntimeError(
                f"{type(self).__name__}.setup_roles() returned roles {list(self.role_variants)}, declared {list(self.roles)}"
            )
        role_params = role_parameters(self.variants, self.role_variants)
        check_ownership(role_params, self._all_modules())
        optimizer = build_optimizer(
            role_params, {role: self.config.optimizer_for(role) for role in self.roles}
        )
        return RoleOptimizer(
            optimizer,
            role_params,
            max_grad_norm=self.args.max_grad_norm,
            next_step=lambda: self.optimizer_step + 1,
            on_step=self._record_step,
            update_taps=UpdateTaps(self._watched_weights),
            param_names=role_parameter_names(self.variants, self.role_variants),
        )

    def _watched_weights(self, role: str) -> dict[str, list[torch.Tensor]]:
        """The weights whose update a step of ``role`` taps: its parameters and every snapshot's
        (``update.<name>``, ``reference_trainer.taps``)."""
        watched = {role: list(self.optim.roles[role])}
        watched.update({name: list(snap.values()) for name, snap in self.variants.snapshots.items()})
        return watched

    def prepare_backend(self) -> None:
        """Prepare every trainable variant with the one optimizer root (``Backend.prepare``) and route
        forwards to the prepared modules: ``variants.variant(name)`` and the adapter's
        ``get_component(trainable_component)`` return them from now on (the base variant is the
        adapter's component). Called once, by ``run.build_trainer``, before any resume."""
        prepared = self.backend.prepare(self.variants.variants, self.optim.optimizer)
        self.optim.optimizer = self.backend.stepping_optimizer(self.optim.optimizer)
        self.variants.route(prepared)
        base = next(iter(self.variants.variants))
        self.adapter.route_component(self.adapter.trainable_component, prepared[base])
        if self.backend.replaces_parameters:  # FSDP2: roles and optimizer from the sharded parameters
            self.optim = self._build_optimizer()
            check_sharded_optimizer(self.optim.optimizer, self.variants.variants.values())

    def _all_modules(self) -> list[torch.nn.Module]:
        components = [self.adapter.get_component(name) for name in self.adapter.component_names()]
        modules = [c for c in components if isinstance(c, torch.nn.Module)]
        return modules + list(self.variants.variants.values())

    def _schema(self) -> dict[str, Any]:
        """Parameter and optimizer layout (part of the run identity)."""
        return {
            "variants": {
                name: [[key, list(p.shape)] for key, p in module.named_parameters()]
                for name, module in self.variants.variants.items()
            },
            "snapshots": sorted(self.variants.snapshots),
            "roles": self.role_variants,
            "optimizer": self.optim.optimizer.describe(),
        }
