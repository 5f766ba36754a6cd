"""What each process of a compare across nodes can read, and the one store every process builds
from it (docs/across-nodes.md).

1. Each process lists the rank directories of both sides it sees (`rankNNN` holding a
   manifest), with a hash of each manifest: node-local disks hold some, a shared filesystem all.
2. The lists are gathered everywhere. A rank directory seen by several processes is one
   directory when its manifests agree (a shared filesystem, two processes of one node, a
   reference copied to every node); else the same name holds different dumps on two nodes,
   which is an error.
3. Each directory's manifest and status are read by one process that sees it (spread over
   them) and gathered everywhere, with the side's run.json.
4. Every process builds the same `SideStore` from those texts (`side_from_texts`, every check of
   a local read): a record whose directory it sees reads its payload here; any other record's
   payload arrives from a process that sees it (`RemotePayload`, `ffdebug.across.run`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from ffdebug.across.group import Group, resolve
from ffdebug.errors import FFDebugError
from ffdebug.io.side import SideStore
from ffdebug.io.sources import StorePayload

MANIFEST = "manifest.jsonl"


@dataclass(frozen=True)
class Home:
    """Where a payload lives: side index (0 ref, 1 target) and its rank directory's name."""

    side: int
    rank_dir: str


@dataclass(frozen=True)
class HomedPayload(StorePayload):
    """A store payload this process reads itself, with its home."""

    home: Home | None = None


@dataclass(frozen=True)
class RemotePayload(StorePayload):
    """A store payload on a directory this process does not see: read from what another process
    sent or answers (`ffdebug.across.run.Received`)."""

    home: Home | None = None

    def load(self):
        from ffdebug.across.run import RECEIVED

        return RECEIVED.load(self)

    def verify(self) -> None:
        """Read by the process that sees it."""


@dataclass
class Seen:
    """What every process sees: per side, rank directory name -> the processes that see it."""

    holders: list[dict[str, list[int]]]
    nodes: list[str]  # per process

    def sees(self, process: int, home: Home) -> bool:
        return process in self.holders[home.side].get(home.rank_dir, ())


def _listing(path: str) -> dict:
    """This process's view of one side: its rank directories with their manifests' sha256."""
    from ffdebug.store.reader import read_manifest_bytes, store_rank_dirs

    if not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path)):
        return {"dirs": {}, "run": False}  # this node holds none of the side (an empty mount point too)
    if not os.path.isdir(path) or not (
        os.path.exists(os.path.join(path, "run.json")) or store_rank_dirs(path)
    ):
        raise FFDebugError(
            f"{path}: compare across nodes reads ffdebug stores (a side directory with rank*/manifest.jsonl); "
            "import a peer dump first with 'ffdebug import'"
        )
    dirs = {}
    for d in store_rank_dirs(path):  # a manifest's content says which dump it is (copies agree)
        dirs[os.path.basename(d)] = hashlib.sha256(read_manifest_bytes(os.path.join(d, MANIFEST))).hexdigest()
    return {"dirs": dirs, "run": os.path.exists(os.path.join(path, "run.json"))}


def open_sides(group: Group, paths: tuple[str, str]) -> tuple[list[SideStore], Seen]:
    """Both sides as one store each, the same on every process."""
    from ffdebug.store.reader import (
        RankDirText,
        read_manifest_bytes,
        read_run_info,
        read_status,
        side_from_texts,
    )

    local = [resolve(p, group) for p in paths]
    views = group.all_gather_checked(lambda: {"node": group.node, "sides": [_listing(p) for p in local]})
    nodes = [v["node"] for v in views]
    holders: list[dict[str, list[int]]] = []
    for s, given in enumerate(paths):
        seen: dict[str, list[int]] = {}
        signature: dict[str, tuple] = {}
        for p, v in enumerate(views):
            for name, sig in v["sides"][s]["dirs"].items():
                if name in signature and sig != signature[name][0]:
                    q = signature[name][1]
                    raise FFDebugError(
                        f"{os.path.join(given, name)}: node {nodes[q]} and node {nodes[p]} hold different "
                        "dumps under this rank directory (their manifests differ); each rank's directory "
                        "must be on one node, or the same on a shared filesystem"
                    )
                signature.setdefault(name, (sig, p))
                seen.setdefault(name, []).append(p)
        if not seen and not any(v["sides"][s]["run"] for v in views):
            raise FFDebugError(f"{given}: no process of the group sees this side (no rank directories)")
        holders.append(seen)
    group.holdings = {
        p: (
            nodes[p],
            [os.path.join(paths[s], n) for s in (0, 1) for n, ps in sorted(holders[s].items()) if p in ps],
        )
        for p in range(group.size)
    }
    # each directory read by one of the processes that see it, spread in name order

    def read_mine() -> dict:
        texts: dict = {"sides": [{}, {}], "run": [None, None]}
        for s in (0, 1):
            for i, (name, ps) in enumerate(sorted(holders[s].items())):
                if ps[i % len(ps)] == group.rank:
                    d = os.path.join(local[s], name)
                    manifest = read_manifest_bytes(os.path.join(d, MANIFEST)).decode("latin-1")
                    texts["sides"][s][name] = [manifest, read_status(d)]
            runs = [p for p, v in enumerate(views) if v["sides"][s]["run"]]
            if runs and runs[0] == group.rank:
                texts["run"][s] = read_run_info(local[s])
        return texts

    gathered = group.all_gather_checked(read_mine, nodes)
    stores = []
    for s in (0, 1):
        run = next((g["run"][s] for g in gathered if g["run"][s] is not None), {})
        rank_dirs = []
        for name in sorted(holders[s]):
            manifest, status = next(g["sides"][s][name] for g in gathered if name in g["sides"][s])
            home = Home(s, name)
            mine = group.rank in holders[s][name]
            where = os.path.join(local[s] if mine else paths[s], name)

            def payload_of(path, tensor, home=home, mine=mine):
                return (HomedPayload if mine else RemotePayload)(path, tensor, home)

            rank_dirs.append(RankDirText(where, manifest.encode("latin-1"), status, payload_of))
        stores.append(side_from_texts(paths[s], run, rank_dirs))
    return stores, Seen(holders, nodes)
