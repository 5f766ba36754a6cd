"""A noise run that differs from the reference in its last bits on every machine (not a test module).

A second thread count is the usual recipe for a noise run, but whether it changes any bit is a property
of the CPU and its kernels: where a GEMM does not split its reduction over threads (seen on an AMD EPYC
with MKL at one and two threads), the "noise" run is bit-identical to the reference and gives no scale.
``split_reduction`` builds the difference itself, with the change a thread count makes where it does
make one: every ``nn.Linear`` sums its input features in ``parts`` slices, each a GEMM of its own, and
adds the partial products. The values are the same maths in another summation order (a few float32
ulp apart), never another function.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


def _split_linear(module: nn.Linear, parts: int):
    k = module.in_features
    bounds = [k * i // parts for i in range(parts + 1)]

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x[..., bounds[0] : bounds[1]], module.weight[:, bounds[0] : bounds[1]])
        for lo, hi in zip(bounds[1:-1], bounds[2:]):
            out = out + F.linear(x[..., lo:hi], module.weight[:, lo:hi])
        return out if module.bias is None else out + module.bias

    return forward


@contextmanager
def split_reduction(model: nn.Module, parts: int = 2) -> Iterator[nn.Module]:
    """Inside the block, every ``nn.Linear`` of ``model`` with at least ``parts`` input features computes
    ``x @ W.T`` as the sum of ``parts`` partial GEMMs over slices of the input features. Module hooks (a
    capture's) still run: only the instance's ``forward`` is replaced, and restored on exit."""
    if parts < 2:
        raise ValueError(f"parts={parts}: a split reduction needs at least 2 parts")
    patched = [m for m in model.modules() if isinstance(m, nn.Linear) and m.in_features >= parts]
    if not patched:
        raise ValueError(f"{type(model).__name__} has no nn.Linear to split")
    for module in patched:
        module.forward = _split_linear(module, parts)
    try:
        yield model
    finally:
        for module in patched:
            del module.forward  # the class's forward again
