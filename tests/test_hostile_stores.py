"""Hostile stores (docs/architecture.md, "Hostile stores"): no read outside a store, one writer per
side, stale locks named, kills still leave readable stores."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from helpers import hang_timeout
from typer.testing import CliRunner

from ffdebug.cli.app import app
from ffdebug.errors import FFDebugError
from ffdebug.store.reader import open_side
from ffdebug.store.writer import StoreWriter

pytestmark = pytest.mark.integration  # every test here spawns a process, runs a trainer or kills one

runner = CliRunner()

DUMP = textwrap.dedent(
    """
    import os, sys, torch, ffdebug
    scale = float(sys.argv[3])
    overwrite = os.environ.get("FFDEBUG_FWD_DUMP_OVERWRITE") == "1"
    with ffdebug.capture(None, dir=sys.argv[1], side=sys.argv[2], overwrite=overwrite):
        ffdebug.tap("embed.input_ids", torch.tensor([[5, 6, 7]]), input_ids=True)
        for i in range(3):
            ffdebug.tap(f"L{i:03d}.out", torch.linspace(-1, 1, 16) * (i + 1) * scale, layer=i)
        if len(sys.argv) > 4:  # hold the side (the lock) until told to finish
            print("holding", flush=True)
            sys.stdin.readline()
        ffdebug.tap("final.out", torch.ones(4) * scale)
    print("done", flush=True)
    """
)


def _dump(directory, side, scale=1.0, hold=False, env=None, **kw):
    argv = [sys.executable, "-c", DUMP, str(directory), side, str(scale)] + (["hold"] if hold else [])
    return subprocess.Popen(
        argv, env=dict(os.environ, **(env or {})), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, **kw,
    )  # fmt: skip


def _records(side_dir):
    with open(os.path.join(side_dir, "rank000", "manifest.jsonl")) as f:
        return [json.loads(line) for line in f]


def _compare_json(ref, target):
    r = runner.invoke(app, ["compare", str(ref), str(target), "--json"])
    return r.exit_code, json.loads(r.stdout)


def test_second_writer_refused_first_store_intact(tmp_path):
    ref = _dump(tmp_path, "ref")
    assert ref.wait(hang_timeout(300)) == 0, ref.stderr.read()
    control = _dump(tmp_path, "control")  # the same run with no second writer
    assert control.wait(hang_timeout(300)) == 0
    first = _dump(tmp_path, "target", hold=True)
    assert first.stdout.readline().strip() == "holding"
    # Two second writers with a bug (scale 2): plain, and with overwrite. Both must be refused.
    for env in ({}, {"FFDEBUG_FWD_DUMP_OVERWRITE": "1"}):
        second = _dump(tmp_path, "target", scale=2.0, env=env)
        out, err = second.communicate(timeout=hang_timeout(300))
        assert second.returncode != 0 and "done" not in out
        assert "is being written by live writer" in err and "two writers on one side" in err, err
        # the end-of-run report names the holder, never "captured nothing"
        (report,) = [line for line in err.splitlines() if line.startswith("ffdebug: warning: side 'target'")]
        assert report.startswith(
            "ffdebug: warning: side 'target' wrote nothing: its store refused this run: "
        )
        assert (
            f"(host {socket.gethostname()}, pid {first.pid}, since " in report
            and "captured nothing" not in err
        )
    first.stdin.write("\n")
    first.stdin.flush()
    assert first.wait(hang_timeout(300)) == 0, first.stderr.read()
    recs = _records(tmp_path / "target")
    assert [r["seq"] for r in recs] == list(range(5)) and len({r["writer"] for r in recs}) == 1
    assert not os.path.exists(tmp_path / "target" / "rank000" / "writer.lock")  # released at close
    code, got = _compare_json(tmp_path / "ref", tmp_path / "target")
    code_control, want = _compare_json(tmp_path / "ref", tmp_path / "control")
    assert code == code_control == 0
    strip = ("target_path", "ref_path", "target", "conclusion")
    assert [{k: v for k, v in s.items() if k not in strip} for s in got["stages"]] == [
        {k: v for k, v in s.items() if k not in strip} for s in want["stages"]
    ]


ENV_DUMP = "import torch, ffdebug; ffdebug.tap('x', torch.ones(3))"


def test_a_refused_env_dump_ends_naming_the_writer_that_holds_the_side(tmp_path):
    """FFDEBUG_FWD_DUMP_* set, the side held by a live writer: the run's last message (at exit) says
    the store refused it and who holds it, not that the model captured nothing."""
    first = _dump(tmp_path, "target", hold=True)
    assert first.stdout.readline().strip() == "holding"
    env = dict(os.environ, FFDEBUG_FWD_DUMP_DIR=str(tmp_path), FFDEBUG_FWD_DUMP_SIDE="target")
    try:
        second = subprocess.run(
            [sys.executable, "-c", ENV_DUMP],
            env=env,
            capture_output=True,
            text=True,
            timeout=hang_timeout(300),
        )
    finally:
        first.stdin.write("\n")
        first.stdin.flush()
        assert first.wait(hang_timeout(300)) == 0
    last = second.stderr.strip().splitlines()[-1]
    assert second.returncode != 0 and "captured nothing" not in second.stderr, second.stderr
    assert last.startswith("ffdebug: warning: side 'target' wrote nothing: its store refused this run: "), (
        last
    )
    assert (
        f"live writer {socket.gethostname()}:{first.pid}:" in last and "another FFDEBUG_FWD_DUMP_SIDE" in last
    )


def test_two_writers_in_one_process_and_release(tmp_path):
    a = StoreWriter(str(tmp_path / "t"), side="t")
    a.write("x", torch.ones(2), {})
    with pytest.raises(FFDebugError, match="being written by live writer"):
        StoreWriter(str(tmp_path / "t"), side="t", overwrite=True)
    a.close()
    b = StoreWriter(str(tmp_path / "t"), side="t", overwrite=True)  # a finished writer holds nothing
    b.write("y", torch.ones(2), {})
    b.close()
    recs = open_side(tmp_path / "t").records
    assert [r.key for r in recs] == ["y"] and recs[0].writer == b.writer_id != a.writer_id


def test_killed_writer_leaves_readable_store_and_a_named_stale_lock(tmp_path):
    p = _dump(tmp_path, "target", hold=True)
    assert p.stdout.readline().strip() == "holding"
    manifest = tmp_path / "target" / "rank000" / "manifest.jsonl"
    deadline = time.monotonic() + hang_timeout(120)  # the background writer lands the 4 queued captures
    while manifest.read_text().count("\n") < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(hang_timeout(300))
    store = open_side(tmp_path / "target")  # readable: every listed tensor is complete
    assert [r.key for r in store.records] == ["embed.input_ids", "L000.out", "L001.out", "L002.out"]
    assert all(r.load().size for r in store.records) and not store.status
    lock = json.loads((tmp_path / "target" / "rank000" / "writer.lock").read_text())
    assert lock["pid"] == p.pid and store.records[0].writer == lock["writer"]
    with pytest.raises(
        FFDebugError, match=rf"stale lock of writer {lock['writer']} .*pid {p.pid}.*process is gone"
    ):
        StoreWriter(str(tmp_path / "target"), side="target")
    again = _dump(tmp_path, "target", env={"FFDEBUG_FWD_DUMP_OVERWRITE": "1"})
    assert again.wait(hang_timeout(300)) == 0, again.stderr.read()
    assert len(open_side(tmp_path / "target").records) == 5


AUDITED_CLI = textwrap.dedent(
    """
    import os, sys
    log = open(sys.argv[1], "w")
    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes)):
            log.write(os.fsdecode(args[0]) + "\\n"); log.flush()
    sys.addaudithook(hook)
    from ffdebug.cli.app import main
    sys.argv = ["ffdebug"] + sys.argv[2:]
    main()
    """
)


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_manifest_pointing_outside_is_refused_and_never_opened(tmp_path, how):
    for side in ("ref", "target"):
        assert _dump(tmp_path / "dump", side).wait(hang_timeout(300)) == 0
    outside = tmp_path / "outside"
    outside.mkdir()
    fifo = outside / "fifo"
    os.mkfifo(fifo)  # opening it for reading without O_NONBLOCK would hang the reader
    rank = tmp_path / "dump" / "target" / "rank000"
    recs = _records(tmp_path / "dump" / "target")
    if how == "symlink":  # the manifest keeps its plain name; the payload file is a link outside
        os.remove(rank / recs[1]["file"])
        os.symlink(fifo, rank / recs[1]["file"])
    else:
        recs[1]["file"] = "../../../outside/fifo" if how == "relative" else str(fifo)
        (rank / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    log = tmp_path / "opened.txt"
    for cmd in (
        ["inspect", str(tmp_path / "dump" / "target")],
        ["compare", "ref-vs-target", "--dir", str(tmp_path / "dump")],
    ):
        try:
            p = subprocess.run(
                [sys.executable, "-c", AUDITED_CLI, str(log), *cmd],
                capture_output=True,
                text=True,
                timeout=hang_timeout(300),
            )
        except subprocess.TimeoutExpired:
            opened_fifo = str(fifo) in log.read_text()  # the open log tells a hang from a slow machine
            pytest.fail(
                f"{cmd[0]} hung on a manifest pointing at a FIFO outside the store"
                if opened_fifo
                else f"{cmd[0]} ran past its deadline without opening the FIFO: raise FFDEBUG_TEST_TIMEOUT_SCALE"
            )
        # one error line; on a slow machine the command's progress lines (`ffdebug: compare: 0/? stages,
        # 10.0 s`, every FFDEBUG_PROGRESS_INTERVAL) come before it
        *progress, err = p.stderr.strip().splitlines()
        assert all(line.startswith(f"ffdebug: {cmd[0]}: ") for line in progress), p.stderr
        assert p.returncode == 2 and err.startswith("ffdebug: error:"), p.stderr
        assert ("symbolic link" if how == "symlink" else "not a plain file name") in err
        opened = log.read_text().splitlines()
        assert any(q.endswith("manifest.jsonl") for q in opened), opened  # the log records opens
        assert not [q for q in opened if os.path.normpath(os.path.abspath(q)).startswith(str(outside))], (
            opened
        )


def test_inspect_recomputes_from_payloads(tmp_path):
    assert _dump(tmp_path, "target").wait(hang_timeout(300)) == 0
    path = tmp_path / "target" / "rank000" / "manifest.jsonl"
    recs = _records(tmp_path / "target")
    recs[2]["stats"]["mean"] = 99.0  # a manifest claiming another tensor
    recs[3]["shape"] = [4, 4]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    r = runner.invoke(app, ["inspect", str(tmp_path / "target"), "--json"])
    assert r.exit_code == 2 and "2 record(s) disagree with their payloads" in r.stderr
    rows = {t["key"]: t for t in json.loads(r.stdout)["tensors"]}
    assert rows["L001.out"]["disagreements"] == ["stats.mean: manifest 99.0 vs payload 0.0"]
    assert rows["L002.out"]["disagreements"] == ["shape: manifest [4, 4] vs payload [16]"]
    assert rows["L002.out"]["shape"] == [16] and rows["final.out"]["disagreements"] == []
    fast = runner.invoke(app, ["inspect", str(tmp_path / "target"), "--manifest-only", "--json"])
    assert fast.exit_code == 0 and json.loads(fast.stdout)["tensors"][3]["shape"] == [4, 4]


def test_long_and_markup_keys_in_tables(tmp_path):
    w = StoreWriter(str(tmp_path / "t"), side="t")
    long_key = "L000." + "k" * 300
    for key in ("[/]", "[bold]x[/bold]", long_key):
        w.write(key, torch.ones(2), {})
    w.close()
    r = runner.invoke(app, ["inspect", str(tmp_path / "t")], terminal_width=300)
    assert r.exit_code == 0, r.output
    assert "[/]" in r.output and "[bold]x[/bold]" in r.output and long_key not in r.output
    from ffdebug.report.safe_text import shown_key

    shown = shown_key(long_key)
    assert len(shown) <= 200 and "…" in shown and shown.split("#")[-1] in r.output.replace("\n", "")
    js = runner.invoke(app, ["inspect", str(tmp_path / "t"), "--json"])
    assert long_key in [t["key"] for t in json.loads(js.stdout)["tensors"]]  # JSON holds the full key


def test_output_files_checked_one_line(tmp_path):
    for side in ("ref", "target"):
        assert _dump(tmp_path, side).wait(hang_timeout(300)) == 0
    (tmp_path / "adir").mkdir()
    for where, needle in (
        (tmp_path / "adir", "is a directory"),
        (tmp_path / "no" / "r.html", "does not exist"),
    ):
        r = runner.invoke(app, ["bisect", "ref-vs-target", "--dir", str(tmp_path), "--html", str(where)])
        assert r.exit_code == 2 and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output
    ok = runner.invoke(
        app, ["bisect", "ref-vs-target", "--dir", str(tmp_path), "--html", str(tmp_path / "r.html")]
    )
    assert ok.exit_code == 0 and (tmp_path / "r.html").read_text().startswith("<!")


def test_small_cli_values_one_line(tmp_path):
    assert _dump(tmp_path, "target").wait(hang_timeout(300)) == 0
    r = runner.invoke(app, ["slot-invariance", str(tmp_path / "target"), "--slots", "2", "--slot-dim", "-9"])
    assert r.exit_code == 2 and "--slot-dim -9" in r.stderr
    r = runner.invoke(app, ["compare", "--rank", "x"])
    assert r.exit_code == 2 and r.stderr.startswith("ffdebug: error: Invalid value for '--rank'")
    assert len(r.stderr.strip().splitlines()) == 1


def test_writer_claims_before_touching_anything(tmp_path):
    a = StoreWriter(str(tmp_path / "t"), side="t")
    a.write("x", torch.ones(2), {})
    before = sorted(os.listdir(tmp_path / "t" / "rank000")), (tmp_path / "t" / "run.json").read_text()
    time.sleep(0.01)
    with pytest.raises(FFDebugError):
        StoreWriter(str(tmp_path / "t"), side="t", overwrite=True)
    assert (
        sorted(os.listdir(tmp_path / "t" / "rank000")),
        (tmp_path / "t" / "run.json").read_text(),
    ) == before
    a.close()
