"""The bounded background dump writer: captures leave the forward thread at once.

`BackgroundWriter(writer, max_bytes)` queues each capture (already cloned by `Session.capture`,
so later in-place ops of the model cannot reach it) for one writer thread. That thread computes
the statistics and runs the unchanged `StoreWriter.write` protocol — payload written, fsynced and
renamed, then its manifest line — in capture order, so a run killed at any point leaves a readable
store holding every capture written so far (the queued ones are lost, never half-written).

The queue holds at most `max_bytes` of tensors, counting the one being written (default 256 MiB,
`FFDEBUG_FWD_DUMP_QUEUE_BYTES`). `submit` blocks while it is full and never drops a capture; a
tensor larger than the bound waits for an empty queue. `drain()` waits until everything queued is
written; `close()` drains, stops the thread and closes the store writer (status.json, writer
lock). An error of the writer thread (disk full, ...) is raised by the next `submit`, `drain` or
`close`, in the caller's thread. SIGTERM drains every open writer first
(`ffdebug.store.termination`).
"""

from __future__ import annotations

import collections
import threading

from ffdebug.store import termination

DEFAULT_QUEUE_BYTES = 256 << 20


class BackgroundWriter:
    """A `StoreWriter` fed through a bounded queue by one background thread."""

    def __init__(self, writer, max_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        self.writer = writer
        self.max_bytes = max_bytes
        # re-entrant: the SIGTERM handler may drain while the interrupted thread holds the lock
        self._cond = threading.Condition(threading.RLock())
        self._queue: collections.deque = collections.deque()
        self._pending = 0  # captures queued or being written
        self.queued_bytes = 0  # their bytes
        self._error: BaseException | None = None
        self._failed = False  # a write failed: the store is closed as incomplete
        self._stop = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ffdebug-dump-writer", daemon=True)
        self._thread.start()
        termination.register(self)

    def submit(self, key: str, tensor, meta: dict, always_payload: bool = False, payload_of=None) -> None:
        """Queue one capture (the caller's own copy); blocks while the queue is full. `payload_of`,
        when given, turns the tensor into the payload written instead (a sketch), on this thread."""
        nbytes = tensor.numel() * tensor.element_size()
        with self._cond:
            while self._error is None and self._pending and self.queued_bytes + nbytes > self.max_bytes:
                self._cond.wait()
            self._raise_error()
            self._queue.append((key, tensor, meta, always_payload, payload_of, nbytes))
            self._pending += 1
            self.queued_bytes += nbytes
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                key, tensor, meta, always_payload, payload_of, nbytes = self._queue.popleft()
            try:
                if self._error is None:
                    payload = payload_of(tensor) if payload_of is not None else None
                    self.writer.write(key, tensor, meta, always_payload=always_payload, payload=payload)
            except BaseException as err:  # raised later in the capturing thread
                self._error = err
                self._failed = True
            del tensor
            with self._cond:
                self._pending -= 1
                self.queued_bytes -= nbytes
                self._cond.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def drain(self) -> None:
        """Wait until every queued capture is written (payload and manifest line)."""
        with self._cond:
            while self._pending:
                self._cond.wait()
            self._raise_error()

    def close(self) -> None:
        """Drain, stop the thread and close the store writer; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.drain()
        finally:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            self._thread.join()
            termination.unregister(self)
            self.writer.close(complete=not self._failed)
