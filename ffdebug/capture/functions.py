"""Tap the outputs of a module-level function with one line (docs/dumping.md "Stage names by role").

`ffdebug.tap_function("pkg.mod:fn", stages=("attn.q_rot", "attn.k_rot"))` replaces `fn` in its
module and in every loaded module that imported it by name, so each call taps its tensor outputs
in order under the given stage names (inside a block they get its `L{NNN}.` prefix, like any
tap). The environment form is `FFDEBUG_FWD_DUMP_TAP_FUNCTIONS='pkg.mod:fn=stage,stage;...'`,
applied by `ffdebug.install`. Functions are named exactly; none is matched by words in its name.

Known without a line: the rotary functions of a transformers model's modelling module (functions
of a query, a key and a rotary table, found by their signatures: `rotary_functions`) are tapped as
`attn.q_rot` / `attn.k_rot` for its blocks (`known_function_taps`). These are the fallback of the
q / k the attention kernel reads (`capture.kernel_taps`): inside a block child, a function tap of
a rotary stage is written only when no kernel call is seen there.
"""

from __future__ import annotations

import functools
import importlib
import sys
from dataclasses import dataclass, field

from ffdebug.capture import kernel_taps
from ffdebug.capture.kernel_taps import ROTARY_STAGES
from ffdebug.errors import FFDebugError


@dataclass
class FunctionTap:
    """An installed function tap; `remove()` puts back what each binding held before, where the
    binding still holds this tap (a later tap of the same function stays until it is removed)."""

    spec: str
    original: object
    wrapper: object = None
    replaced: list = field(default_factory=list)  # (module, attribute name, previous value)

    def remove(self) -> None:
        for module, name, previous in self.replaced:
            if getattr(module, name, None) is self.wrapper:
                setattr(module, name, previous)
        # modules that imported the function by name while it was tapped
        for module in list(sys.modules.values()):
            for attr in _bindings(module, self.wrapper):
                setattr(module, attr, self.original)
        self.replaced.clear()

    def __enter__(self) -> FunctionTap:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _resolve(spec: str):
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise FFDebugError(f"tap_function {spec!r}: use 'pkg.module:function'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as err:
        raise FFDebugError(f"tap_function {spec!r}: cannot import {mod_name} ({err})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise FFDebugError(f"tap_function {spec!r}: {mod_name} has no function {fn_name}")
    return module, fn_name, fn


def tap_function(spec: str, stages: tuple[str, ...] | list[str]) -> FunctionTap:
    """Tap `spec`'s tensor outputs, in order, as `stages` (see the module doc)."""
    if isinstance(stages, str) or not stages:
        raise FFDebugError(
            f"tap_function {spec!r}: give the stage names as a tuple, e.g. ('attn.q_rot', 'attn.k_rot')"
        )
    module, name, current = _resolve(spec)
    original = current
    while getattr(original, "__ffdebug_tap__", False):  # tapping a tapped function taps the original
        original = original.__wrapped__
    stages = tuple(stages)

    @functools.wraps(original)
    def tapped(*args, **kwargs):
        import ffdebug
        from ffdebug.capture.outputs import tensors_of

        out = original(*args, **kwargs)
        watcher = kernel_taps.active()  # inside a watched branch the kernel's q / k come first
        for stage, (_, tensor) in zip(stages, tensors_of(out)):
            if watcher is None or not watcher.defer(stage, tensor, spec):
                ffdebug.tap(stage, tensor)
        return out

    tapped.__ffdebug_tap__ = True
    handle = FunctionTap(spec, original, tapped)
    for mod in list(sys.modules.values()):  # every binding, under any name, of what is there now
        for attr in _bindings(mod, current):
            handle.replaced.append((mod, attr, current))
            setattr(mod, attr, tapped)
    if not handle.replaced:
        handle.replaced.append((module, name, current))
        setattr(module, name, tapped)
    return handle


def _bindings(module, fn) -> list[str]:
    """Module-level names bound to `fn` in `module`."""
    try:
        namespace = vars(module)
    except TypeError:
        return []
    return [attr for attr, value in list(namespace.items()) if value is fn]


def rotary_functions(module) -> list[str]:
    """Names of the module-level functions `module` defines that rotate a (query, key) pair: the
    first two parameters are a query and a key, and a rotary table follows (`cos` and `sin`, or
    `freqs…`). Read from the signatures, not from a list of names: transformers has
    `apply_rotary_pos_emb`, `…_interleave`, `…_vision`, `…_2d`, `apply_rotary_emb(xq, xk,
    freqs_cis)`, …"""
    import inspect

    out = []
    for name, fn in list(vars(module).items()):
        if not inspect.isfunction(fn) or fn.__module__ != module.__name__:
            continue
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            continue
        table = {"cos", "sin"} <= set(params) or any(p.startswith("freqs") for p in params[2:])
        if len(params) >= 3 and params[0] in _QUERY and params[1] in _KEY and table:
            out.append(name)
    return out


_QUERY = ("q", "query", "xq", "query_states", "q_states")
_KEY = ("k", "key", "xk", "key_states", "k_states")


def known_function_taps(block_modules: list[object]) -> list[tuple[str, tuple[str, ...]]]:
    """(spec, stages) for the rotary functions of the blocks' transformers modelling modules
    (`rotary_functions`); the attention kernel's q / k come first (`capture.kernel_taps`)."""
    out = []
    seen = set()
    for block in block_modules:
        mod_name = type(block).__module__
        if mod_name in seen or not mod_name.startswith("transformers.models."):
            continue
        seen.add(mod_name)
        module = sys.modules.get(mod_name)
        if module is not None:
            out += [(f"{mod_name}:{fn}", ROTARY_STAGES) for fn in rotary_functions(module)]
    return out
