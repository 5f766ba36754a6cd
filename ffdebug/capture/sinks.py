"""Where a session's captures go (docs/architecture.md, "Layers", the capture row).

A `Session` decides what is captured and with which metadata; its sink receives each capture:

- `StoreSink` writes it into a dump store side (`DIR/SIDE/rankNNN/`), through the background
  writer when the queue is on, inline otherwise. The store writer starts at the first capture.
- `ffdebug.trace`'s `Tracer` is a sink too: it keeps a row per tap and writes nothing to disk.

A sink receives the live tensor: one that keeps it past the call (the store) copies it first.
"""

from __future__ import annotations

import os
from typing import Protocol

from ffdebug._env import DumpConfig
from ffdebug.errors import FFDebugError


class CaptureSink(Protocol):
    # False: the sink sees module outputs by other means (the tracer's process-wide hooks), so the
    # stages of `ffdebug.install` hooks are not sent to it; free taps always are.
    takes_module_stages: bool

    def write(self, key: str, tensor, meta: dict, always_payload: bool, payload_of=None) -> None: ...

    def update_run_info(self, **fields) -> None: ...

    def count_skip(self, reason: str) -> None: ...

    def close(self) -> None: ...


class StoreSink:
    """Writes captures (our own copies) into one side of a dump store."""

    takes_module_stages = True

    def __init__(self, config: DumpConfig, rank: int, world_size: int) -> None:
        self.config = config
        self.rank, self.world_size = rank, world_size
        self._writer = None
        self._background = None  # ffdebug.store.background.BackgroundWriter, at the first capture
        self._run_info: dict = {}  # run.json fields given before the writer started
        self.refused: str | None = None  # why the store refused this writer (a live lock, an old dump)

    @property
    def side_dir(self) -> str:
        return os.path.join(self.config.dir, self.config.side)

    def writer(self):
        if self._writer is None:
            from ffdebug.store.writer import StoreWriter

            c = self.config
            try:
                self._writer = StoreWriter(
                    self.side_dir,
                    side=c.side,
                    rank=self.rank,
                    world_size=self.world_size,
                    mode=c.mode,
                    max_bytes=c.max_bytes,
                    overwrite=c.overwrite,
                )
            except FFDebugError as e:  # raised to the capture; the end-of-run report says it again
                self.refused = str(e)
                raise
            if self._run_info:
                self._writer.update_run_info(**self._run_info)
        return self._writer

    def write(self, key: str, tensor, meta: dict, always_payload: bool, payload_of=None) -> None:
        """Copy `tensor` (the dump must not see later in-place ops) and hand it to the background
        writer; inline when its queue is 0. `payload_of(tensor)` gives the payload written instead
        of the tensor (sketch mode)."""
        t = tensor.detach()
        t = t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()
        writer = self.writer()
        if self.config.queue_bytes <= 0:
            payload = payload_of(t) if payload_of is not None else None
            writer.write(key, t, meta, always_payload=always_payload, payload=payload)
            return
        if self._background is None:
            from ffdebug.store.background import BackgroundWriter

            self._background = BackgroundWriter(writer, self.config.queue_bytes)
        self._background.submit(key, t, meta, always_payload=always_payload, payload_of=payload_of)

    def update_run_info(self, **fields) -> None:
        """Fields of run.json; kept until the writer starts when no capture was written yet."""
        if self._writer is None:
            self._run_info.update(fields)
        else:
            self._writer.update_run_info(**fields)

    def count_skip(self, reason: str) -> None:
        self.writer().count_skip(reason)

    def close(self) -> None:
        if self._background is not None:
            self._background.close()  # drains the queue, then closes the store writer
        elif self._writer is not None:
            self._writer.close()
