"""Chunked float64 streaming and the one-intra-op-thread guard, shared by statistics (store),
metrics (compare) and weights-diff. Foundation layer: imports nothing from ffdebug."""

from __future__ import annotations

import threading

CHUNK = 1 << 16


def iter_chunks(flat, chunk: int = CHUNK):
    """Yield float64 copies of consecutive chunks of a flat tensor (for statistics)."""
    import torch

    n = flat.numel()
    buf = torch.empty(min(chunk, max(n, 1)), dtype=torch.float64)
    for i in range(0, n, chunk):
        m = min(chunk, n - i)
        out = buf[:m]
        out.copy_(flat[i : i + m])
        yield out


_rows = threading.local()  # per Python thread: the float64 work rows of `work_rows`


def work_rows():
    """(rows, view): two float64 rows of CHUNK elements kept for this thread, and their numpy
    view (the same memory). The chunk loops (metrics, the per-token breakdown) copy pieces of
    their inputs there with `copy_in`; kept because a fresh 1 MiB buffer per tensor was mapped
    and page-faulted by the allocator on every call (bench/README.md). A loop owns them until it
    returns."""
    import torch

    rows = getattr(_rows, "rows", None)
    if rows is None:
        rows = _rows.rows = torch.empty((2, CHUNK), dtype=torch.float64)
        _rows.view = rows.numpy()
        _rows.f32 = torch.empty(CHUNK, dtype=torch.float32)  # float16 goes through it (`copy_in`)
        _rows.f16 = torch.float16
    return rows, _rows.view


def copy_in(row, src) -> None:
    """`row` (a float64 piece of `work_rows`) <- `src`; float16 through a float32 row: torch's
    float16 -> float64 copy is not vectorised (49 µs per 64 Ki elements against 7.5 + 15 through
    float32; both exact)."""
    if src.dtype is _rows.f16:
        stage = _rows.f32[: src.shape[0]]
        stage.copy_(src)
        src = stage
    row.copy_(src)


_threads = threading.local()  # per Python thread: torch's intra-op setting is per thread (OpenMP / MKL)


class single_thread:
    """Run the chunk loops on one intra-op thread: 64 Ki-element ops gain nothing from more, and an
    OpenMP team spinning on a busy 2-core machine made them 20x slower. torch's thread count is
    a per-thread setting (OpenMP ICV, MKL local), so each Python thread — the forward, the
    background dump writer, compare workers — saves and restores its own; re-entrant."""

    def __enter__(self):
        import torch

        depth = getattr(_threads, "depth", 0)
        if depth == 0:
            _threads.prev = torch.get_num_threads()
            if _threads.prev != 1:
                torch.set_num_threads(1)
        _threads.depth = depth + 1

    def __exit__(self, *exc):
        import torch

        _threads.depth -= 1
        if _threads.depth == 0 and _threads.prev != 1:
            torch.set_num_threads(_threads.prev)
