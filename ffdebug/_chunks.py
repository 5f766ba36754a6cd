"""Chunked float64 streaming over numpy arrays, shared by statistics (store), metrics (compare)
and weights-diff. Foundation layer: imports only `ffdebug.arrays`; never torch.

Threads: the chunk loops' sums are BLAS dot products of 256 Ki elements (`CHUNK`: 2.94 GB/s per
core against 2.42 at 64 Ki, bench/README.md), which gain nothing from
a BLAS thread team; a team spinning on a busy 2-core machine made them 66x slower (1.11 against
0.017 GB/s at load 7). `one_blas_thread` holds BLAS at one thread while the loops run (the
comparison runs its own workers, `ffdebug.comparison.parallel`), and the CLI also sets
`OPENBLAS_NUM_THREADS=1` before numpy loads unless the user set it (`ffdebug.cli.app`)."""

from __future__ import annotations

import threading

from ffdebug.arrays import to_float64

_blas_lock = threading.Lock()
_blas = {"depth": 0, "limiter": None, "controller": None}

CHUNK = 1 << 18


def iter_chunks(flat, chunk: int = CHUNK):
    """Yield float64 copies of consecutive chunks of a flat array (for statistics); the yielded
    row is reused: use it before asking for the next."""
    import numpy as np

    n = flat.shape[0]
    buf = np.empty(min(chunk, max(n, 1)), dtype=np.float64)
    for i in range(0, n, chunk):
        m = min(chunk, n - i)
        out = buf[:m]
        to_float64(flat[i : i + m], out)
        yield out


_rows = threading.local()  # per Python thread: the float64 work rows of `work_rows`


def work_rows():
    """Two float64 rows of CHUNK elements kept for this thread. The chunk loops (metrics, the
    per-token breakdown) copy pieces of their inputs there with `copy_in`; kept because a fresh
    1 MiB buffer per tensor was mapped and page-faulted by the allocator on every call
    (bench/README.md). A loop owns them until it returns."""
    import numpy as np

    rows = getattr(_rows, "rows", None)
    if rows is None:
        rows = _rows.rows = np.empty((2, CHUNK), dtype=np.float64)
    return rows


def copy_in(row, src) -> None:
    """`row` (a float64 piece of `work_rows`) <- `src` (flat, any real dtype), exactly."""
    to_float64(src, row)


def _numpy_blas():
    """A `threadpoolctl` controller of numpy's own BLAS libraries only (those inside numpy's
    installation): a torch program's BLAS (MKL, its OpenBLAS) keeps its threads while a capture's
    statistics run on the writer thread."""
    import os

    import numpy as np
    from threadpoolctl import ThreadpoolController

    root = os.path.dirname(os.path.realpath(np.__file__))  # numpy.libs / numpy/.dylibs start so too
    every = ThreadpoolController()
    mine = [
        info["filepath"]
        for info in every.info()
        if info["user_api"] == "blas" and os.path.realpath(info["filepath"]).startswith(root)
    ]
    return every.select(filepath=mine)


class one_blas_thread:
    """BLAS (numpy's OpenBLAS) on one thread inside the block, restored after it: re-entrant and
    process-wide (BLAS's setting is), so the outermost block of any Python thread sets it and the
    last one out restores it; numpy's own BLAS only (`_numpy_blas`). The library inspection runs
    once per process (about 8 ms, through `threadpoolctl`); a block costs about 0.13 ms, a nested
    one a lock."""

    def __enter__(self):
        with _blas_lock:
            if _blas["depth"] == 0:
                if _blas["controller"] is None:
                    _blas["controller"] = _numpy_blas()
                _blas["limiter"] = _blas["controller"].limit(limits=1)
            _blas["depth"] += 1

    def __exit__(self, *exc):
        with _blas_lock:
            _blas["depth"] -= 1
            if _blas["depth"] == 0:
                _blas["limiter"].restore_original_limits()
                _blas["limiter"] = None
