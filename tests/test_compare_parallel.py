"""The compare read path (README "Benchmarks"): payloads read ahead within a byte bound, whole
tensors on worker threads, the JSON bit-identical at any worker count."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import ffdebug
from ffdebug.comparison import engine
from ffdebug.comparison.engine import compare
from ffdebug.comparison.metrics import CHUNK
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
def test_json_bit_identical_at_one_and_two_workers(tmp_path, monkeypatch):
    ref, tgt = _stores(tmp_path)
    one = json.dumps(compare(ref, tgt, workers=1, allow_partial=True).to_json(), sort_keys=True)
    threads = set()
    inner = engine._compare_unit

    def spy(*args):
        threads.add(threading.current_thread().name)
        return inner(*args)

    monkeypatch.setattr(engine, "_compare_unit", spy)
    two = json.dumps(compare(ref, tgt, workers=2, allow_partial=True).to_json(), sort_keys=True)
    assert two == one
    assert threads and all(name.startswith("ffdebug-compare") for name in threads)  # the pool ran them
    stages = {s["key"]: s for s in json.loads(one)["stages"]}
    assert stages["same"]["bit_equal"] == 1.0 and stages["noisy"]["bit_equal"] < 1.0
    assert (
        stages["nan"]["nan_mismatch"] == 1 and abs(stages["offset"]["max_abs"] - 0.5) < 1e-6
    )  # fp32 rounding of +0.5


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
