"""Monkey-patch context managers for instrumenting read-only reference code.

Every patch is restored on exit, also after an exception. The wrappers dump through the active
session (`ffdebug.capture(...)` or the environment); with no session they only call through.
"""

from __future__ import annotations

import contextlib
import functools

from ffdebug.capture import state


@contextlib.contextmanager
def patch_method(cls, name: str, wrapper):
    """Replace `cls.name` by `wrapper(original, self, *args, **kwargs)` inside the block."""
    original = cls.__dict__.get(name)
    if original is None:
        original = getattr(cls, name)  # inherited: restore by deleting our override
        inherited = True
    else:
        inherited = False
    bound_original = getattr(cls, name)

    @functools.wraps(bound_original)
    def patched(self, *args, **kwargs):
        return wrapper(bound_original.__get__(self, cls), self, *args, **kwargs)

    setattr(cls, name, patched)
    try:
        yield
    finally:
        if inherited:
            delattr(cls, name)
        else:
            setattr(cls, name, original)


def _layer_of(module, layer_attr: str | tuple[str, ...], counter: dict) -> int:
    """The block's index attribute, else its order of first execution."""
    from ffdebug.models.blocks import index_attribute

    index = index_attribute(module, (layer_attr,) if isinstance(layer_attr, str) else tuple(layer_attr))
    return index if index is not None else counter.setdefault(id(module), len(counter))


@contextlib.contextmanager
def patch_block_forward(block_cls, layer_attr="layer_id", side: str | None = None):
    """Dump `L{NNN}.hidden_in` / `.hidden_out` around every `block_cls.forward` call.

    `side` is checked against the active session's side (a guard against dumping the reference
    into the target's directory); leave it None to accept any.
    """
    import torch

    from ffdebug.capture.outputs import first_tensor, tensors_of

    order: dict = {}

    def wrapper(original, self, *args, **kwargs):
        s = state.active_session()
        if s is None:
            return original(*args, **kwargs)
        if side is not None and s.config.side != side:
            raise RuntimeError(
                f"patch_block_forward(side={side!r}) but the active dump side is {s.config.side!r}; "
                "set FFDEBUG_FWD_DUMP_SIDE or pass side= to ffdebug.capture"
            )
        layer = _layer_of(self, layer_attr, order)
        prefix = f"L{layer:03d}"
        meta = {"layer": layer, "module_class": type(self).__name__}
        h = first_tensor(args, kwargs)
        if isinstance(h, torch.Tensor):
            s.capture(f"{prefix}.hidden_in", h, io="in", **meta)
        state.push_layer(layer)
        try:
            out = original(*args, **kwargs)
        finally:
            state.pop_layer()
        for i, (suffix, t) in enumerate(tensors_of(out)):
            s.capture(f"{prefix}.hidden_out" if i == 0 else f"{prefix}.hidden_out{suffix}", t, **meta)
        return out

    with patch_method(block_cls, "forward", wrapper):
        yield


@contextlib.contextmanager
def patch_module_dump(cls, stage: str, io: str = "out"):
    """Dump the output (or first input, `io="in"`) of every `cls` instance as `stage`.

    Inside a block known to ffdebug the key is `L{NNN}.{stage}`, else `stage`.
    """
    from ffdebug.capture.outputs import first_tensor, tensors_of

    def wrapper(original, self, *args, **kwargs):
        s = state.active_session()
        layer = state.current_layer()
        key = f"L{layer:03d}.{stage}" if layer is not None else stage
        meta = {"layer": layer, "module_class": type(self).__name__}
        if s is not None and io == "in":
            h = first_tensor(args, kwargs)
            if h is not None:
                s.capture(key, h, io="in", **meta)
        out = original(*args, **kwargs)
        if s is not None and io == "out":
            for i, (suffix, t) in enumerate(tensors_of(out)):
                s.capture(key if i == 0 else f"{key}{suffix}", t, **meta)
        return out

    with patch_method(cls, "forward", wrapper):
        yield
