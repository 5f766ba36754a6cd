"""Whole tensors compared on several workers when cores are free (docs/benchmarks.md "Benchmarks").

The unit of work is one stage unit (a reference tensor against its target tensor or ranks):
its float64 reduction runs start to end on one worker and one BLAS thread, in the same chunk
order as with one worker, so the JSON is bit-identical at any worker count. Workers are forked
processes where that is safe (`ffdebug.comparison.forked`: each has its own GIL and inherits the
parent's imports), else the threads of `map_ordered` (each kernel of the chunk loop releases the
GIL, but handing it over between kernels costs about as much as one: 1.1-1.2 x on two cores).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

MAX_WORKERS = 8
PARALLEL_MIN_BYTES = 64 << 20  # below this, one worker (about 30 ms of maths on one core)


def free_cores() -> int:
    """Cores this process may use minus the other work running on them, counting this process's
    own main thread as busy; at least 1. The other work is the lower of the 1-minute load
    average and the tasks runnable right now (Linux `/proc/loadavg`) less this one: the load
    average alone still counts the commands of the last minute (a user's previous compare, a
    benchmark's previous run) and left an idle 2-core machine one worker."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except OSError:
        busy = 0.0
    running = _running_now()
    if running is not None:
        busy = min(busy, running - 1)
    return max(1, int(cores - busy))


def _running_now() -> int | None:
    """Tasks runnable at this moment, this process included (`/proc/loadavg`: "0.20 0.18 0.12 1/80 …")."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def worker_count(sizes: list[int], budget_bytes: int) -> int:
    """The workers for jobs of these payload sizes (bytes): one per free core, as many as
    `budget_bytes` holds jobs of the largest size, no more than jobs with bytes to read; one for
    less than `PARALLEL_MIN_BYTES` in all, which one worker compares in the time it takes to start
    a pool (forking two workers costs about 20 ms). compare and weights-diff both size theirs here."""
    if sum(sizes) < PARALLEL_MIN_BYTES:
        return 1
    largest = max(sizes, default=0)
    by_memory = budget_bytes // largest if largest else MAX_WORKERS
    busy = sum(1 for size in sizes if size)
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
