"""What `inspect` checks by default: the manifest's shape, dtype and statistics recomputed from
the payload (docs/architecture.md, "Hostile stores"). A manifest is a claim about its payloads;
every field that disagrees is named."""

from __future__ import annotations

import math

from ffdebug.arrays import is_complex
from ffdebug.io.record import Record
from ffdebug.store.schema import tensor_stats


def payload_facts(tensor) -> tuple[tuple[int, ...], str, dict | None]:
    """(shape, dtype, statistics) of a loaded payload; complex tensors have no statistics (the
    writer stores none for them)."""
    stats = None if is_complex(tensor.dtype) else tensor_stats(tensor)
    return tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""), stats


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-300)
    return a == b


def disagreements(rec: Record, shape: tuple[int, ...], dtype: str, stats: dict | None) -> list[str]:
    """Each manifest field of `rec` that the payload contradicts, as `field: manifest X vs payload Y`.
    A sketch-mode payload is the tensor's sketch: only its length is checked."""
    sketch_info = (rec.extra or {}).get("sketch")
    if isinstance(sketch_info, dict):
        buckets = sketch_info.get("buckets")
        return [] if shape == (buckets,) else [f"sketch: {buckets} buckets declared vs payload {list(shape)}"]
    out = []
    if tuple(rec.shape) != shape:
        out.append(f"shape: manifest {list(rec.shape)} vs payload {list(shape)}")
    if rec.dtype is not None and rec.dtype != dtype:
        out.append(f"dtype: manifest {rec.dtype[:40]} vs payload {dtype}")
    if rec.stats is not None:
        for name, claimed in rec.stats.items():
            actual = (stats or {}).get(name)
            if (stats is None or name in stats) and not _same(claimed, actual):
                out.append(f"stats.{name[:40]}: manifest {claimed} vs payload {actual}")
    return out
