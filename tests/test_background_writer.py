"""The background dump writer (ffdebug.store.background): bounded, blocking, drained on close and
on SIGTERM, with the SIGTERM handler chained and installed only while something is dumped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from helpers import hang_timeout

import ffdebug
from ffdebug.store import termination
from ffdebug.store.background import BackgroundWriter
from ffdebug.store.reader import open_side


class _GatedWriter:
    """A StoreWriter stand-in whose writes wait for `gate`; records what it wrote, in order."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.written: list[str] = []
        self.closed = False

    def write(self, key, tensor, meta, always_payload=False, payload=None):
        self.gate.wait(hang_timeout(120))
        self.written.append(key)

    def close(self, complete=True):
        self.closed = True


def test_queue_blocks_at_its_bound_and_never_drops():
    """Bound 2 KiB, 1 KiB tensors: the first is being written, the second queued; the third
    submit must wait (the bound counts the one in flight) and is written once room is made."""
    inner = _GatedWriter()
    w = BackgroundWriter(inner, max_bytes=2048)
    try:
        w.submit("a", torch.zeros(256), {})  # 256 float32 = 1 KiB
        w.submit("b", torch.zeros(256), {})
        third = threading.Thread(target=w.submit, args=("c", torch.zeros(256), {}))
        third.start()
        third.join(0.3)
        assert third.is_alive() and w.queued_bytes == 2048  # blocked, not dropped
        inner.gate.set()
        third.join(10)
        assert not third.is_alive()
        big = torch.zeros(4096)  # larger than the bound: waits for an empty queue, then goes
        w.submit("big", big, {})
        w.drain()
        assert inner.written == ["a", "b", "c", "big"] and w.queued_bytes == 0
    finally:
        inner.gate.set()
        w.close()
    assert inner.closed


@pytest.mark.integration
def test_sigterm_drains_then_chains_to_the_previous_handler(tmp_path, monkeypatch):
    """A Python handler set before the dump still runs on SIGTERM, after the queue is written
    (each write is slowed, so captures are still queued when the signal comes): it sees every
    capture in the manifest. Closing the session puts that handler back."""
    import ffdebug.store.writer as store_writer

    slow = store_writer.atomic_write_bytes
    monkeypatch.setattr(store_writer, "atomic_write_bytes", lambda p, d: (time.sleep(0.01), slow(p, d)))
    seen = []

    def previous(signum, frame):
        seen.append(len(open_side(tmp_path / "t").records))

    old = signal.signal(signal.SIGTERM, previous)
    try:
        with ffdebug.capture(None, dir=tmp_path, side="t"):
            for i in range(20):
                ffdebug.tap(f"x{i}", torch.full((4096,), float(i)))
            assert termination.installed() and signal.getsignal(signal.SIGTERM) is not previous
            signal.raise_signal(signal.SIGTERM)
        assert seen == [20]
        assert signal.getsignal(signal.SIGTERM) is previous and not termination.installed()
    finally:
        signal.signal(signal.SIGTERM, old)


@pytest.mark.integration
def test_sigterm_ignored_stays_ignored(tmp_path):
    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with ffdebug.capture(None, dir=tmp_path, side="t"):
            ffdebug.tap("x", torch.ones(3))
            assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN and not termination.installed()
    finally:
        signal.signal(signal.SIGTERM, old)
    assert [r.key for r in open_side(tmp_path / "t").records] == ["x"]


@pytest.mark.integration
def test_sigterm_with_default_action_drains_and_still_dies(tmp_path):
    """SIG_DFL before the dump: SIGTERM writes the 30 queued captures (the writer is slowed so
    they are still queued), then the process dies of SIGTERM as it would have without ffdebug."""
    script = textwrap.dedent(
        """
        import os, signal, sys, time, torch, ffdebug
        import ffdebug.store.writer as w
        slow = w.atomic_write_bytes
        w.atomic_write_bytes = lambda path, data: (time.sleep(0.02), slow(path, data))
        for i in range(30):
            ffdebug.tap(f"t{i}", torch.full((1024,), float(i)))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(float(sys.argv[1]))  # longer than the parent waits: a survivor is a hang
        print("survived", flush=True)
        """
    )
    env = dict(os.environ, FFDEBUG_FWD_DUMP_DIR=str(tmp_path), FFDEBUG_FWD_DUMP_SIDE="ref")
    wait = hang_timeout(300)
    try:
        p = subprocess.run(
            [sys.executable, "-c", script, str(wait + 60)],
            env=env,
            capture_output=True,
            text=True,
            timeout=wait,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"the process outlived its SIGTERM by {wait:.0f} s")
    assert p.returncode == -signal.SIGTERM, p.stderr
    assert "survived" not in p.stdout
    store = open_side(tmp_path / "ref")
    assert [r.key for r in store.records] == [f"t{i}" for i in range(30)]
    assert all(float(r.load()[0]) == i for i, r in enumerate(store.records))


@pytest.mark.integration
def test_queue_bytes_zero_writes_on_the_forward_thread(tmp_path):
    """queue_bytes=0: no writer thread, no SIGTERM handler; the record is on disk when tap returns."""
    before = signal.getsignal(signal.SIGTERM)
    with ffdebug.capture(None, dir=tmp_path, side="t", queue_bytes=0):
        ffdebug.tap("x", torch.arange(4.0))
        assert [r.key for r in open_side(tmp_path / "t").records] == ["x"]
        assert not [t for t in threading.enumerate() if t.name == "ffdebug-dump-writer"]
        assert signal.getsignal(signal.SIGTERM) is before


def test_a_failed_write_reaches_the_caller_and_the_store_is_closed_incomplete():
    """A write error on the writer thread is raised by the next submit / close, and the store
    writer is closed with complete=False (captures after the failure were not written)."""
    import torch

    from ffdebug.store.background import BackgroundWriter

    class Failing:
        def __init__(self):
            self.complete = None

        def write(self, key, tensor, meta, always_payload=False, payload=None):
            raise OSError("disk full")

        def close(self, complete=True):
            self.complete = complete

    store = Failing()
    w = BackgroundWriter(store, 1 << 20)
    w.submit("a", torch.zeros(4), {})
    with pytest.raises(OSError, match="disk full"):
        w.close()
    assert store.complete is False
