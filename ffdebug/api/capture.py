"""The capture half of the public API (`ffdebug.install`, `tap`, `step`, `capture`, ...): dumps
are env-gated (docs/dumping.md "Dumping your own runs") and cost one cached lookup when off. Imports no
torch: the hooks are imported by the functions that install them."""

from __future__ import annotations

import contextlib as _contextlib
import os as _os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

from ffdebug._env import DumpConfig as _DumpConfig
from ffdebug._env import LayerSelection
from ffdebug.capture import session as _session
from ffdebug.capture import state as _state

if TYPE_CHECKING:  # types only: importing them would import torch
    import torch

    from ffdebug.capture.functions import FunctionTap
    from ffdebug.capture.hooks import Handle

TagValue = str | int | float | bool
"""A step tag's value (`optimizer_step=3`, `phase="rollout"`)."""


def install(
    model: torch.nn.Module,
    classes: str | Sequence[str] | None = None,
    layer_class: str | None = None,
    stage_names: Mapping[str, str] | None = None,
) -> Handle | None:
    """Install dump hooks on `model` when dumps are enabled by env; else install nothing, return None.

    `classes`: block class globs (default: found automatically, or FFDEBUG_FWD_DUMP_BLOCK_CLASS);
    `layer_class`: layer classes by hand, 'hash:0-2,routed:3-'. Stages are named by role (docs/dumping.md
    "Stage names by role"); `stage_names` renames what roles cannot place: {OLD: NEW} regular
    expressions over stage kinds.

    Example::

        handle = ffdebug.install(model, stage_names={"mix.out": "attn_out"})
        model(input_ids)
        if handle is not None:
            handle.remove()
    """
    s = _state.active_session()
    if s is None:
        return None
    from ffdebug.capture.hooks import install as _install

    classes = tuple(classes.split(",")) if isinstance(classes, str) else classes
    return _install(model, s, classes, layer_class, stage_names=stage_names)


def enabled() -> bool:
    """True when dumps are on in this process (env vars or an open `ffdebug.capture`): lets a caller
    skip work done only for a tap, such as copying weights to tap their update.

    Example::

        if ffdebug.enabled():
            ffdebug.tap("update.policy", after - before)
    """
    return _state.active_session() is not None


def tap(
    stage: str,
    tensor: torch.Tensor,
    *,
    layer: int | None = None,
    io: Literal["in", "out"] = "out",
    shard: Mapping[str, int] | None = None,
    reduction: Literal["partial"] | None = None,
    layer_class: str | None = None,
    input_ids: bool = False,
    scale: float | None = None,
    **step_tags: TagValue,
) -> torch.Tensor:
    """Dump `tensor` under the stage name `stage` (free tap); returns `tensor` unchanged.

    `layer` sets the layer (default: the block running now, if any); `shard={"dim", "index",
    "count"}` and `reduction="partial"` describe sharded and pre-all-reduce tensors; `input_ids=True`
    marks token ids (compared first, exit 3 when they differ); `scale`: the size of the terms a
    reduced value was summed from (docs/trainer-taps.md). Any other keyword is a step tag of this
    capture.

    Example::

        ffdebug.tap("loss.policy", loss, scale=float(per_sample.abs().max()), microbatch=2)
    """
    s = _state.active_session()
    if s is None:
        return tensor
    described = {"layer": layer, "shard": shard, "reduction": reduction, "layer_class": layer_class}
    tags: dict[str, object] = {k: v for k, v in described.items() if v is not None}
    if io != "out":
        tags["io"] = io
    if input_ids:
        tags["input_ids"] = True
    if scale is not None:
        tags["scale"] = scale
    s.tap(stage, tensor, {**step_tags, **tags})
    return tensor


def tap_grads(role: str, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
    """Tap `grad.<role>.<group>` (a deterministic sample of each parameter group's gradient) and
    `grad_norm.<role>.<group>` (the group's norm) when `FFDEBUG_FWD_DUMP_GRAD_SAMPLE=N` (or
    `capture(..., grad_sample=N)`) asks for N elements per parameter tensor; nothing otherwise.
    Call it after the backward, before clipping (docs/trainer-taps.md "Sampled gradients").

    Example::

        loss.backward()
        ffdebug.tap_grads("policy", model.named_parameters())
    """
    s = _state.active_session()
    if s is None or s.config.grad_sample <= 0:
        return
    from ffdebug.capture.grads import tap_grads as _tap_grads

    _tap_grads(s, role, named_parameters, s.config.grad_sample)


@_contextlib.contextmanager
def step(**tags: TagValue) -> Iterator[None]:
    """Tag everything captured inside with these step tags (calls pair by them in compare).

    Example::

        with ffdebug.step(optimizer_step=3, phase="rollout"):
            images = pipeline(prompts)
    """
    with _state.tagged(tags):
        yield


@_contextlib.contextmanager
def capture(
    model: torch.nn.Module | None = None,
    dir: str | _os.PathLike[str] | None = None,
    side: str = "target",
    layers: str | LayerSelection | None = None,
    classes: str | Sequence[str] | None = None,
    layer_class: str | None = None,
    stage_names: Mapping[str, str] | None = None,
    *,
    stages: str | Sequence[str] = _DumpConfig.stages,
    calls: str | int = "all",
    mode: Literal["full", "stats", "sketch"] = _DumpConfig.mode,
    grads: bool = _DumpConfig.grads,
    max_bytes: int | None = _DumpConfig.max_bytes,
    queue_bytes: int = _DumpConfig.queue_bytes,
    overwrite: bool = _DumpConfig.overwrite,
    topk: int = _DumpConfig.topk,
    layer_attrs: str | Sequence[str] = _DumpConfig.layer_attrs,
    substages: bool = _DumpConfig.substages,
    grad_sample: int = _DumpConfig.grad_sample,
) -> Iterator[Handle | None]:
    """Explicit capture without env vars: dumps `model`'s stages (and taps) into `dir/side/`.

    The keywords are the dump settings of docs/dumping.md "Dump settings" (`FFDEBUG_FWD_DUMP_*`), with
    their defaults: `stages` globs, `calls` ('all', 'first-real', N, 'A-B'), `mode`, `grads`,
    `max_bytes` (payload budget), `queue_bytes` (background writer bound; 0 writes inline),
    `overwrite`, `topk`, `layer_attrs`, `substages` (docs/dumping.md "Role sub-stages"), `grad_sample`
    (see `tap_grads`); `stage_names` as for `install`. Yields the hook handle (None when `model`
    is None: taps only).

    Example::

        with ffdebug.capture(model, dir="/tmp/dump", side="ref", layers="0-3", mode="stats"):
            model(input_ids)
    """
    if dir is None:
        raise TypeError("ffdebug.capture(...) needs dir=")
    config = _session.explicit_config(
        dir,
        side,
        layers=layers,
        classes=classes,
        stages=stages,
        calls=calls,
        mode=mode,
        grads=grads,
        max_bytes=max_bytes,
        queue_bytes=queue_bytes,
        overwrite=overwrite,
        topk=topk,
        layer_attrs=layer_attrs,
        substages=substages,
        grad_sample=grad_sample,
    )
    s = _session.Session(config, declared_classes=layer_class)
    _state.push_explicit(s)
    handle = None
    try:
        if model is not None:
            from ffdebug.capture.hooks import install as _install

            handle = _install(model, s, stage_names=stage_names)
        yield handle
    finally:
        if handle is not None:
            handle.remove()
        _state.pop_explicit(s)
        s.report_problems()
        s.close()


def tap_function(spec: str, stages: Sequence[str]) -> FunctionTap:
    """Tap a module-level function's tensor outputs as `stages`; returns a handle whose `remove()`
    restores the function (also a context manager). Inside a block the taps get its layer prefix.
    No-op cost when dumps are off (the wrapper calls `tap`, which returns at once).

    Example::

        with ffdebug.tap_function("mypkg.rope:apply_rope", ("attn.q_rot", "attn.k_rot")):
            model(input_ids)
    """
    from ffdebug.capture.functions import tap_function as _tf

    return _tf(spec, stages)


def maybe_dump_weights_and_exit(model: torch.nn.Module) -> str | None:
    """Env-gated (FFDEBUG_WEIGHT_DUMP_DIR): dump parameters and buffers per rank under DIR/weights/,
    then exit 0 after a barrier unless FFDEBUG_WEIGHT_DUMP_EXIT=0. Returns None when disabled,
    else the directory written.

    Example::

        model = load_engine_model(path)
        ffdebug.maybe_dump_weights_and_exit(model)   # FFDEBUG_WEIGHT_DUMP_DIR=/tmp/w python serve.py
    """
    from ffdebug.capture.weights import maybe_dump_weights_and_exit as _dump

    return _dump(model)


def patch_method(
    cls: type, name: str, wrapper: Callable[..., object]
) -> _contextlib.AbstractContextManager[None]:
    """Context manager: replace `cls.name` by `wrapper(original, self, *args, **kwargs)`; restored on exit.

    Example::

        def traced(original, self, x):
            return ffdebug.tap("mlp.in", original(x))

        with ffdebug.patch_method(RefMLP, "forward", traced):
            ref_model(input_ids)
    """
    from ffdebug.capture.patch import patch_method as _p

    return _p(cls, name, wrapper)


def patch_block_forward(
    block_cls: type, layer_attr: str | Sequence[str] = "layer_id", side: str | None = None
) -> _contextlib.AbstractContextManager[None]:
    """Context manager: dump `L{NNN}.hidden_in` / `.hidden_out` around every `block_cls.forward` (layer
    from `layer_attr`, else execution order); `side` guards against dumping into the wrong side.

    Example::

        with ffdebug.capture(dir="/tmp/dump", side="ref"), ffdebug.patch_block_forward(RefBlock, side="ref"):
            ref_model(input_ids)
    """
    from ffdebug.capture.patch import patch_block_forward as _p

    return _p(block_cls, layer_attr=layer_attr, side=side)


def patch_module_dump(
    cls: type, stage: str, io: Literal["in", "out"] = "out"
) -> _contextlib.AbstractContextManager[None]:
    """Context manager: dump the output (or first input, `io="in"`) of every `cls` instance as `stage`
    (`L{NNN}.{stage}` inside a known block).

    Example::

        with ffdebug.patch_module_dump(RefAttention, "attn_out"):
            ref_model(input_ids)
    """
    from ffdebug.capture.patch import patch_module_dump as _p

    return _p(cls, stage=stage, io=io)
