"""Who compares what in a compare across nodes, the payloads that move, and the results that come
back (docs/across-nodes.md).

Every process paired the same stores the same way, so it holds the same unit list and computes
the same plan without a message:

- **Owners.** Units go to processes in groups: a call with router scores whole (its routing-flip
  explanation reads the call's stages together, `routing.may_explain`); else all units of one
  reference call and one target rank together, and each unit over several target ranks (a fold,
  replicas) on its own. A group goes to a process that sees the most of its payload bytes, the
  least loaded among those, then the lowest-numbered; on a shared filesystem that spreads the
  groups over every process and each payload is read once.
- **Moves.** A payload its owner cannot see (a single-rank reference on another node, a
  tensor-parallel group across nodes) is sent to it once by a process that sees it, the least
  loaded sender first: raw bytes plus dtype and shape, written to a spill directory on the owner
  and read from there like a store payload. The moves run in one global order, so every pair of
  processes meets at the same send / receive (no deadlock).
- **Results.** Each process compares its own units (`_map_units`, its own workers), explains
  routing flips over them, and the stage results travel as their wire form (`ffdebug.across.wire`)
  to every process, which assembles them in unit order; the verdict, coverage and exit code are
  then computed as in a single-process compare.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field

from ffdebug.across.group import Group, PeerLost
from ffdebug.across.inventory import Home, RemotePayload, Seen
from ffdebug.errors import FFDebugError


@dataclass
class Received:
    """The payloads this process received: (home, file, tensor) -> (spill file, dtype, shape);
    one it was not sent is asked of a process that sees it (`Group.fetch`: the small inputs the
    pairing and the gates read before the plan)."""

    spill: str | None = None
    files: dict = field(default_factory=dict)
    group: Group | None = None
    seen: Seen | None = None
    local: dict = field(default_factory=dict)  # key -> this process's own source, for `answer`
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # worker threads load

    def attach(self, group: Group, seen: Seen, stores) -> None:
        self.group, self.seen = group, seen
        for store in stores:
            for rec in store.records:
                for leaf in leaves(rec):
                    if not isinstance(leaf.source, RemotePayload):
                        self.local[_key(leaf.source)] = leaf.source
        group.serve(self.answer)

    def answer(self, request: dict) -> tuple[dict, bytes]:
        from ffdebug.arrays import as_array

        key = (Home(request["side"], request["rank_dir"]), request["file"], request["tensor"])
        x = as_array(self.local[key].load())
        return {"dtype": str(x.dtype), "shape": list(x.shape)}, _raw(x).tobytes()

    def put(self, src: RemotePayload, data: bytes, dtype: str, shape: list[int]) -> None:
        if self.spill is None:
            self.spill = tempfile.mkdtemp(prefix="ffdebug-across-")
        path = os.path.join(self.spill, f"{len(self.files):06d}.bin")
        with open(path, "wb") as f:
            f.write(memoryview(data))
        self.files[_key(src)] = (path, dtype, tuple(shape))

    def load(self, src: RemotePayload):
        import numpy as np

        from ffdebug.arrays import dtype as np_dtype

        with self._lock:  # one fetch and one spill file per payload, whichever thread asks first
            got = self.files.get(_key(src))
            if got is None and self.group is not None:
                holders = self.seen.holders[src.home.side].get(src.home.rank_dir, [])
                if holders:
                    home, file, tensor = _key(src)
                    request = {"side": home.side, "rank_dir": home.rank_dir, "file": file, "tensor": tensor}
                    header, data = self.group.fetch(holders[0], request)
                    self.put(src, data, header["dtype"], header["shape"])
                    got = self.files[_key(src)]
        if got is None:
            raise FFDebugError(
                f"{src.path}: this process does not see {src.home.rank_dir} and was not sent the payload; "
                "an internal error of the compare across nodes — run the comparison on one node"
            )
        path, dtype, shape = got
        return np.fromfile(path, dtype=np_dtype(dtype)).reshape(shape)

    def clear(self) -> None:
        if self.spill is not None:
            shutil.rmtree(self.spill, ignore_errors=True)
        self.spill, self.files = None, {}


def _raw(x):
    """The bytes of an array in C order, as a uint8 array (a view when `x` is contiguous)."""
    import numpy as np

    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


RECEIVED = Received()


def _key(src) -> tuple:
    return (src.home, os.path.basename(src.path), src.name)


def leaves(rec) -> list:
    """The records whose payload files `rec` reads (its parts, for a folded record)."""
    parts = rec.parts
    if not parts:
        return [rec] if rec.source is not None else []
    return [leaf for p in parts for leaf in leaves(p)]


@dataclass(frozen=True)
class Moved:
    """What crossed between processes: payload bytes (moves and on-demand inputs), the results'
    wire form (each process's, sent to every process), the number of moves, the nodes."""

    payload_bytes: int
    result_bytes: int
    moves: int
    nodes: int

    def sentence(self, processes: int) -> str:
        return (
            f"compare across nodes: {processes} processes on {self.nodes} node(s); {self.payload_bytes} payload "
            f"bytes moved between processes ({self.moves} tensors moved whole), {self.result_bytes} bytes of results"
        )


@dataclass(frozen=True)
class Move:
    """One payload sent from `src` to `dst`."""

    src: int
    dst: int
    record: object  # the receiver's record (its source is a RemotePayload)
    nbytes: int


@dataclass
class Plan:
    owner: list[int]  # per unit
    moves: list[Move]


def _read_by(unit) -> list:
    """The payload files comparing `unit` may read: its paired records', and for replicas every
    one with the reference (a fold that explains replicas that disagree reads them all, whatever
    their shapes; `engine._compare_unit`)."""
    recs = unit.payload_records()
    if unit.replicas and unit.ref.has_payload and all(p.has_payload for p in unit.replicas):
        recs = [unit.ref, *unit.replicas]
    return [leaf for rec in recs for leaf in leaves(rec)]


def _routed_calls(units: list) -> set[int]:
    """ids of the reference call groups with a stage the routing explanation acts on
    (`routing.may_explain`, from the records' shapes and dtypes, per target rank)."""
    from ffdebug.comparison.engine import stage_result
    from ffdebug.comparison.routing import may_explain

    by_call: dict[tuple, list] = {}
    for u in units:
        e = stage_result(u.sk[0], u.ref, u.target)
        by_call.setdefault((id(u.group), e.rank), []).append(e)
    return {key[0] for key, stages in by_call.items() if may_explain(stages)}


def plan(units: list, seen: Seen, size: int) -> Plan:
    """Owners per unit and the payload moves (module doc); the same on every process."""
    from ffdebug.io.prefetch import record_bytes

    groups: dict[tuple, list[int]] = {}
    group_index: dict[int, int] = {}
    whole = _routed_calls(units)
    for i, u in enumerate(units):
        g = group_index.setdefault(id(u.group), len(group_index))
        ranks = u.target_ranks
        if id(u.group) in whole:  # a call whose routing flips may be explained: on one process
            key: tuple = (g,)
        elif len(ranks) == 1:  # one target rank's units of a call together
            key = (g, next(iter(ranks)))
        else:  # a unit over several ranks (a fold, replicas) on its own
            key = ("unit", i)
        groups.setdefault(key, []).append(i)
    load = [0] * size
    owner = [0] * len(units)
    for members in groups.values():
        need: dict[Home, int] = {}
        for i in members:
            for leaf in _read_by(units[i]):
                need[leaf.source.home] = need.get(leaf.source.home, 0) + record_bytes(leaf)
        total = sum(need.values())
        local = [sum(b for h, b in need.items() if seen.sees(p, h)) for p in range(size)]
        best = max(local)
        o = min((p for p in range(size) if local[p] == best), key=lambda p: (load[p], p))
        load[o] += total
        for i in members:
            owner[i] = o
    sent = [0] * size
    moves: list[Move] = []
    done: set = set()
    for i, u in enumerate(units):
        o = owner[i]
        for leaf in _read_by(u):
            home = leaf.source.home
            if seen.sees(o, home) or (o, _key(leaf.source)) in done:
                continue
            holders = seen.holders[home.side].get(home.rank_dir, [])
            if not holders:
                raise FFDebugError(f"{leaf.origin}: no process of the group sees {home.rank_dir}")
            src = min(holders, key=lambda p: (sent[p], p))
            sent[src] += record_bytes(leaf)
            done.add((o, _key(leaf.source)))
            moves.append(Move(src, o, leaf, record_bytes(leaf)))
    return Plan(owner, moves)


def run_moves(group: Group, moves: list[Move], mine: dict) -> None:
    """Every move in order: the sender reads the payload and sends it, the receiver spills it. A
    payload its sender cannot read travels as its error, and the moves go on (every process then
    raises it, `Group.all_gather_checked`); the first such error is raised here at the end."""
    from ffdebug.arrays import as_array

    failed: Exception | None = None
    for mv in moves:
        if mv.src == group.rank:
            try:
                x = as_array(mine[_key(mv.record.source)].load())
                header, data = {"dtype": str(x.dtype), "shape": list(x.shape)}, _raw(x)
            except Exception as err:
                failed = failed or err
                header, data = {"error": str(err)}, b""
            group.send_bytes(json.dumps(header).encode(), mv.dst)
            group.send_bytes(data, mv.dst)
        elif mv.dst == group.rank:
            header = json.loads(group.recv_bytes(mv.src).tobytes().decode())
            data = group.recv_bytes(mv.src)
            if "error" not in header:
                RECEIVED.put(mv.record.source, data, header["dtype"], header["shape"])
    if failed is not None:
        raise failed


@dataclass
class Across:
    """A compare across nodes once the stores are open: the group, what each process sees, the
    two stores (the same on every process)."""

    group: Group
    seen: Seen
    stores: list

    @classmethod
    def open(cls, group: Group, paths: tuple[str, str], noise=None) -> Across:
        from ffdebug.across.inventory import open_sides

        if noise is not None:
            raise FFDebugError(
                "--noise: not supported by a compare across nodes yet; run the comparison with a noise "
                "run on one node"
            )
        stores, seen = open_sides(group, paths)
        RECEIVED.attach(group, seen, stores)
        return cls(group, seen, stores)

    @classmethod
    def wrap(cls, group: Group | None, ref, target, noise=None) -> tuple:
        """(ref store, target store, Across) of the two paths, each process reading what it sees
        of them; (ref, target, None) as given without a group."""
        if group is None:
            return ref, target, None
        across = cls.open(group, (ref, target), noise)
        return across.stores[0], across.stores[1], across

    def map(self, units: list, run_local, explain_local) -> list[tuple]:
        return map_units(self.group, self.seen, self.stores, units, run_local, explain_local)


def map_units(group: Group, seen: Seen, stores, units: list, run_local, explain_local) -> list[tuple]:
    """`_map_units` across the group: the results of every unit, in unit order, on every process.
    `run_local(indices)` compares this process's units; `explain_local(results, records)` explains
    routing over them before they are sent."""
    from ffdebug.across import wire
    from ffdebug.comparison.forked import record_refs, resolve_refs

    p = plan(units, seen, group.size)
    if os.environ.get("FFDEBUG_TEST_LOSE_PROCESS") == str(group.rank):  # test hook: a node lost mid-run
        os._exit(17)

    def compare_own() -> dict:
        try:
            run_moves(group, p.moves, RECEIVED.local)
            own = [i for i, o in enumerate(p.owner) if o == group.rank]
            done = run_local(own)
        except PeerLost:
            raise
        except Exception:
            group.wait_for_peers("compared")  # the others finish, then hear of this error
            raise
        group.wait_for_peers("compared")  # every process's work done: then gather
        stages = [e for results, _, _ in done for e in results]
        explain_local(stages, [r for _, recs, _ in done for r in recs])
        payload = {
            str(i): {
                "results": [wire.stage_to_wire(e) for e in results],
                "refs": wire.refs_to_wire(record_refs(units[i].own_records(), recs)),
                "reading": reading,
            }
            for i, (results, recs, reading) in zip(own, done)
        }
        return {"units": payload, "moved": group.sent_bytes, "results": len(json.dumps(payload))}

    try:
        gathered = group.all_gather_checked(compare_own, seen.nodes)
    finally:
        RECEIVED.clear()
    group.moved = Moved(
        payload_bytes=sum(g["moved"] for g in gathered),
        result_bytes=sum(g["results"] for g in gathered),
        moves=len(p.moves),
        nodes=len(set(seen.nodes)),
    )
    gathered = [g["units"] for g in gathered]
    out: list = [None] * len(units)
    for part in gathered:
        for k, v in part.items():
            i = int(k)
            out[i] = (
                [wire.stage_from_wire(e) for e in v["results"]],
                resolve_refs(units[i].own_records(), wire.refs_from_wire(v["refs"])),
                v["reading"],
            )
    missing = [i for i, x in enumerate(out) if x is None]
    if missing:
        raise FFDebugError(f"compare across nodes: {len(missing)} stage units came back from no process")
    return out
