"""Bounded read-ahead: the next payloads are read on one background thread while the current
ones are compared (docs/benchmarks.md "Benchmarks").

`ReadAhead(jobs, depth_bytes)`: `jobs` is an ordered list; each job is the records one step of the
consumer will load. A reader thread loads the jobs in file order while the bytes it has read and
the consumers have not yet released stay within `depth_bytes` (one job is always allowed, however
large, so a tensor bigger than the depth is still read ahead alone). Peak tensor memory is
therefore bounded by the depth plus the jobs the consumers read themselves (at most one each).

`take(i)` returns job i as a `Loaded` (its tensors by record), waiting while the reader is on that
job; a job the reader has not reached yet is read by the caller itself, so a slow reader never
stalls a consumer. `release(i)` returns job i's bytes to the budget once its tensors are dropped.
A read error is raised by `take` of the job that failed, in the consumer's thread.
"""

from __future__ import annotations

import threading

_ELEMENT_BYTES = {"float64": 8, "int64": 8, "complex64": 8, "float32": 4, "int32": 4, "uint32": 4}
_ELEMENT_BYTES.update({"float16": 2, "bfloat16": 2, "int16": 2, "uint16": 2})


def record_bytes(record) -> int:
    """The payload size the manifest announces (shape × element size; 1 byte for 8-bit types)."""
    numel = 1
    for d in record.shape or ():
        numel *= d
    return numel * _ELEMENT_BYTES.get(record.dtype or "", 1)


class Loaded:
    """The tensors of one job by record identity; a record not read ahead is loaded on demand."""

    def __init__(self, tensors: dict[int, object]) -> None:
        self._tensors = tensors

    def __call__(self, record):
        t = self._tensors.get(id(record))
        return t if t is not None else record.load()


def _read(job: list) -> Loaded:
    return Loaded({id(r): r.load() for r in job})


class ReadAhead:
    """Reads `jobs` ahead of the consumers on one thread; use as a context manager."""

    def __init__(self, jobs: list[list], depth_bytes: int) -> None:
        self._jobs = jobs
        self._sizes = [sum(record_bytes(r) for r in job) for job in jobs]
        self._depth = depth_bytes
        self._cond = threading.Condition()
        self._ready: dict[int, Loaded | BaseException] = {}
        self._claimed: set[int] = set()  # jobs a consumer took before the reader reached them
        self._charged: set[int] = set()  # jobs whose bytes count against the depth
        self._next = 0
        self._reading: int | None = None
        self._held = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ffdebug-read-ahead", daemon=True)

    def __enter__(self) -> ReadAhead:
        if any(self._jobs):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                i = self._pick()
                if i is None:
                    return
                self._reading = i
                self._held += self._sizes[i]
                self._charged.add(i)
            try:
                loaded: Loaded | BaseException = _read(self._jobs[i])
            except BaseException as err:  # handed to the consumer of this job
                loaded = err
            with self._cond:
                self._reading = None
                if not self._closed:
                    self._ready[i] = loaded
                self._cond.notify_all()

    def _pick(self) -> int | None:
        """The next job to read (waiting for room under the depth), or None when done."""
        while True:
            while self._next < len(self._jobs) and (
                self._next in self._claimed or not self._jobs[self._next]
            ):
                self._next += 1
            if self._closed or self._next >= len(self._jobs):
                return None
            if self._held == 0 or self._held + self._sizes[self._next] <= self._depth:
                self._next += 1
                return self._next - 1
            self._cond.wait()

    def take(self, i: int) -> Loaded:
        """Job i's tensors (read ahead, or read now by the caller)."""
        with self._cond:
            while self._reading == i:
                self._cond.wait()
            got = self._ready.pop(i, None)
            if got is None:
                self._claimed.add(i)
        if got is None:
            return _read(self._jobs[i])
        if isinstance(got, BaseException):
            self.release(i)
            raise got
        return got

    def release(self, i: int) -> None:
        """Job i is done with: its bytes leave the budget."""
        with self._cond:
            if i in self._charged:
                self._charged.discard(i)
                self._held -= self._sizes[i]
                self._cond.notify_all()
