"""The compare read path (docs/benchmarks.md "Benchmarks"): payloads read ahead within a byte bound, whole
tensors on worker threads, the JSON bit-identical at any worker count."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import pytest
import torch
from helpers import hang_timeout

import ffdebug
from ffdebug.comparison import engine
from ffdebug.comparison.engine import compare
from ffdebug.comparison.metrics import CHUNK
from ffdebug.errors import FFDebugError
from ffdebug.io.prefetch import ReadAhead


def _stores(tmp_path):
    """Seven stages: equal, noisy over several chunks, one NaN, an offset, bf16, an int tensor and
    logits (their KL / top-k metrics too)."""
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(3 * CHUNK + 7, generator=g), torch.randn(2, 5000, generator=g)]
    for side, noise in (("ref", 0.0), ("target", 1.0)):
        with ffdebug.capture(None, dir=tmp_path, side=side):
            ffdebug.tap("embed.input_ids", torch.tensor([[1, 2, 3]]), input_ids=True)
            ffdebug.tap("same", base[0])
            ffdebug.tap("noisy", base[0] + noise * 1e-3 * torch.sin(torch.arange(base[0].numel()) * 1.0))
            nan = base[1].clone()
            if noise:
                nan[1, 17] = float("nan")
            ffdebug.tap("nan", nan)
            ffdebug.tap("offset", base[1] + noise * 0.5)
            ffdebug.tap("bf16", (base[1] * (1 + noise * 1e-2)).bfloat16())
            ffdebug.tap("ints", torch.arange(100) + int(noise))
            ffdebug.tap("final.logits", base[1][:, :4000].reshape(80, 100) * (1 + noise * 0.1))
    return tmp_path / "ref", tmp_path / "target"


@pytest.mark.integration
def test_json_bit_identical_at_any_worker_count_processes_and_threads(tmp_path, monkeypatch):
    """One worker, forked worker processes (2 and 3) and worker threads (forking refused) give
    the same JSON, byte for byte; the processes really ran the units (other pids)."""
    ref, tgt = _stores(tmp_path)
    one = json.dumps(compare(ref, tgt, workers=1, allow_partial=True).to_json(), sort_keys=True)
    pids = tmp_path / "pids"
    threads = set()
    inner = engine._compare_unit

    def spy(*args):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        threads.add(threading.current_thread().name)
        return inner(*args)

    monkeypatch.setattr(engine, "_compare_unit", spy)
    monkeypatch.setattr(
        engine, "fork_usable", lambda: True
    )  # a thread an earlier test left is no reason here
    for n in (2, 3):
        assert json.dumps(compare(ref, tgt, workers=n, allow_partial=True).to_json(), sort_keys=True) == one
    ran_in = set(pids.read_text().split())
    assert len(ran_in) >= 2 and str(os.getpid()) not in ran_in  # children, not this process
    monkeypatch.setattr(engine, "fork_usable", lambda: False)
    two = json.dumps(compare(ref, tgt, workers=2, allow_partial=True).to_json(), sort_keys=True)
    assert two == one
    assert threads and all(name.startswith("ffdebug-compare") for name in threads)  # the thread pool ran them
    stages = {s["key"]: s for s in json.loads(one)["stages"]}
    assert stages["same"]["bit_equal"] == 1.0 and stages["noisy"]["bit_equal"] < 1.0
    assert (
        stages["nan"]["nan_mismatch"] == 1 and abs(stages["offset"]["max_abs"] - 0.5) < 1e-6
    )  # fp32 rounding of +0.5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers are used on Linux only")
def test_forked_workers_return_the_parents_own_records(tmp_path, monkeypatch):
    """`CompareResult.records` holds the stores' own Record objects (attribution loads them by
    position), not the children's copies."""
    from ffdebug.store.reader import open_side

    ref, tgt = _stores(tmp_path)
    monkeypatch.setattr(engine, "fork_usable", lambda: True)
    a, b = open_side(ref), open_side(tgt)
    res = compare(a, b, workers=2, allow_partial=True)
    own = {id(r) for r in (*a.records, *b.records)}
    assert res.records and all(id(x) in own for pair in res.records for x in pair)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers are used on Linux only")
def test_a_worker_that_dies_is_one_line_naming_its_stage_and_leaves_no_child(tmp_path, monkeypatch):
    """A child killed mid-unit (as the OOM killer would): compare fails at once with a one-line
    error naming the stage and the way round it, and no child process is left behind."""
    ref, tgt = _stores(tmp_path)
    inner = engine._compare_unit

    def dies_on_offset(unit, *args):
        if unit.ref.key == "offset":
            os.kill(os.getpid(), signal.SIGKILL)
        return inner(unit, *args)

    monkeypatch.setattr(engine, "_compare_unit", dies_on_offset)
    monkeypatch.setattr(engine, "fork_usable", lambda: True)
    before = _children()
    with pytest.raises(FFDebugError, match=r"killed by SIGKILL while comparing stage 'offset'.*--workers 1"):
        compare(ref, tgt, workers=2, allow_partial=True)
    assert _children() == before  # every child was reaped, the dead one and the live one


def _children() -> set[int]:
    """Pids whose parent is this process (zombies included), from /proc."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid():
                out.add(int(entry))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers are used on Linux only")
def test_an_error_in_a_worker_is_raised_in_unit_order(tmp_path, monkeypatch):
    """Two units fail in the children: the parent raises the earlier one's own exception."""
    ref, tgt = _stores(tmp_path)
    inner = engine._compare_unit

    def fails(unit, *args):
        if unit.ref.key in ("nan", "ints"):
            raise FFDebugError(f"{unit.ref.key}: damaged payload")
        return inner(unit, *args)

    monkeypatch.setattr(engine, "_compare_unit", fails)
    monkeypatch.setattr(engine, "fork_usable", lambda: True)
    with pytest.raises(FFDebugError, match="^nan: damaged payload$"):
        compare(ref, tgt, workers=3, allow_partial=True)


class _Rec:
    """A record stand-in: 1 MiB of float32, loading it is logged with the bytes held meanwhile."""

    shape = (256, 1024)
    dtype = "float32"

    def __init__(self, i, log, held) -> None:
        self.i, self.log, self.held = i, log, held

    def load(self):
        self.held.append(1 << 20)
        self.log.append(sum(self.held))
        return torch.full((4,), float(self.i))


def test_read_ahead_stays_within_its_depth_and_serves_in_order():
    """Depth 3 MiB, jobs of 2 x 1 MiB: the reader holds at most one job ahead (plus the one being
    used); every job's tensors come back, and a job the reader has not reached is read inline."""
    log, held = [], []
    jobs = [[_Rec(2 * i, log, held), _Rec(2 * i + 1, log, held)] for i in range(6)]
    got = []
    with ReadAhead(jobs, depth_bytes=3 << 20) as ahead:
        for i, job in enumerate(jobs):
            loaded = ahead.take(i)
            got.append([float(loaded(r)[0]) for r in job])
            held.clear()  # the consumer drops job i's tensors
            ahead.release(i)
    assert got == [[2.0 * i, 2.0 * i + 1] for i in range(6)]
    assert max(log) <= 4 << 20  # the job in use + one job ahead (2 + 2 MiB), never three jobs


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers are used on Linux only")
def test_fork_is_refused_beside_a_thread_not_marked_fork_safe(monkeypatch):
    """A caller's own thread could hold a lock a child inherits: then compare uses threads; the
    progress display's threads mark themselves fork-safe and do not stop the fork."""
    from ffdebug.comparison.forked import fork_usable
    from ffdebug.progress_hook import FORK_SAFE

    other = threading.Thread(target=lambda: None)
    alive = [threading.current_thread()]
    monkeypatch.setattr(threading, "enumerate", lambda: list(alive))
    assert fork_usable()
    alive.append(other)
    assert not fork_usable()
    setattr(other, FORK_SAFE, True)
    assert fork_usable()


def test_free_cores_counts_what_runs_now_not_the_last_minute(monkeypatch):
    """2 cores, a load average of 1.9 left by the last minute's commands, this process the only
    task runnable now: both cores are free. With another task running now, one is."""
    from ffdebug.comparison import parallel

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.0, 0.5))
    monkeypatch.setattr(parallel, "_running_now", lambda: 1)
    assert parallel.free_cores() == 2
    monkeypatch.setattr(parallel, "_running_now", lambda: 2)
    assert parallel.free_cores() == 1
    monkeypatch.setattr(parallel, "_running_now", lambda: None)  # no /proc: the load average alone
    assert parallel.free_cores() == 1


def test_worker_count_stays_at_one_for_small_stores(monkeypatch):
    """Starting workers costs about 20 ms: under 64 MiB of payloads one worker is faster; above,
    one per free core, as many as the memory budget holds pairs of the largest size."""
    from ffdebug.comparison import parallel

    mib = 1 << 20
    monkeypatch.setattr(parallel, "free_cores", lambda: 4)
    assert parallel.worker_count([2 * mib] * 20, 256 * mib) == 1  # 40 MiB in all
    assert parallel.worker_count([16 * mib] * 20, 256 * mib) == 4  # 320 MiB, 16 MiB per pair
    assert parallel.worker_count([200 * mib] * 3, 256 * mib) == 1  # one 200 MiB pair fits
    assert parallel.worker_count([16 * mib] * 2 + [0] * 30, 256 * mib) == 1  # < 64 MiB to read
    assert parallel.worker_count([40 * mib] * 2 + [0] * 30, 256 * mib) == 2  # two jobs read anything


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers are used on Linux only")
def test_a_shard_reading_found_in_a_worker_comes_back_as_the_parents_records(tmp_path, monkeypatch):
    """Target ranks hold undeclared halves of the reference's last dim: a child reads them as a
    concatenation and folds them. The folded record comes back as its plan over the parent's own
    rank records — also when those records' sources cannot be pickled (a lambda)."""
    import dataclasses

    from ffdebug.io.sources import Loader
    from ffdebug.store.reader import open_side

    hidden = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    full = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2))
    for side, pieces in (("ref", [full]), ("target", [full[..., :4], full[..., 4:]])):
        for rank, piece in enumerate(pieces):
            monkeypatch.setenv("WORLD_SIZE", str(len(pieces)))
            monkeypatch.setenv("RANK", str(rank))
            with ffdebug.capture(None, dir=tmp_path, side=side):
                ffdebug.tap("L000.hidden_in", hidden, layer=0)
                ffdebug.tap("L000.mlp.proj.out", piece, layer=0)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")

    def unpicklable(store):
        records = [
            dataclasses.replace(r, source=Loader(lambda t=r.load(): t, "fn")) if r.source is not None else r
            for r in store.records
        ]
        return dataclasses.replace(store, records=records)

    a, b = unpicklable(open_side(tmp_path / "ref")), unpicklable(open_side(tmp_path / "target"))
    monkeypatch.setattr(engine, "fork_usable", lambda: True)
    one = compare(a, b, workers=1)
    two = compare(a, b, workers=2)
    assert json.dumps(two.to_json(), sort_keys=True) == json.dumps(one.to_json(), sort_keys=True)
    assert "shard_reading" in [s.finding for s in two.stages]
    own = {id(r) for r in (*a.records, *b.records)}
    folded = [x for pair in two.records for x in pair if x.parts]
    assert folded and all(id(p) in own for x in folded for p in x.parts)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers are used on Linux only")
def test_an_exception_that_does_not_unpickle_arrives_as_what_it_was():
    """A worker's exception whose constructor takes other arguments than its `args` would unpickle
    as a TypeError in the parent; it arrives as a RuntimeError naming the original instead."""
    from ffdebug.comparison.forked import ForkPool

    class TwoArgs(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    def fails(i):
        if i == 1:
            raise TwoArgs("x", "y")
        return i

    with ForkPool(fails, 2) as pool, pytest.raises(RuntimeError, match=r"^TwoArgs: x/y$"):
        pool.map(4)


PARENT_SCRIPT = """
import sys, time
from ffdebug.comparison.forked import ForkPool
with ForkPool(lambda i: time.sleep(60), 2) as pool:
    with open(sys.argv[1], "w") as f:
        f.write(" ".join(str(pid) for pid in pool._children.values()))
    pool.map(4)
"""


def _gone(pid: int) -> bool:
    """The process has exited (a zombie nobody has reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forked workers are used on Linux only")
def test_workers_die_with_their_parent(tmp_path):
    """A parent killed outright (SIGKILL, no cleanup) takes its busy workers with it: they do not
    go on computing units nobody will read."""
    import subprocess
    import time

    from helpers import subprocess_env

    pids_file = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, "-c", PARENT_SCRIPT, str(pids_file)], env=subprocess_env())
    try:
        deadline = time.monotonic() + hang_timeout(300)
        while not (pids_file.exists() and pids_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        children = [int(p) for p in pids_file.read_text().split()]
        assert len(children) == 2 and not any(_gone(p) for p in children)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + hang_timeout(60)
    while not all(_gone(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_gone(p) for p in children)
