"""Full tensors from sharded ones and back: the one place that knows about FSDP2's ``DTensor`` parameters.

Under ``backend.kind: fsdp2`` (``reference_trainer.fsdp``) every trainable parameter, its gradient and
its AdamW moments are ``DTensor``\\ s sharded along dim 0 over the ranks. Everything that leaves the
process (checkpoints, the model export, snapshots used functionally) holds *full* tensors, so that a
checkpoint has one layout whatever the backend. The helpers below are the identity on plain tensors,
so the callers (roles, optimizer, checkpoints) need no backend branch:

* ``full_tensor`` / ``full_tensors`` / ``full_state``: gather (a collective: every rank calls it, in the
  same order);
* ``copy_into``: copy a full tensor into a parameter or state tensor, sharding it like the target
  (each rank keeps its own slice; no communication);
* ``ShardedModule``: the routing wrapper of a variant sharded in place by ``fully_shard``, which also
  carries the unsharded *template* that functional calls with snapshot parameters run on (FSDP2's
  pre-forward hook would otherwise swap the live, all-gathered parameters back in).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn


def is_dtensor(tensor: Any) -> bool:
    """``tensor`` is a ``DTensor``. Read without importing ``torch.distributed.tensor`` (about a second:
    it pulls in sympy): no ``DTensor`` exists before that package is imported (``fsdp2`` imports it), so
    a run on another backend never pays for it."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full (unsharded) value of ``tensor``: all-gathered for a ``DTensor``, else ``tensor`` itself."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor


def full_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``full_tensor`` of every value, in the mapping's order (the same on every rank)."""
    return {key: full_tensor(value) for key, value in tensors.items()}


def full_state(value: Any) -> Any:
    """A nested state (an optimizer ``state_dict``) with every ``DTensor`` replaced by its full value."""
    if isinstance(value, torch.Tensor):
        return full_tensor(value)
    if isinstance(value, Mapping):
        return {key: full_state(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(full_state(item) for item in value)
    return value


def like(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (a full tensor) sharded like ``target`` when ``target`` is a ``DTensor``; each rank
    slices its own part locally (``src_data_rank=None``: every rank holds the same full value)."""
    if is_dtensor(target) and not is_dtensor(value):
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"a tensor of shape {tuple(value.shape)} for one of shape {tuple(target.shape)}")
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(
            value.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None
        )
    return value


@torch.no_grad()
def copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target.copy_(value)`` in place, with the shapes checked (no broadcasting) and a full ``value``
    sharded like a ``DTensor`` target."""
    if tuple(value.shape) != tuple(target.shape):
        raise ValueError(f"a tensor of shape {tuple(value.shape)} for one of shape {tuple(target.shape)}")
    target.detach().copy_(like(target, value))


def check_sharded_optimizer(optimizer: Any, modules: Iterable[nn.Module]) -> None:
    """After FSDP2's prepare: every optimizer parameter is a ``DTensor``, and the optimizer holds exactly
    the trainable parameters of ``modules`` (the same objects; no pre-shard ``Parameter`` left)."""
    held = [p for group in optimizer.param_groups for p in group["params"]]
    plain = [tuple(p.shape) for p in held if not is_dtensor(p)]
    if plain:
        raise RuntimeError(f"fsdp2: {len(plain)} optimizer parameters are not sharded, first {plain[0]}")
    trainable = {id(p) for module in modules for p in module.parameters() if p.requires_grad}
    if {id(p) for p in held} != trainable or len(held) != len(trainable):
        raise RuntimeError(
            f"fsdp2: the optimizer holds {len(held)} parameters, the prepared variants have "
            f"{len(trainable)} trainable ones (not the same objects)"
        )


class ShardedModule(nn.Module):
    """Routes forwards to ``module``, a variant sharded in place by ``fully_shard``.

    ``template`` is an unsharded copy of the module's structure and buffers whose parameters live on the
    ``meta`` device: a functional call with a snapshot (``adapters.base.call_module``) runs on it, with
    every parameter taken from the snapshot (one left out fails loudly on a meta tensor). It is held
    outside the module tree, so it is never counted, saved or prepared.
    """

    def __init__(self, module: nn.Module, template: nn.Module):
        super().__init__()
        self.module = module
        self._template = (template,)

    @property
    def template(self) -> nn.Module:
        """The unsharded, parameter-less template of ``module`` (see the class docstring)."""
        return self._template[0]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The sharded module's forward (FSDP2's hooks gather its parameters around the call)."""
        return self.module(*args, **kwargs)


def meta_template(module: nn.Module) -> nn.Module:
    """An unsharded copy of ``module`` whose parameters are on the ``meta`` device (buffers kept)."""
    import copy

    template = copy.deepcopy(module)
    for submodule in template.modules():
        for name, parameter in list(submodule.named_parameters(recurse=False)):
            setattr(submodule, name, nn.Parameter(parameter.to("meta"), requires_grad=False))
    return template
