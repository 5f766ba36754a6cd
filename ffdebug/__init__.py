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

Every option is an annotated keyword, with the engine's own default (README "Python API"). The
result types are exported here. This module imports neither torch nor any heavy dependency at
import time: the engines are imported by the functions that run them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
from ffdebug.verdict import Severity, Threshold

if TYPE_CHECKING:  # the result types and the version are imported on first use (below)
    from ffdebug.results import BisectResult, CompareResult, StageResult, TensorDiff, WeightsDiffResult
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


_RESULT_TYPES = {
    "BisectResult": "ffdebug.results",
    "CompareResult": "ffdebug.results",
    "StageResult": "ffdebug.results",
    "TensorDiff": "ffdebug.results",
    "WeightsDiffResult": "ffdebug.results",
    "LoadAuditResult": "ffdebug.weights.audit",
    "__version__": "ffdebug.version",  # installed metadata: importlib.metadata costs ~40 ms
}


def __getattr__(name: str) -> Any:
    """The result types and `__version__`, imported on first use: `import ffdebug` (and so every
    CLI start) stays light, `ffdebug.weights.audit` pulls in the weights engine and the version
    reads the installed metadata."""
    module = _RESULT_TYPES.get(name)
    if module is None:
        raise AttributeError(f"module 'ffdebug' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
