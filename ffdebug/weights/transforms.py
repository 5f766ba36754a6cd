"""Layout transforms for engines that store weights in another layout.

`--transform [ref:|target:]GLOB=FUNC` applies FUNC to every tensor of that side (default target)
whose reference-side name matches GLOB, after shard merging and dequantisation and before the
comparison. FUNC is `transpose` (swap the last two dims) or a Python entry `module:function`
called as `function(tensor)` or `function(tensor, name)`; it returns the tensor in the other side's
layout. Example: ATOM's fp8 shuffle applied to the reference,
`--transform 'ref:*.experts.*=mylib.layout:shuffle_16x16'`.
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

from ffdebug.errors import FFDebugError


def transpose(tensor, name: str = ""):
    if tensor.dim() < 2:
        raise FFDebugError(f"{name}: transpose needs at least 2 dims, got shape {list(tensor.shape)}")
    return tensor.transpose(-2, -1).contiguous()


BUILTINS: dict[str, Callable] = {"transpose": transpose, "T": transpose}


@dataclass(frozen=True)
class Transform:
    side: str  # "ref" | "target"
    glob: str
    fn: Callable
    spec: str

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.glob)

    def __call__(self, tensor, name: str):
        try:
            out = self.fn(tensor, name) if _takes_two(self.fn) else self.fn(tensor)
        except FFDebugError:
            raise
        except Exception as err:
            raise FFDebugError(
                f"--transform {self.spec!r} failed on {name}: {type(err).__name__}: {str(err)[:120]}"
            ) from err
        import torch

        if not isinstance(out, torch.Tensor):
            raise FFDebugError(
                f"--transform {self.spec!r}: returned {type(out).__name__} for {name}; return a tensor"
            )
        return out


def _takes_two(fn) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def parse_transform(spec) -> Transform:
    if isinstance(spec, Transform):
        return spec
    m = re.fullmatch(r"\s*(?:(ref|target):)?([^=]+)=(.+?)\s*", spec)
    if not m:
        raise FFDebugError(
            f"--transform {spec!r} is invalid: use [ref:|target:]GLOB=transpose or GLOB=module:function"
        )
    side, glob, func = m.group(1) or "target", m.group(2).strip(), m.group(3).strip()
    if func in BUILTINS:
        fn = BUILTINS[func]
    else:
        from ffdebug._entry import resolve_entry

        fn = resolve_entry(func)
    return Transform(side, glob, fn, spec)


def apply_transforms(transforms, side: str, name: str, tensor):
    for tr in transforms:
        if tr.side == side and tr.matches(name):
            tensor = tr(tensor, name)
    return tensor
