"""ffdebug: dump named stages of a reference and a target run, compare them in float64, and say
where they part ways.

Capturing (env-gated, zero cost when off)::

    import ffdebug
    ffdebug.install(model)                     # no-op unless FFDEBUG_FWD_DUMP_DIR is set
    with ffdebug.step(optimizer_step=3, phase="rollout"):
        ffdebug.tap("reward", rewards)

Analysis::

    result = ffdebug.compare("dump/ref", "dump/target")
    print(result.verdict, result.first_divergence)

This module imports neither torch nor any heavy dependency at import time.
"""

import contextlib as _contextlib

from ffdebug.capture import session as _session
from ffdebug.capture import state as _state
from ffdebug.verdict import Severity as _Severity
from ffdebug.version import __version__

__all__ = [
    "__version__",
    "assert_match",
    "bisect",
    "capture",
    "compare",
    "enabled",
    "install",
    "maybe_dump_weights_and_exit",
    "patch_block_forward",
    "patch_method",
    "patch_module_dump",
    "step",
    "tap",
    "tap_function",
    "tap_grads",
    "weights_diff",
    "load_audit",
]


def install(model, classes=None, layer_class: str | None = None, stage_names=None):
    """Install dump hooks on `model` when dumps are enabled by env; else install nothing, return None.

    Stages are named by role (README "Stage names by role"); `stage_names` renames what roles
    cannot place: {OLD: NEW} regular expressions over stage kinds, e.g. {"mix.out": "attn_out"}.
    """
    s = _state.active_session()
    if s is None:
        return None
    from ffdebug.capture.hooks import install as _install

    classes = tuple(classes.split(",")) if isinstance(classes, str) else classes
    return _install(model, s, classes, layer_class, stage_names=stage_names)


def enabled() -> bool:
    """True when dumps are on in this process (env vars or an open `ffdebug.capture`): lets a caller
    skip work done only for a tap, such as copying weights to tap their update."""
    return _state.active_session() is not None


def tap(stage: str, tensor, **tags):
    """Dump `tensor` under the stage name `stage` (free tap); returns `tensor` unchanged.

    Reserved tags: `shard={"dim", "index", "count"}` and `reduction="partial"` describe sharded and
    pre-all-reduce tensors; `layer=` sets the layer; `input_ids=True` marks token ids (compared
    first, exit 3 when they differ); other tags are step tags for this capture.
    """
    s = _state.active_session()
    if s is not None:
        s.tap(stage, tensor, tags)
    return tensor


def tap_grads(role: str, named_parameters) -> None:
    """Tap `grad.<role>.<group>` (a deterministic sample of each parameter group's gradient) and
    `grad_norm.<role>.<group>` (the group's norm) when `FFDEBUG_FWD_DUMP_GRAD_SAMPLE=N` (or
    `capture(..., grad_sample=N)`) asks for N elements per parameter tensor; nothing otherwise.
    Call it after the backward, before clipping (docs/trainer-taps.md "Sampled gradients")."""
    s = _state.active_session()
    if s is None or s.config.grad_sample <= 0:
        return
    from ffdebug.capture.grads import tap_grads as _tap_grads

    _tap_grads(s, role, named_parameters, s.config.grad_sample)


@_contextlib.contextmanager
def step(**tags):
    """Tag everything captured inside, e.g. `with ffdebug.step(optimizer_step=3, phase="rollout"):`."""
    with _state.tagged(tags):
        yield


@_contextlib.contextmanager
def capture(
    model=None,
    dir=None,
    side: str = "target",
    layers=None,
    classes=None,
    layer_class=None,
    stage_names=None,
    **options,
):
    """Explicit capture without env vars: dumps `model`'s stages (and taps) into `dir/side/`.

    Options: stages, calls, mode ("full" | "stats"), grads, max_bytes, queue_bytes, overwrite, topk,
    layer_attrs, substages (role sub-stages inside every block, README "Role sub-stages");
    `stage_names` as for `install`.
    Yields the hook handle (None when `model` is None: taps only).
    """
    if dir is None:
        raise TypeError("ffdebug.capture(...) needs dir=")
    config = _session.explicit_config(dir, side, layers=layers, classes=classes, **options)
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


def tap_function(spec: str, stages):
    """Tap a module-level function's tensor outputs as `stages` (e.g. ("attn.q_rot", "attn.k_rot"));
    returns a handle whose `remove()` restores the function. Inside a block the taps get its layer
    prefix. No-op cost when dumps are off (the wrapper calls `tap`, which returns at once)."""
    from ffdebug.capture.functions import tap_function as _tf

    return _tf(spec, stages)


def maybe_dump_weights_and_exit(model):
    """Env-gated (FFDEBUG_WEIGHT_DUMP_DIR): dump parameters and buffers per rank under DIR/weights/,
    then exit 0 after a barrier unless FFDEBUG_WEIGHT_DUMP_EXIT=0. Returns None when disabled."""
    from ffdebug.capture.weights import maybe_dump_weights_and_exit as _dump

    return _dump(model)


def patch_method(cls, name, wrapper):
    """Context manager: replace `cls.name` by `wrapper(original, self, *args, **kwargs)`; restored on exit."""
    from ffdebug.capture.patch import patch_method as _p

    return _p(cls, name, wrapper)


def patch_block_forward(block_cls, layer_attr="layer_id", side=None):
    """Context manager: dump `L{NNN}.hidden_in` / `.hidden_out` around every `block_cls.forward` (layer
    from `layer_attr`, else execution order); `side` guards against dumping into the wrong side."""
    from ffdebug.capture.patch import patch_block_forward as _p

    return _p(block_cls, layer_attr=layer_attr, side=side)


def patch_module_dump(cls, stage: str, io: str = "out"):
    """Context manager: dump the output (or first input, `io="in"`) of every `cls` instance as `stage`
    (`L{NNN}.{stage}` inside a known block)."""
    from ffdebug.capture.patch import patch_module_dump as _p

    return _p(cls, stage=stage, io=io)


def compare(ref, target, **opts):
    """Compare two sides (paths or opened stores); returns a `CompareResult`."""
    from ffdebug.comparison.engine import compare as _compare

    return _compare(ref, target, **opts)


def assert_match(ref, target, fail_on: str = _Severity.DRIFT, **opts):
    """Raise AssertionError naming the first stage at or above `fail_on`."""
    result = compare(ref, target, **opts)
    bad = result.first_at_or_above(fail_on)
    if bad is not None:
        raise AssertionError(
            f"{bad.key}: {bad.severity} (cos={bad.cos}, rel={bad.rel}); verdict {result.verdict}"
        )
    return result


def bisect(ref, target, **opts):
    """Localise the first layer that introduces error, its class pattern and sub-stage (`BisectResult`)."""
    from ffdebug.bisection.engine import bisect as _bisect
    from ffdebug.report.bisect_text import conclude

    return conclude(_bisect(ref, target, **opts))


def weights_diff(a, b, **opts):
    """Schema then numerics of two checkpoints / weight dumps (`WeightsDiffResult`, truthy when they match)."""
    from ffdebug.weights.diff import weights_diff as _wd

    return _wd(a, b, **opts)


def load_audit(model, checkpoint, **opts):
    """Which checkpoint tensors `model` really loaded (never-loaded keys, params left at init, skipped shapes)."""
    from ffdebug.weights.audit import load_audit as _la

    return _la(model, checkpoint, **opts)
