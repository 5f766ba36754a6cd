"""Manifest record schema (stable keys, docs/dumping.md "The dump store") and the run.json identity block."""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time

FORMAT_VERSION = 1

RECORD_KEYS = (
    "key",  # stage key, e.g. "L003.ffn_out"
    "seq",  # capture order within the rank
    "file",  # payload file relative to the rank dir (null in stats mode)
    "tensor",  # tensor name inside the payload file
    "side",
    "rank",
    "world_size",
    "call",  # root-forward call index within the step tags (null outside calls)
    "invocation",  # n-th invocation of the same module within one call
    "phase",
    "step",  # dict of step tags
    "layer",  # null outside blocks
    "layer_class",
    "module_class",
    "module_path",
    "io",  # in | out | grad
    "dtype",
    "shape",
    "stats",
    "shard",  # {dim, index, count} or null
    "reduction",  # full | partial
    "writer",  # identity of the writer that held the rank directory (ffdebug.store.lock)
)

# Record `phase` values that mark a warm-up call: tagged by the engine, or guessed (a dummy batch).
WARMUP_PHASES = ("warmup", "warmup_guess")


def looks_like_dummy_ids(ids) -> bool:
    """A warm-up batch: more than one id, all equal (zeros, pad, BOS repeated)."""
    flat = ids.reshape(-1)
    return flat.shape[0] > 1 and bool((flat == flat[0]).all())


STAT_KEYS = ("mean", "std", "min", "max", "absmax", "l2", "nan", "inf", "zero", "numel")


def tensor_stats(tensor) -> dict:
    """Summary statistics in float64, computed in chunks (never a whole float64 copy), of a numpy
    array or a torch tensor (taken as a numpy view, `ffdebug.arrays.as_array`). A chunk whose sum
    and sum of squares are finite holds no NaN / Inf and takes five passes (sum, dot, min, max,
    non-zero count); only the others test every element for NaN / Inf."""
    import numpy as np

    from ffdebug._chunks import one_blas_thread

    with np.errstate(all="ignore"), one_blas_thread():
        return _tensor_stats(tensor)


def _tensor_stats(tensor) -> dict:
    import numpy as np

    from ffdebug._chunks import iter_chunks
    from ffdebug.arrays import as_array

    flat = as_array(tensor).reshape(-1)
    n = flat.shape[0]
    total = 0.0
    total_sq = 0.0
    lo = float("inf")
    hi = float("-inf")
    absmax = 0.0
    nan = inf = zero = finite_n = 0
    for c in iter_chunks(flat):
        m = c.shape[0]
        s, sq = float(c.sum()), float(np.dot(c, c))
        if math.isfinite(s + sq):  # no NaN / Inf in this chunk: five passes
            c_lo, c_hi = c.min(), c.max()
            zero += m - int(np.count_nonzero(c))
            finite_n += m
            total += s
            total_sq += sq
            lo, hi = min(lo, float(c_lo)), max(hi, float(c_hi))
            absmax = max(absmax, hi, -lo)
            continue
        finite = np.isfinite(c)
        nan += int(np.count_nonzero(np.isnan(c)))
        inf += int(np.count_nonzero(np.isinf(c)))
        zero += int(np.count_nonzero(c == 0))
        c = c[finite]
        if c.size == 0:
            continue
        finite_n += c.size
        total += float(c.sum())
        total_sq += float(np.dot(c, c))
        lo = min(lo, float(c.min()))
        hi = max(hi, float(c.max()))
        absmax = max(absmax, float(np.abs(c).max()))
    mean = total / finite_n if finite_n else None
    var = max(total_sq / finite_n - mean * mean, 0.0) if finite_n else None
    # Sums of squares of float64 values beyond ~1e154 overflow: such a stat is null, never Infinity
    # (the manifest is strict JSON, and a capture must not crash the run it observes).
    return {
        "mean": _finite_or_none(mean),
        "std": _finite_or_none(var**0.5 if var is not None else None),
        "min": lo if finite_n else None,
        "max": hi if finite_n else None,
        "absmax": absmax if finite_n else None,
        "l2": _finite_or_none(total_sq**0.5),
        "nan": nan,
        "inf": inf,
        "zero": zero,
        "numel": n,
    }


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def _git_info() -> dict:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        ).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
            ).stdout.strip()
        )
        return {"sha": sha or None, "dirty": dirty if sha else None}
    except (OSError, subprocess.SubprocessError):
        return {"sha": None, "dirty": None}


def _library_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in ("torch", "transformers", "diffusers", "safetensors", "numpy"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = getattr(module, "__version__", None)
    return versions


def run_info(side: str, world_size: int, extra: dict | None = None) -> dict:
    """The identity block written to `<side>/run.json`."""
    import torch

    from ffdebug._env import selected_env
    from ffdebug.version import __version__

    info = {
        "format_version": FORMAT_VERSION,
        "tool": "ffdebug",
        "tool_version": __version__,
        "side": side,
        "argv": list(sys.argv),
        "git": _git_info(),
        "libraries": _library_versions(),
        "seed": torch.initial_seed(),
        "world_size": world_size,
        "threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "env": selected_env(),
        "input_ids_sha256": None,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "pid": os.getpid(),
    }
    if extra:
        info.update(extra)
    return info


def sha256_of_tensor(tensor) -> str:
    """sha256 of the raw bytes (any dtype, bf16 included)."""
    import numpy as np

    from ffdebug.arrays import as_array

    return hashlib.sha256(np.ascontiguousarray(as_array(tensor)).tobytes()).hexdigest()


def dumps_record(record: dict) -> str:
    return json.dumps(record, separators=(",", ":"), allow_nan=False, default=str)
