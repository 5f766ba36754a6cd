"""The process group of a compare run across nodes (`torchrun … -m ffdebug compare`): gloo over
the environment torchrun sets, JSON and byte messages between processes, the deadline, and who
was lost when a peer stops answering (docs/across-nodes.md).

Every message is JSON text or raw payload bytes in a uint8 tensor: nothing is pickled. Each
process beats on the rendezvous store (`beat/<rank>`) once a second; when a collective fails,
rank 0 names the processes whose beat stopped, with the node and the rank directories each held.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

from ffdebug.errors import FFDebugError

DEFAULT_TIMEOUT_S = 300.0  # FFDEBUG_ACROSS_TIMEOUT: how long a process waits for a peer
BEAT_S = 1.0  # heartbeat period on the store
POLL_S = 0.01  # how often a payload request / answer is looked for on the store
STORE_VALUE_BYTES = 4 << 20  # a payload answer goes in store values of at most this (the store caps them)


class PeerLost(FFDebugError):
    """A process of the group stopped answering after the group formed: exit 4 (incomplete)."""

    exit_code = 4


def timeout_s(environ=None) -> float:
    """The deadline of one exchange: FFDEBUG_ACROSS_TIMEOUT seconds (default 300) times
    FFDEBUG_TIMEOUT_FACTOR (default 1; slow test machines raise it)."""
    env = os.environ if environ is None else environ
    out = 1.0
    for name, default in (("FFDEBUG_ACROSS_TIMEOUT", DEFAULT_TIMEOUT_S), ("FFDEBUG_TIMEOUT_FACTOR", 1.0)):
        raw = env.get(name)
        try:
            value = float(raw) if raw not in (None, "") else default
        except ValueError:
            raise FFDebugError(f"{name}={raw!r}: not a number of seconds; e.g. {name}=300") from None
        if not value > 0:
            raise FFDebugError(f"{name}={raw!r}: must be positive")
        out *= value
    return out


def world_size(environ=None) -> int:
    """WORLD_SIZE as torchrun sets it (1 when unset)."""
    env = os.environ if environ is None else environ
    raw = env.get("WORLD_SIZE", "1")
    try:
        n = int(raw)
    except ValueError:
        raise FFDebugError(f"WORLD_SIZE={raw!r}: not an integer; launch with torchrun") from None
    if n < 1:
        raise FFDebugError(f"WORLD_SIZE={raw!r}: must be at least 1")
    return n


def launched(environ=None) -> bool:
    """This process is one of a group torchrun (or a scheduler) launched: WORLD_SIZE > 1 and
    MASTER_ADDR set. WORLD_SIZE alone (left in a shell by a training job) is not a launch."""
    env = os.environ if environ is None else environ
    return bool(env.get("MASTER_ADDR")) and world_size(env) > 1


def node_roots(environ=None) -> list[str] | None:
    """FFDEBUG_TEST_NODE_ROOTS (a test hook): one directory per process, os.pathsep-separated;
    process i resolves the relative input paths under the i-th, and processes sharing one stand
    for one node. None when unset."""
    env = os.environ if environ is None else environ
    raw = env.get("FFDEBUG_TEST_NODE_ROOTS")
    return raw.split(os.pathsep) if raw else None


@dataclass
class Group:
    """This process's place in the group and the exchanges it takes part in."""

    rank: int
    size: int
    node: str  # the node's name (hostname, or the test hook's root)
    timeout: float
    store: object = field(repr=False)
    holdings: dict = field(default_factory=dict)  # process -> (node, rank directories), for messages
    sent_bytes: int = 0  # payload bytes this process sent to others
    moved: object = None  # what crossed, once the results are gathered (`ffdebug.across.run.Moved`)
    prefix: str = "ffdebug/"  # the store keys of this run (a torchrun restart gets fresh ones)
    _beats: int = 0
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    # -- messages ---------------------------------------------------------------------------------

    def all_gather_json(self, obj) -> list:
        """Every process's `obj`, in process order (JSON text; floats round-trip exactly)."""
        data = json.dumps(obj, allow_nan=True).encode()
        return [json.loads(b.decode()) for b in self.all_gather_bytes(data)]

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        import torch
        import torch.distributed as dist

        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._call(dist.all_gather, sizes, torch.tensor([len(data)], dtype=torch.int64))
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.size)]
        self._call(dist.all_gather, out, mine)
        return [bytes(o[: int(s)].numpy()) for o, s in zip(out, sizes)]

    def send_bytes(self, data, to: int) -> None:
        """`data` (bytes, or a contiguous uint8 numpy array: sent without a copy) to process `to`."""
        import numpy as np
        import torch
        import torch.distributed as dist

        buf = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray)) else data
        self._call(dist.send, torch.tensor([buf.size], dtype=torch.int64), to)
        if buf.size:
            self._call(dist.send, torch.from_numpy(buf) if buf.flags.writeable else torch.tensor(buf), to)
        self.sent_bytes += int(buf.size)

    def recv_bytes(self, source: int):
        """The next message from `source`, as a uint8 numpy array."""
        import torch
        import torch.distributed as dist

        size = torch.zeros(1, dtype=torch.int64)
        self._call(dist.recv, size, source)
        buf = torch.empty(int(size), dtype=torch.uint8)
        if int(size):
            self._call(dist.recv, buf, source)
        return buf.numpy()

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except RuntimeError as err:  # gloo: a peer closed its connection, or the deadline passed
            raise self.lost(err) from None

    # -- errors on one process ----------------------------------------------------------------

    def all_gather_checked(self, step, nodes: list[str] | None = None) -> list:
        """`step()` here, its value gathered from every process; an error raised by `step` on any
        process (a file it alone reads) is raised on every process, the first process's first, so
        the group ends on the error itself rather than on its peers leaving."""
        value, error = None, None
        try:
            value = step()
        except PeerLost:
            raise
        except FFDebugError as err:
            error = {"message": str(err), "code": err.exit_code}
            raised = err
        except Exception as err:  # a bug: raised as itself here, named on the others
            error = {"message": f"{type(err).__name__}: {err}", "code": 2}
            raised = err
        gathered = self.all_gather_json({"value": value, "error": error})
        for p, g in enumerate(gathered):
            if g["error"] is None:
                continue
            if p == self.rank:
                raise raised
            where = nodes[p] if nodes else f"process {p}"
            err = FFDebugError(f"{where}: {g['error']['message']}")
            err.exit_code = g["error"]["code"]
            raise err
        return [g["value"] for g in gathered]

    # -- liveness ---------------------------------------------------------------------------------

    def start_beating(self) -> None:
        """A counter and the node's name on the store, advanced every `BEAT_S` (a counter, not a
        time: the nodes' clocks need not agree)."""

        def one() -> None:
            self._beats += 1
            self.store.set(f"{self.prefix}beat/{self.rank}", json.dumps([self._beats, self.node]))

        def beat() -> None:
            while not self._stop.wait(BEAT_S):
                try:
                    one()
                except Exception:  # the store's host is gone: the collectives report it
                    return

        one()
        threading.Thread(target=beat, name="ffdebug-beat", daemon=True).start()

    def _beat_of(self, p: int) -> tuple[int, str]:
        try:
            count, node = json.loads(self.store.get(f"{self.prefix}beat/{p}").decode())
            return int(count), str(node)
        except Exception:
            return -1, "?"

    def silent(self) -> dict[int, str]:
        """process -> node of the peers whose beat did not advance over three periods."""
        before = {p: self._beat_of(p) for p in range(self.size) if p != self.rank}
        time.sleep(3 * BEAT_S)
        return {p: node for p, (count, node) in before.items() if self._beat_of(p)[0] <= count}

    def wait_for_peers(self, key: str) -> None:
        """Mark `key` done here and wait until every process has, for as long as each missing one
        still beats: the deadline measures a peer's silence, not its work."""
        self.store.set(f"{self.prefix}{key}/{self.rank}", b"1")
        missing = [p for p in range(self.size) if p != self.rank]
        checked = time.monotonic()
        while True:
            missing = [p for p in missing if not self.store.check([f"{self.prefix}{key}/{p}"])]
            if not missing:
                return
            if time.monotonic() - checked > min(self.timeout, 5.0):
                if set(self.silent()) & set(missing):
                    raise self.lost(TimeoutError(f"process(es) {missing} stopped beating"))
                checked = time.monotonic()
            time.sleep(10 * POLL_S)

    def lost(self, err: BaseException) -> FFDebugError:
        """The error for a failed exchange: the processes whose beat stopped, each with its node and
        the rank directories it held (a peer that exited, or a node that went away)."""
        gone = self.silent()
        if not gone:
            return PeerLost(
                f"compare across nodes: an exchange failed after {self.timeout:.0f} s or with "
                f"{str(err).splitlines()[0][:160]}; every peer still beats — raise FFDEBUG_ACROSS_TIMEOUT "
                "if a node is slow to read its dumps"
            )
        parts = []
        for p, node in sorted(gone.items()):
            dirs = self.holdings.get(p, (node, []))[1]
            held = ", ".join(dirs) if dirs else "no rank directories"
            parts.append(f"process {p} on node {node} (held {held})")
        return PeerLost(
            "compare across nodes: lost " + "; ".join(parts) + " — the comparison is incomplete; "
            "re-run when the node is back (a node that never joins is torchrun's rendezvous timeout)"
        )

    # -- payloads on demand --------------------------------------------------------------------

    def serve(self, answer) -> None:
        """Answer payload requests from other processes on a thread (`fetch`): `answer(request)`
        gives (header dict, bytes), stored in values of at most `STORE_VALUE_BYTES`. Used for what
        is read outside the plan (token ids, masks, sequence lengths before it; a fold's parts);
        the compared tensors move in bulk (`ffdebug.across.run`)."""

        def loop() -> None:
            n = 1
            while not self._stop.is_set():
                key = f"{self.prefix}req/{self.rank}/{n}"
                try:
                    asked = self.store.check([key])
                    if not asked:
                        self._stop.wait(POLL_S)
                        continue
                    request = json.loads(self.store.get(key).decode())
                    self.store.delete_key(key)
                    try:
                        header, data = answer(request)
                    except Exception as err:  # the asker reports it
                        header, data = {"error": str(err)[:300]}, b""
                    parts = [data[i : i + STORE_VALUE_BYTES] for i in range(0, len(data), STORE_VALUE_BYTES)]
                    for k, part in enumerate(parts):
                        self.store.set(f"{self.prefix}resp/{request['id']}/{k}", part)
                    self.store.set(
                        f"{self.prefix}resp/{request['id']}", json.dumps({**header, "parts": len(parts)})
                    )
                except Exception as err:  # the store failed under us: said here, the exchange reports it
                    if not self._stop.is_set():
                        print(
                            f"ffdebug: process {self.rank} stopped answering payload requests: {err}",
                            file=sys.stderr,
                        )
                    return
                n += 1

        threading.Thread(target=loop, name="ffdebug-serve", daemon=True).start()

    def fetch(self, holder: int, request: dict) -> tuple[dict, bytes]:
        """One payload from process `holder` (its `serve` thread), within the deadline (the ticket
        makes each request's keys unique, so threads may fetch together)."""
        ticket = self.store.add(f"{self.prefix}reqcount/{holder}", 1)
        rid = f"{self.rank}-{holder}-{ticket}"
        asked = json.dumps({**request, "from": self.rank, "id": rid})
        self.store.set(f"{self.prefix}req/{holder}/{ticket}", asked)
        key = f"{self.prefix}resp/{rid}"
        deadline = time.monotonic() + self.timeout
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise self.lost(TimeoutError(f"no answer from process {holder} in {self.timeout:.0f} s"))
            time.sleep(POLL_S)
        header = json.loads(self.store.get(key).decode())
        self.store.delete_key(key)
        if "error" in header:
            raise FFDebugError(f"process {holder} could not read {request.get('file')}: {header['error']}")
        parts = []
        for k in range(header.pop("parts")):
            parts.append(self.store.get(f"{key}/{k}"))
            self.store.delete_key(f"{key}/{k}")
        data = b"".join(parts)
        return header, data

    def close(self) -> None:
        import torch.distributed as dist

        self._stop.set()
        if dist.is_initialized():
            dist.destroy_process_group()


def join(environ=None) -> Group:
    """Join the group torchrun launched (gloo, CPU tensors only; the payloads never touch a GPU)."""
    from datetime import timedelta

    import torch.distributed as dist

    env = os.environ if environ is None else environ
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if name not in env:
            raise FFDebugError(
                f"WORLD_SIZE={env.get('WORLD_SIZE')} but {name} is not set: launch with "
                "torchrun (docs/across-nodes.md)"
            )
    limit = timeout_s(env)
    dist.init_process_group("gloo", timeout=timedelta(seconds=limit))
    store = dist.distributed_c10d._get_default_store()
    roots = node_roots(env)
    rank = dist.get_rank()
    if roots is not None and len(roots) != dist.get_world_size():
        raise FFDebugError(
            f"FFDEBUG_TEST_NODE_ROOTS: {len(roots)} roots for {dist.get_world_size()} processes; give one each"
        )
    node = roots[rank] if roots is not None else socket.gethostname()
    run = f"{env.get('TORCHELASTIC_RUN_ID', '')}.{env.get('TORCHELASTIC_RESTART_COUNT', '0')}.{env['MASTER_PORT']}"
    size = dist.get_world_size()
    g = Group(rank=rank, size=size, node=node, timeout=limit, store=store, prefix=f"ffdebug/{run}/")
    g.start_beating()
    return g


def resolve(path: str, group: Group | None, environ=None) -> str:
    """`path` as this process reads it: under the test hook, a relative path is taken under this
    process's root."""
    roots = node_roots(environ)
    if group is None or roots is None or os.path.isabs(path):
        return path
    return os.path.join(roots[group.rank], path)
