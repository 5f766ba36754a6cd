"""A killed dump leaves a readable store; damaged input gives exit 2 with one line."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from helpers import hang_timeout
from typer.testing import CliRunner

import ffdebug
from ffdebug.arrays import to_torch
from ffdebug.cli.app import app
from ffdebug.store.reader import open_side

runner = CliRunner()


def _one_line_error(result, *needles):
    assert result.exit_code == 2, result.output
    err = result.output.strip()
    assert err.startswith("ffdebug: error:") and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


@pytest.mark.integration
def test_sigkill_mid_write_leaves_readable_store(tmp_path):
    """Killed while the background writer's queue is busy (the producer never stops): the store
    holds a gap-free prefix of the captures, in capture order, each payload complete."""
    script = textwrap.dedent(
        """
        import os, sys, torch, ffdebug
        print("ready", flush=True)
        i = 0
        while True:  # dump until killed
            ffdebug.tap(f"t{i}", torch.randn(64, 1024))
            if i == 20:
                print("go", flush=True)
            i += 1
        """
    )
    env = dict(os.environ, FFDEBUG_FWD_DUMP_DIR=str(tmp_path), FFDEBUG_FWD_DUMP_SIDE="ref")
    p = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    assert p.stdout.readline().strip() == "go"
    manifest = tmp_path / "ref" / "rank000" / "manifest.jsonl"
    deadline = time.monotonic() + hang_timeout(300)
    while manifest.read_text().count("\n") < 21 and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    store = open_side(tmp_path / "ref")
    assert len(store.records) >= 21 and not store.status  # no status.json: the run did not finish
    assert [r.key for r in store.records] == [f"t{i}" for i in range(len(store.records))]
    for rec in store.records:  # every listed tensor is complete
        assert rec.load().shape == (64, 1024)
    r = runner.invoke(app, ["inspect", str(tmp_path / "ref")])
    assert r.exit_code == 0 and "did not finish cleanly" in r.output


def _small_store(tmp_path):
    with ffdebug.capture(None, dir=tmp_path, side="ref"):
        ffdebug.tap("a", torch.ones(4))
        ffdebug.tap("b", torch.ones(4))
    return tmp_path / "ref"


@pytest.mark.integration
def test_partial_last_manifest_line_is_skipped(tmp_path):
    side = _small_store(tmp_path)
    with open(side / "rank000" / "manifest.jsonl", "a") as f:
        f.write('{"key": "c", "seq": 2, "fi')  # a write cut short by a kill
    store = open_side(side)
    assert store.keys() == ["a", "b"] and store.incomplete_lines == 1


@pytest.mark.integration
def test_malformed_manifest_line_exit_2(tmp_path):
    side = _small_store(tmp_path)
    path = side / "rank000" / "manifest.jsonl"
    lines = path.read_text().splitlines()
    path.write_text(lines[0] + "\n" + "{not json\n" + lines[1] + "\n")
    _one_line_error(
        runner.invoke(app, ["inspect", str(side)]),
        "manifest.jsonl:2",
        "malformed manifest line (Expecting property name enclosed in double quotes at column 2)",
    )


@pytest.mark.integration
def test_truncated_safetensors_exit_2(tmp_path):
    side = _small_store(tmp_path)
    payload = next((side / "rank000").glob("*.safetensors"))
    payload.write_bytes(payload.read_bytes()[:20])
    _one_line_error(runner.invoke(app, ["inspect", str(side)]), payload.name, "truncated")
    other = _small_store(tmp_path / "o")
    _one_line_error(runner.invoke(app, ["compare", str(side), str(other)]), payload.name)


def test_not_a_store_exit_2(tmp_path):
    (tmp_path / "empty").mkdir()
    _one_line_error(runner.invoke(app, ["inspect", str(tmp_path / "empty")]), "not an ffdebug store")
    _one_line_error(runner.invoke(app, ["inspect", str(tmp_path / "nope")]), "no such file")


def test_non_weights_only_pickle_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    bad = tmp_path / "bad.pt"
    with open(bad, "wb") as f:
        pickle.dump({"x": Evil()}, f)
    _one_line_error(runner.invoke(app, ["inspect", str(bad)]), "bad.pt", "not a weights-only")
    assert not (tmp_path / "pwned").exists()


def test_atom_pt_dumps_import(tmp_path):
    d = tmp_path / "atom"
    d.mkdir()
    torch.save(torch.arange(6.0), d / "ref_layer03_Block__attn_out_rank0.pt")
    torch.save({"h": torch.ones(2)}, d / "embed_out.pt")
    store = open_side(d)
    keys = {r.key: r for r in store.records}
    assert keys["L003.attn_out"].layer == 3 and torch.equal(
        to_torch(keys["L003.attn_out"].load()), torch.arange(6.0)
    )
    assert "embed_out.h" in keys


@pytest.mark.integration
def test_help_does_not_import_torch():
    code = "import sys; from ffdebug.cli.app import app; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
    out = subprocess.run([sys.executable, "-m", "ffdebug.cli.app", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "compare" in out.stdout


@pytest.mark.integration
def test_two_ranks_write_one_side_without_collision(tmp_path):
    script = (
        "import torch, ffdebug; ffdebug.tap('x', torch.full((3,), float(__import__('os').environ['RANK'])))"
    )
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ,
            FFDEBUG_FWD_DUMP_DIR=str(tmp_path),
            FFDEBUG_FWD_DUMP_SIDE="target",
            RANK=str(rank),
            WORLD_SIZE="2",
        )
        procs.append(subprocess.Popen([sys.executable, "-c", script], env=env))
    assert [p.wait() for p in procs] == [0, 0]
    store = open_side(tmp_path / "target")
    assert sorted((r.rank, r.world_size, float(r.load()[0])) for r in store.records) == [
        (0, 2, 0.0),
        (1, 2, 1.0),
    ]
    assert (tmp_path / "target" / "run.json").exists() and len(store.status) == 2


def _write_rank(side_dir, rank, world_size, overwrite=False):
    from ffdebug.store.writer import StoreWriter

    w = StoreWriter(str(side_dir), side="target", rank=rank, world_size=world_size, overwrite=overwrite)
    w.write("x", torch.ones(2), {})
    w.close()


@pytest.mark.integration
def test_mixed_world_sizes_exit_2(tmp_path):
    """Rank directories of runs with different world sizes must not be folded together."""
    side = tmp_path / "target"
    _write_rank(side, 0, 1)
    _write_rank(side, 3, 4)  # a stale rank of an earlier 4-rank run
    _one_line_error(runner.invoke(app, ["inspect", str(side)]), "mixed world sizes", "rank003 says 4")


@pytest.mark.integration
def test_overwrite_drops_ranks_beyond_world_size(tmp_path):
    side = tmp_path / "target"
    for rank in range(4):
        _write_rank(side, rank, 4)
    _write_rank(side, 0, 1, overwrite=True)  # the re-run has one rank
    assert sorted(p.name for p in side.iterdir() if p.is_dir()) == ["rank000"]
    assert [r.world_size for r in open_side(side).records] == [1]


def test_garbage_run_json_and_missing_dir_exit_2(tmp_path):
    (tmp_path / "ref" / "rank000").mkdir(parents=True)
    (tmp_path / "ref" / "run.json").write_text("not json")
    _one_line_error(runner.invoke(app, ["inspect", str(tmp_path / "ref")]), "run.json", "re-run the dump")
    r = runner.invoke(app, ["compare", "ref-vs-target", "--dir", str(tmp_path / "nope")])
    _one_line_error(r, "nope", "does not exist")


def test_malformed_json_file_error_gives_line_and_column(tmp_path):
    """A damaged multi-line JSON file (run.json, status.json) is placed by line and column."""
    from ffdebug.errors import FFDebugError
    from ffdebug.io.contained import read_json

    path = tmp_path / "run.json"
    path.write_text('{\n "side": "ref",\n "rank" 0\n}\n')
    with pytest.raises(FFDebugError) as err:
        read_json(str(path), "run.json")
    assert str(err.value) == (
        f"{path}: malformed run.json (Expecting ':' delimiter at line 3, column 9); "
        "the store is damaged — re-run the dump"
    )
