"""The tensors inside a module's inputs and outputs (tuples, lists, dicts, model-output objects),
with the key suffix each one is dumped under; shared by every capture hook."""

from __future__ import annotations


def tensors_of(obj, prefix: str = ""):
    """(suffix, tensor) pairs of a module output: tensor, tuple/list, dict or ModelOutput."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            if isinstance(v, torch.Tensor):
                yield f"{prefix}.{i}", v
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, torch.Tensor):
                yield f"{prefix}.{k}", v


def first_tensor(args, kwargs, names=("hidden_states", "x", "input", "sample")):
    import torch

    for n in names:
        v = kwargs.get(n)
        if isinstance(v, torch.Tensor):
            return v
    for v in args:
        if isinstance(v, torch.Tensor):
            return v
    return None
