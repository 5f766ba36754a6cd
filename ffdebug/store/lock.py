"""One writer per rank directory: `rankNNN/writer.lock`, created exclusively (docs/architecture.md,
"Hostile stores").

The lock file holds the writer's identity: host, pid, the process's start time (to tell a reused
pid from the writer) and the time the writer claimed the directory. `writer_id` is written into
every record the writer appends, so a reader can tell two writers' records apart. A lock whose
process is gone (same host, pid dead or started at another time) is stale: the run was killed; it
is named in the error, and replaced only with overwrite. A lock of another host cannot be checked
and is treated as live.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass

from ffdebug.errors import FFDebugError

LOCK_NAME = "writer.lock"


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (Linux), else None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            text = f.read()
        return text.rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class WriterIdentity:
    host: str
    pid: int
    process_start: str | None
    claimed_ns: int

    @property
    def writer_id(self) -> str:
        return f"{self.host}:{self.pid}:{self.claimed_ns}"

    def to_json(self) -> dict:
        return {
            "writer": self.writer_id,
            "host": self.host,
            "pid": self.pid,
            "process_start": self.process_start,
            "claimed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.claimed_ns / 1e9)),
            "claimed_ns": self.claimed_ns,
        }

    @classmethod
    def current(cls) -> WriterIdentity:
        pid = os.getpid()
        return cls(socket.gethostname(), pid, _process_start(pid), time.time_ns())

    def is_live(self) -> bool:
        """The process still runs (this host only; another host's writer counts as live)."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        start = _process_start(self.pid)
        return start is None or self.process_start is None or start == self.process_start

    def describe(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.claimed_ns / 1e9))
        return f"writer {self.writer_id} (host {self.host}, pid {self.pid}, since {since})"


def _read_lock(path: str) -> WriterIdentity | None:
    """The identity in a lock file; None when it is unreadable (half-written: treated as stale)."""
    from ffdebug.io.contained import read_json

    try:
        obj = read_json(path, "writer lock", limit=4096)
        return WriterIdentity(
            str(obj["host"]), int(obj["pid"]), obj.get("process_start"), int(obj["claimed_ns"])
        )
    except (FFDebugError, KeyError, TypeError, ValueError, AttributeError):
        return None


class WriterLock:
    """The claim of one rank directory by this writer; `release()` at close."""

    def __init__(self, rank_dir: str, identity: WriterIdentity) -> None:
        self.rank_dir = rank_dir
        self.path = os.path.join(rank_dir, LOCK_NAME)
        self.identity = identity
        self.held = False

    def _create(self) -> bool:
        """Write the identity to a private file, then hard-link it to the lock name: the link is
        the exclusive step, so a lock file is never seen half-written."""
        tmp = f"{self.path}.{os.getpid()}.{self.identity.claimed_ns}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(self.identity.to_json()) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            return False
        finally:
            os.remove(tmp)
        self.held = True
        return True

    def claim(self, overwrite: bool, variable: str) -> None:
        """Take the directory, or raise naming the writer that holds it. A stale lock is replaced
        only with `overwrite`; a live one never."""
        for _ in range(3):  # a racing writer may take a stale lock between our checks
            if self._create():
                return
            other = _read_lock(self.path)
            if other is not None and other.is_live():
                raise FFDebugError(
                    f"{self.rank_dir} is being written by live {other.describe()}: two writers on one side "
                    "would mix two runs — give this run another FFDEBUG_FWD_DUMP_SIDE or directory "
                    f"(if that process is gone, delete {self.path})"
                )
            what = other.describe() if other is not None else "an unreadable lock"
            if not overwrite:
                raise FFDebugError(
                    f"{self.rank_dir}: stale lock of {what}, whose process is gone (a killed run); "
                    f"set {variable}=1 to replace that dump, or choose another directory"
                )
            # Rename, never delete, the stale lock: of two racing writers only one rename succeeds.
            aside = f"{self.path}.stale.{os.getpid()}"
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:
                continue
            moved = _read_lock(aside)
            if moved is not None and (other is None or moved.writer_id != other.writer_id):
                try:  # a racing writer's fresh lock was moved: put it back and let it be
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
                os.remove(aside)
                raise FFDebugError(
                    f"{self.rank_dir} is being written by live {moved.describe()}: two writers on one side "
                    "would mix two runs — give this run another FFDEBUG_FWD_DUMP_SIDE or directory"
                )
            os.remove(aside)
        raise FFDebugError(f"{self.rank_dir}: could not claim {self.path}: other writers keep taking it")

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


def live_writer(rank_dir: str) -> WriterIdentity | None:
    """The live writer holding `rank_dir`, if any."""
    path = os.path.join(rank_dir, LOCK_NAME)
    if not os.path.lexists(path):
        return None
    other = _read_lock(path)
    return other if other is not None and other.is_live() else None
