"""Write any opened side (a peer dump read by an importer) as an ffdebug store: `ffdebug import`.

Records keep their key, layer, call, phase, step tags, rank, io and the importer's `extra`; each
rank's records go through `StoreWriter` (atomic payloads, manifest). `run.json` says where the
dump came from (`imported`), so its side reports `finished: null`, and carries the importer's
problems (`import_problems`), which block exit 0 as they would on the peer dump itself.
"""

from __future__ import annotations

from ffdebug.arrays import to_torch
from ffdebug.io.side import SideStore
from ffdebug.store.writer import StoreWriter

_META = ("call", "invocation", "phase", "step", "layer", "layer_class", "module_class", "module_path", "io")


def write_store(store: SideStore, side_dir: str, side: str, source: str, overwrite: bool) -> dict:
    """Write `store` to `side_dir`; a summary dict (side, path, records, format, problems)."""
    problems = list(store.problems)
    stats_only = [r for r in store.records if not r.has_payload]
    if stats_only:
        problems.append(f"{len(stats_only)} record(s) held statistics only and were not imported")
    ranks = sorted({r.rank for r in store.records} | {0})
    world = max([r.world_size or 1 for r in store.records] + [ranks[-1] + 1])
    extra = {"imported": {"from": source, "format": store.kind}, "import_problems": problems}
    writers: dict[int, StoreWriter] = {}
    try:
        for rank in ranks:  # rank 0 first: it writes run.json
            writers[rank] = StoreWriter(
                side_dir,
                side,
                rank=rank,
                world_size=world,
                overwrite=overwrite,
                overwrite_variable="--overwrite",
                run_extra=extra,
            )
        n = 0
        for rec in store.records:
            if not rec.has_payload:
                continue
            meta = {k: getattr(rec, k) for k in _META}
            meta["shard"] = rec.shard.to_json() if rec.shard else None
            meta["reduction"] = rec.reduction
            meta["extra"] = dict(rec.extra, **({"file": rec.file} if rec.file else {}))
            if rec.fold is not None:
                meta["extra"]["folded_from_ranks"] = [p.rank for p in rec.parts]
            writers[rec.rank].write(rec.key, to_torch(rec.load()), meta)
            n += 1
    except BaseException:
        for w in writers.values():  # no status.json: the store reads as cut short
            w.lock.release()
        raise
    for w in writers.values():
        w.close()
    return {"side": side, "path": side_dir, "records": n, "format": store.kind, "problems": problems}
