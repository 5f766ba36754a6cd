"""Atomic, append-only writer for one rank of one side of a dump store.

Write protocol (a killed run leaves a readable store): the payload goes to a temp file in the rank
directory, is fsynced and renamed into place; only then is its manifest line appended (one write of
one complete line, flushed). Readers ignore a trailing partial line, so at worst the last tensor
is lost, never the store.

One writer per rank directory (`ffdebug.store.lock`): the writer claims `writer.lock` before it
writes anything, stamps its identity into every record (`writer`) and releases the lock at close.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading

from ffdebug.errors import FFDebugError
from ffdebug.store.lock import LOCK_NAME, WriterIdentity, WriterLock, live_writer
from ffdebug.store.schema import dumps_record, run_info, tensor_stats

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` via temp file + fsync + rename."""
    tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def atomic_write_json(path: str, obj: dict) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, default=str) + "\n").encode())


class StoreWriter:
    """Writes records of one rank into `side_dir/rankNNN/`.

    Args:
        side_dir: `<dir>/<side>` directory.
        side: side label stored in every record.
        rank / world_size: distributed coordinates of this process.
        mode: "full" writes payloads; "stats" writes only statistics.
        max_bytes: payload budget; past it captures are counted, not written.
        overwrite: replace this rank's existing dump instead of failing.
    """

    def __init__(
        self,
        side_dir: str,
        side: str,
        rank: int = 0,
        world_size: int = 1,
        mode: str = "full",
        max_bytes: int | None = None,
        overwrite: bool = False,
        overwrite_variable: str = "FFDEBUG_FWD_DUMP_OVERWRITE",
        run_extra: dict | None = None,
    ) -> None:
        self.side_dir = side_dir
        self.side = side
        self.rank = rank
        self.world_size = world_size
        self.mode = mode
        self.max_bytes = max_bytes
        self.rank_dir = os.path.join(side_dir, f"rank{rank:03d}")
        self.seq = 0
        self.bytes_written = 0
        self.counts = {"written": 0, "stats_only": 0, "over_budget": 0, "skipped_graph_capture": 0}
        self._lock = threading.Lock()
        self._prepare(overwrite, overwrite_variable, run_extra)
        self._manifest = open(os.path.join(self.rank_dir, "manifest.jsonl"), "a", encoding="utf-8")

    def _prepare(self, overwrite: bool, variable: str, run_extra: dict | None) -> None:
        # The claim comes first: a second writer is refused before it touches anything.
        try:
            os.makedirs(self.rank_dir, exist_ok=True)
        except OSError as err:
            raise FFDebugError(
                f"{self.rank_dir}: cannot create the rank directory ({err.strerror})"
            ) from None
        self.lock = WriterLock(self.rank_dir, WriterIdentity.current())
        self.lock.claim(overwrite, variable)
        try:
            self._replace_existing(overwrite, variable)
            if self.rank == 0:
                extra = {"writer": self.writer_id, **(run_extra or {})}
                atomic_write_json(
                    os.path.join(self.side_dir, "run.json"), run_info(self.side, self.world_size, extra)
                )
        except BaseException:
            self.lock.release()
            raise

    @property
    def writer_id(self) -> str:
        return self.lock.identity.writer_id

    def _replace_existing(self, overwrite: bool, variable: str) -> None:
        existing = any(n != LOCK_NAME for n in os.listdir(self.rank_dir))
        run_json = os.path.join(self.side_dir, "run.json")
        if self.rank == 0 and os.path.lexists(run_json) and not existing:
            existing = True
        if not existing:
            return
        if not overwrite:
            raise FFDebugError(
                f"{self.side_dir} already holds a dump: set {variable}=1 to replace it, or choose another directory"
            )
        # Each rank replaces only its own directory (rank 0 also run.json): deleting other ranks'
        # directories would race with ranks that started first.
        for name in os.listdir(self.rank_dir):
            if name != LOCK_NAME:
                _remove(os.path.join(self.rank_dir, name))
        if self.rank == 0:
            self._remove_ranks_beyond_world()
            if os.path.lexists(run_json):
                _remove(run_json)

    def _remove_ranks_beyond_world(self) -> None:
        """Rank directories no rank of this run will write (an earlier run had more ranks), unless
        a live writer holds them."""
        for name in os.listdir(self.side_dir):
            match = re.fullmatch(r"rank(\d+)", name)
            path = os.path.join(self.side_dir, name)
            if match and int(match.group(1)) >= self.world_size and live_writer(path) is None:
                _remove(path)

    def update_run_info(self, **fields) -> None:
        """Merge fields into run.json (rank 0 only), e.g. the sha256 of the input ids."""
        if self.rank != 0:
            return
        path = os.path.join(self.side_dir, "run.json")
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
        info.update(fields)
        atomic_write_json(path, info)

    def count_skip(self, reason: str) -> None:
        with self._lock:
            self.counts[reason] = self.counts.get(reason, 0) + 1

    def write(self, key: str, tensor, meta: dict, always_payload: bool = False, payload=None) -> dict | None:
        """Capture one tensor (already detached and cloned by the caller) and append its record.

        `always_payload` writes the tensor even in stats mode or over budget (input ids: small,
        and needed by the input-ids gate). `payload` (sketch mode) is written instead of the
        tensor, whose shape, dtype and statistics the record keeps.
        """
        import safetensors.torch

        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        if not t.is_contiguous():
            t = t.contiguous()
        with self._lock:
            seq = self.seq
            self.seq += 1
            record = {
                "key": key,
                "seq": seq,
                "file": None,
                "tensor": None,
                "side": self.side,
                "rank": self.rank,
                "world_size": self.world_size,
                "dtype": str(t.dtype).replace("torch.", ""),
                "shape": list(t.shape),
                "stats": None if t.is_complex() else tensor_stats(t),
                "shard": None,
                "reduction": "full",
                "writer": self.writer_id,
            }
            for k in ("call", "invocation", "phase", "step", "layer", "layer_class"):
                record[k] = meta.get(k)
            for k in ("module_class", "module_path", "io"):
                record[k] = meta.get(k)
            record["io"] = record["io"] or "out"
            record["shard"] = meta.get("shard")
            record["reduction"] = meta.get("reduction") or "full"
            if "persistent" in meta:  # weight dumps: False for buffers a checkpoint never holds
                record["persistent"] = meta["persistent"]
            if meta.get("extra"):
                record["extra"] = meta["extra"]
            body = t if payload is None else payload.detach().contiguous()
            nbytes = body.numel() * body.element_size()
            if self.mode in ("stats", "sketch") and not always_payload and payload is None:
                self.counts["stats_only"] += 1
            elif (
                not always_payload
                and self.max_bytes is not None
                and self.bytes_written + nbytes > self.max_bytes
            ):
                self.counts["over_budget"] += 1
                record["over_budget"] = True
            else:
                name = f"{seq:06d}_{_SAFE.sub('_', key)[:80]}.safetensors"
                data = safetensors.torch.save({"tensor": body}, metadata={"key": key})
                atomic_write_bytes(os.path.join(self.rank_dir, name), data)
                record["file"] = name
                record["tensor"] = "tensor"
                self.bytes_written += nbytes
                self.counts["written"] += 1
            self._manifest.write(dumps_record(record) + "\n")
            self._manifest.flush()
            return record

    def close(self, complete: bool = True) -> None:
        """Flush the manifest and write `status.json` with the capture counters; `complete=False`
        when captures were lost (a write failed in the background writer), so readers say so."""
        with self._lock:
            if self._manifest.closed:
                return
            self._manifest.flush()
            os.fsync(self._manifest.fileno())
            self._manifest.close()
            atomic_write_json(
                os.path.join(self.rank_dir, "status.json"),
                {
                    "records": self.seq,
                    "bytes_written": self.bytes_written,
                    **self.counts,
                    "writer": self.writer_id,
                    "complete": complete,
                },
            )
            self.lock.release()
