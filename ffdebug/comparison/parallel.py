"""Whole tensors compared on several threads when cores are free (README "Benchmarks").

The unit of work is one stage unit (a reference tensor against its target tensor or ranks):
its float64 reduction runs start to end on one worker and one intra-op thread, in the same chunk
order as with one worker, so the JSON is bit-identical at any worker count. Threads, not
processes: each 64 Ki-element kernel of the chunk loop releases the GIL, and a process pool would
pay torch's import in every worker.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

MAX_WORKERS = 8


def free_cores() -> int:
    """Cores this process may use minus the 1-minute load average (other work on the machine),
    counting this process's own main thread as busy; at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return max(1, int(cores - load))


def auto_workers(jobs: list[list], budget_bytes: int) -> int:
    """One worker per free core, as many as the memory budget holds jobs of the largest size."""
    from ffdebug.io.prefetch import record_bytes

    largest = max((sum(record_bytes(r) for r in job) for job in jobs), default=0)
    by_memory = budget_bytes // largest if largest else MAX_WORKERS
    busy = sum(1 for job in jobs if job)
    return max(1, min(free_cores(), MAX_WORKERS, by_memory, busy))


def map_ordered(fn: Callable[[int], object], n: int, workers: int) -> list:
    """[fn(0), ..., fn(n-1)], computed on `workers` threads (in order when 1); the first error
    in index order is raised after the pool has stopped taking new indices."""
    if workers <= 1 or n <= 1:
        return [fn(i) for i in range(n)]
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ffdebug-compare")
    futures = [pool.submit(fn, i) for i in range(n)]
    try:
        return [f.result() for f in futures]
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)
