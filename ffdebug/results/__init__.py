"""Typed results passed from the analysis (compare, bisect) to the reports (docs/architecture.md).

A `StageResult` is one paired stage: where it sits (key, layer, call, rank, step tags), what the two
tensors were (`TensorMeta`), the float64 metrics, the severity the verdict rules gave it
(`ffdebug.verdict`), and why. `CompareResult` and `BisectResult` are built from them; JSON exists
only at the boundary (`to_json`), with the keys the docs document (pinned by tests/test_json_contract.py). Nothing here imports torch.
"""

from ffdebug.results.bisect import (
    FIRST_DIVERGENCE_FIELDS,
    SUB_STAGE_FIELDS,
    BisectResult,
    CallSummary,
    ClassSummary,
    LayerRow,
)
from ffdebug.results.slots import SLOT_MEANING, InvarianceResult, SlotCompare, SlotFinding, SlotStage
from ffdebug.results.stages import (
    METRIC_FIELDS,
    CallRef,
    CompareResult,
    CoveredVerdict,
    StageResult,
    TensorMeta,
    exit_code,
    worst_of,
)
from ffdebug.results.weights import TensorDiff, WeightsDiffResult

__all__ = [
    "FIRST_DIVERGENCE_FIELDS",
    "METRIC_FIELDS",
    "SLOT_MEANING",
    "SUB_STAGE_FIELDS",
    "BisectResult",
    "CallRef",
    "CallSummary",
    "ClassSummary",
    "CompareResult",
    "CoveredVerdict",
    "InvarianceResult",
    "LayerRow",
    "SlotCompare",
    "SlotFinding",
    "SlotStage",
    "StageResult",
    "TensorDiff",
    "TensorMeta",
    "WeightsDiffResult",
    "exit_code",
    "worst_of",
]
