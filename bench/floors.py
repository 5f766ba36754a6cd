"""The floors the analysis benchmarks measure ffdebug against, run as their own processes; numpy
only (no torch, no ffdebug), every tensor read as float32 over a mapping of its file.

    python bench/floors.py read     STORE_OR_FILE ...     touch every 4 KiB page (the read floor)
    python bench/floors.py sum      STORE_OR_FILE ...     sum every value, one thread (`sum-all`)
    python bench/floors.py float64  WORKERS REF TARGET    the float64 compute floor
    python bench/floors.py naive    REF TARGET            whole-tensor float64 cos, rel, max |a - b|

A STORE is an ffdebug dump side (`rank*/…safetensors`, one tensor each); a FILE a safetensors file
of many tensors. The float64 compute floor reads every tensor pair (matched by name) in chunks of
64 Ki elements converted to float64 and takes one dot product per pair, on WORKERS forked
processes: the least any float64 comparison of the two sides does (issue "Analysis without
torch").
"""

from __future__ import annotations

import glob
import json
import mmap
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import numpy as np

CHUNK = 1 << 16


def _mapped(path: str) -> dict:
    """name -> float32 array over a read-only mapping of the safetensors file `path`."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    out = {}
    for name, info in sorted(header.items()):
        if name != "__metadata__":
            begin, end = info["data_offsets"]
            out[name] = np.frombuffer(mm, np.float32, (end - begin) // 4, 8 + n + begin)
    return out


def _files(source: str) -> list[str]:
    if os.path.isdir(source):
        return sorted(glob.glob(os.path.join(source, "rank*", "*.safetensors")))
    return [source]


def tensors(source: str):
    """(name, array) of every tensor of a store side or a safetensors file, in name order."""
    for path in _files(source):
        for name, x in _mapped(path).items():
            yield (os.path.basename(path) if os.path.isdir(source) else name), x


def _tensor(source: str, name: str):
    if os.path.isdir(source):
        return next(iter(_mapped(os.path.join(glob.glob(os.path.join(source, "rank*"))[0], name)).values()))
    return _mapped(source)[name]


def _dot64(pair: tuple[str, str, str]) -> float:
    ref, tgt, name = pair
    a, b = _tensor(ref, name), _tensor(tgt, name)
    ra, rb, dot = np.empty(CHUNK), np.empty(CHUNK), 0.0
    for j in range(0, a.shape[0], CHUNK):
        m = min(CHUNK, a.shape[0] - j)
        np.copyto(ra[:m], a[j : j + m])
        np.copyto(rb[:m], b[j : j + m])
        dot += float(np.dot(ra[:m], rb[:m]))
    return dot


def float64_floor(workers: int, ref: str, tgt: str) -> float:
    pairs = [(ref, tgt, name) for name, _ in tensors(ref)]
    if workers <= 1:
        return sum(map(_dot64, pairs))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return sum(pool.map(_dot64, pairs))


def naive(ref: str, tgt: str) -> float:
    worst = 0.0
    for (_, a), (_, b) in zip(tensors(ref), tensors(tgt)):
        a, b = a.astype(np.float64), b.astype(np.float64)  # whole-tensor float64 copies
        rel = float(np.linalg.norm(a - b) / np.linalg.norm(a))
        _cos = float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
        _max = float(np.abs(a - b).max())
        worst = max(worst, rel)
    return worst


def main(argv: list[str]) -> None:
    kind, args = argv[0], argv[1:]
    if kind == "read":
        print(sum(float(x[::1024].sum()) for source in args for _, x in tensors(source)))
    elif kind == "sum":
        print(sum(float(x.sum()) for source in args for _, x in tensors(source)))
    elif kind == "float64":
        print(float64_floor(int(args[0]), args[1], args[2]))
    elif kind == "naive":
        print(naive(args[0], args[1]))
    else:
        raise SystemExit(f"unknown floor {kind!r}: read, sum, float64 or naive")


if __name__ == "__main__":
    main(sys.argv[1:])
