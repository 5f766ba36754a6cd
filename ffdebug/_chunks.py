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


_threads_lock = threading.Lock()
_threads_depth = 0
_threads_prev = 1


class single_thread:
    """Run the chunk loops on one intra-op thread: 64 Ki-element ops gain nothing from more, and an
    OpenMP team spinning on a busy 2-core machine made them 20x slower. Re-entrant and safe across
    Python threads (the outermost entry saves and restores the setting)."""

    def __enter__(self):
        global _threads_depth, _threads_prev
        import torch

        with _threads_lock:
            if _threads_depth == 0:
                _threads_prev = torch.get_num_threads()
                if _threads_prev != 1:
                    torch.set_num_threads(1)
            _threads_depth += 1

    def __exit__(self, *exc):
        global _threads_depth
        import torch

        with _threads_lock:
            _threads_depth -= 1
            if _threads_depth == 0 and _threads_prev != 1:
                torch.set_num_threads(_threads_prev)
