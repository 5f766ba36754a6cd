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

Every option is an annotated keyword, with the engine's own default (docs/dumping.md "Python API"). The
result types are exported here. This module imports neither torch nor any heavy dependency at
import time: the engines are imported by the functions that run them.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # every name is imported on first use (below)
    from ffdebug._env import LayerSelection
    from ffdebug.api.analysis import assert_match, bisect, compare, load_audit, weights_diff
    from ffdebug.api.capture import (
        TagValue,
        capture,
        enabled,
        install,
        maybe_dump_weights_and_exit,
        patch_block_forward,
        patch_method,
        patch_module_dump,
        step,
        tap,
        tap_function,
        tap_grads,
    )
    from ffdebug.errors import FFDebugError, InputIdsMismatch
    from ffdebug.progress_hook import ProgressHook
    from ffdebug.results import BisectResult, CompareResult, StageResult, TensorDiff, WeightsDiffResult
    from ffdebug.verdict import Severity, Threshold
    from ffdebug.version import __version__
    from ffdebug.weights.audit import LoadAuditResult

__all__ = [
    "BisectResult",
    "CompareResult",
    "FFDebugError",
    "InputIdsMismatch",
    "LayerSelection",
    "LoadAuditResult",
    "ProgressHook",
    "Severity",
    "StageResult",
    "TagValue",
    "TensorDiff",
    "Threshold",
    "WeightsDiffResult",
    "__version__",
    "assert_match",
    "bisect",
    "capture",
    "compare",
    "enabled",
    "install",
    "load_audit",
    "maybe_dump_weights_and_exit",
    "patch_block_forward",
    "patch_method",
    "patch_module_dump",
    "step",
    "tap",
    "tap_function",
    "tap_grads",
    "weights_diff",
]


_CAPTURE = (
    "TagValue",
    "capture",
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
)
_WHERE: dict[str, str] = {
    **dict.fromkeys(_CAPTURE, "ffdebug.api.capture"),
    **dict.fromkeys(
        ("assert_match", "bisect", "compare", "load_audit", "weights_diff"), "ffdebug.api.analysis"
    ),
    **dict.fromkeys(
        ("BisectResult", "CompareResult", "StageResult", "TensorDiff", "WeightsDiffResult"), "ffdebug.results"
    ),
    "LayerSelection": "ffdebug._env",
    "FFDebugError": "ffdebug.errors",
    "InputIdsMismatch": "ffdebug.errors",
    "ProgressHook": "ffdebug.progress_hook",
    "Severity": "ffdebug.verdict",
    "Threshold": "ffdebug.verdict",
    "LoadAuditResult": "ffdebug.weights.audit",
    "__version__": "ffdebug.version",  # installed metadata: importlib.metadata costs ~40 ms
}


def __getattr__(name: str) -> Any:
    """Every public name, imported on first use and then kept as a module attribute: `import
    ffdebug` costs a few milliseconds, so a model's `ffdebug.install(model)` line and every CLI
    start (which imports only what its command needs) stay light; the capture API, the analysis
    engines, the weights engine and the installed metadata are each loaded by their first use."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'ffdebug' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """`ffdebug.capture` names both the public function and the `capture/` subpackage. The import
    system binds a subpackage onto its parent when it first loads; the public name keeps the function
    (the subpackage stays `sys.modules["ffdebug.capture"]`, which `from ffdebug.capture import ...`
    reads)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
