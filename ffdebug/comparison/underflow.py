"""Underflow: a low-precision side cannot hold values below its dtype's smallest normal.

`verdict.below_range` marks a stage where the two sides differ in dtype, one is low-precision, and
the reference's rms is below that dtype's smallest normal (bf16 1.2e-38, fp16 6.1e-5): there the
low-precision side keeps fewer mantissa bits or, on CPU kernels, flushes the values to zero. The
stage is at most `drift` and its layer is not judged (`bisection.budget.mark_introducing`).

What the low-precision side computes from such values is not its code's doing either: a norm
after a flushed convolution renormalises zeros into zeros while the reference renormalises its
tiny values back to size 1. So, per paired call in execution order, every stage after the first
underflow is marked the same way (`range_limited`; one outside the ok band is at most `drift`,
with a note naming the stage where the values left the dtype's range). The zoo's tiny convolutional nets in fp16 (activations of
1e-6 to 1e-10 after a few blocks) and MobileViT in bf16 (1e-41) are the cases this was measured on.
"""

from __future__ import annotations

from ffdebug import verdict as V
from ffdebug.results import StageResult


def explain(stages: list[StageResult]) -> None:
    """Mark the stages after each call's first underflow (module doc), in place."""
    first: dict[tuple, StageResult] = {}
    for e in stages:
        call = (tuple(sorted((str(k), str(v)) for k, v in e.step.items())), e.phase, e.call, e.rank)
        if call not in first:
            if e.range_limited:
                first[call] = e
            continue
        if e.range_limited:
            continue
        e.range_limited = True
        if e.ok:
            continue
        e.severity = V.range_limited(e.severity)
        e.notes.append(
            f"after an underflow: {first[call].key} left the low-precision dtype's range, and what "
            "this side computes from it is not judged"
        )
