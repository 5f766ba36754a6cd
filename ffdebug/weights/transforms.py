"""Layout transforms for engines that store weights in another layout.

`--transform [ref:|target:]GLOB=FUNC` applies FUNC to every tensor of that side (default target)
whose reference-side name matches GLOB, after shard merging and dequantisation and before the
comparison. FUNC is `transpose` (swap the last two dims) or a Python entry `module:function`
called as `function(tensor)` or `function(tensor, name)`; it returns the tensor in the other side's
layout. Example: ATOM's fp8 shuffle applied to the reference,
`--transform 'ref:*.experts.*=mylib.layout:shuffle_16x16'`.

The diff holds numpy arrays (`ffdebug.arrays`); `transpose` works on them. A user FUNC is code
written against the engine's layout, which is torch code (ATOM's shuffles, a converter's
permutations), so it keeps receiving a torch tensor: the array is handed over as one with
`arrays.to_torch` (the same memory; bfloat16 / float8 through their raw bits) and what it returns,
a torch tensor or a numpy array, is taken back with `arrays.as_array`. torch is imported only
then, by a diff that names such a FUNC.
"""

from __future__ import annotations

import fnmatch
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

from ffdebug.errors import FFDebugError


def transpose(tensor, name: str = ""):
    """The last two dims swapped (a contiguous copy)."""
    import numpy as np

    if tensor.ndim < 2:
        raise FFDebugError(f"{name}: transpose needs at least 2 dims, got shape {list(tensor.shape)}")
    return np.ascontiguousarray(np.swapaxes(tensor, -2, -1))


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
        """`fn` applied to a numpy array; a user entry is given a torch tensor (module docstring)."""
        builtin = self.fn in BUILTINS.values()
        arg = tensor if builtin else _to_torch(tensor)
        try:
            out = self.fn(arg, name) if _takes_two(self.fn) else self.fn(arg)
        except FFDebugError:
            raise
        except Exception as err:
            raise FFDebugError(
                f"--transform {self.spec!r} failed on {name}: {type(err).__name__}: {str(err)[:120]}"
            ) from err
        return out if builtin else _from_user(out, self.spec, name)


def _to_torch(a):
    from ffdebug.arrays import to_torch

    return to_torch(a)


def _from_user(out, spec: str, name: str):
    """A user transform's result as a numpy array: a torch tensor or a numpy array, else an error."""
    import numpy as np
    import torch  # imported already: the transform was handed a torch tensor

    from ffdebug.arrays import as_array

    if not isinstance(out, (torch.Tensor, np.ndarray)):
        raise FFDebugError(f"--transform {spec!r}: returned {type(out).__name__} for {name}; return a tensor")
    return as_array(out)


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
