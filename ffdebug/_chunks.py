"""Chunked float64 streaming over numpy arrays, shared by statistics (store), metrics (compare)
and weights-diff. Foundation layer: imports only `ffdebug.arrays`; never torch.

Threads: the chunk loops' sums are BLAS dot products of 64 Ki elements, which gain nothing from
a BLAS thread team (and a team spinning on a busy 2-core machine slows them); the CLI sets
`OPENBLAS_NUM_THREADS=1` before numpy loads unless the user set it (`ffdebug.cli.app`), and the
comparison runs its own workers (`ffdebug.comparison.parallel`)."""

from __future__ import annotations

import threading

from ffdebug.arrays import to_float64

CHUNK = 1 << 16


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
