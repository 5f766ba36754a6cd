"""A compare across nodes (`ffdebug/across`, docs/across-nodes.md) on one machine: 2 and 4
processes over gloo, the dump's rank directories split between per-process roots standing for
node-local disks (FFDEBUG_TEST_NODE_ROOTS). The JSON must equal the single-process compare of the
whole dump, key for key; a lost "node" ends rank 0 with exit 4 naming it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from helpers.across.tp_dump import split, write

from ffdebug.across import wire
from ffdebug.io.ranks import Concat, Replicated, Staged, Sum

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "FFDEBUG_ACROSS_TIMEOUT": "60"}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(n: int, roots: list[str], args: list[str], cwd, extra: dict | None = None, timeout: float = 120):
    """`n` processes of `python -m ffdebug ARGS` as torchrun would start them; (rc, stdout,
    stderr) of each."""
    port = _port()
    procs = []
    for i in range(n):
        env = {
            **ENV,
            "RANK": str(i),
            "LOCAL_RANK": str(i),
            "WORLD_SIZE": str(n),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "FFDEBUG_TEST_NODE_ROOTS": os.pathsep.join(roots),
            **(extra or {}),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "ffdebug", *args],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    out = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, so, se))
    return out


def _single(root: str, args: list[str]):
    r = subprocess.run(
        [sys.executable, "-m", "ffdebug", *args], cwd=root, env=ENV, capture_output=True, text=True
    )
    return r.returncode, r.stdout, r.stderr


@pytest.fixture(scope="module")
def tp8(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp8")
    write(str(root / "whole"), world=8)
    write(str(root / "bug"), world=8, bug_rank=5)
    return root


def test_two_nodes_give_the_single_process_json(tp8, tmp_path):
    roots = split(str(tp8 / "whole"), [[0, 1, 2, 3], [4, 5, 6, 7]], str(tmp_path))
    args = ["compare", "ref", "target", "--json"]
    got = _launch(2, roots, args, cwd=tmp_path)
    want = _single(str(tp8 / "whole"), args)
    assert want[0] == 0
    assert got[0][0] == 0 and got[0][1] == want[1]
    assert got[1] == (0, "", got[1][2]) and "Traceback" not in got[1][2]
    moved = [line for line in got[0][2].splitlines() if line.startswith("compare across nodes:")]
    assert moved and "2 node(s)" in moved[0]


def test_a_bug_on_one_rank_across_four_processes_on_two_nodes(tp8, tmp_path):
    # two processes per node: the pair shares a root, as two ranks of one node share its disk
    roots = split(str(tp8 / "bug"), [[0, 1, 2, 3], [4, 5, 6, 7]], str(tmp_path))
    args = ["compare", "ref", "target", "--json"]
    got = _launch(4, [roots[0], roots[0], roots[1], roots[1]], args, cwd=tmp_path)
    want = _single(str(tp8 / "bug"), args)
    assert want[0] == 1
    assert got[0][0] == 1 and got[0][1] == want[1]
    bad = [s for s in json.loads(got[0][1])["stages"] if s["severity"] != "ok"]
    assert bad and all(s["key"] == "L1.attn_out" for s in bad)
    assert all(rc == 0 and so == "" for rc, so, _ in got[1:])


def test_a_shared_filesystem_is_read_in_place_and_nothing_moves(tp8, tmp_path):
    args = ["compare", "ref", "target", "--json"]
    shared = str(tp8 / "whole")
    got = _launch(2, [shared, shared], args, cwd=tmp_path)
    assert got[0][1] == _single(shared, args)[1]
    assert "0 payload bytes moved" in got[0][2]


def test_a_lost_node_ends_rank_0_with_exit_4_naming_it(tp8, tmp_path):
    roots = split(str(tp8 / "whole"), [[0, 1, 2, 3], [4, 5, 6, 7]], str(tmp_path))
    start = time.monotonic()
    got = _launch(
        2, roots, ["compare", "ref", "target"], cwd=tmp_path, extra={"FFDEBUG_TEST_LOSE_PROCESS": "1"}
    )
    assert time.monotonic() - start < 60
    rc, _, err = got[0]
    assert rc == 4, err
    line = [x for x in err.splitlines() if "lost process 1" in x]
    assert line and roots[1] in line[0] and "target/rank004" in line[0] and "target/rank007" in line[0]


def test_the_same_rank_directory_with_other_contents_on_two_nodes_is_refused(tp8, tmp_path):
    roots = split(str(tp8 / "whole"), [[0, 1, 2, 3], [3, 4, 5, 6, 7]], str(tmp_path))
    with open(os.path.join(roots[1], "target", "rank003", "manifest.jsonl"), "a") as f:
        f.write("\n")
    got = _launch(2, roots, ["compare", "ref", "target"], cwd=tmp_path)
    assert got[0][0] == 2
    assert "rank003" in got[0][2] and "hold different dumps" in got[0][2]


def test_under_torchrun(tp8, tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    shared = str(tp8 / "bug")
    r = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "ffdebug",
            "compare",
            "ref",
            "target",
            "--json",
        ],
        cwd=shared,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=180,
    )
    want = _single(shared, ["compare", "ref", "target", "--json"])
    assert json.loads(r.stdout) == json.loads(want[1])  # rank 0 alone writes stdout


def test_stage_results_and_fold_plans_survive_their_wire_form(tp8):
    from ffdebug.comparison.engine import compare

    result = compare(str(tp8 / "bug" / "ref"), str(tp8 / "bug" / "target"), workers=1)
    assert result.stages
    for e in result.stages:
        back = wire.stage_from_wire(json.loads(json.dumps(wire.stage_to_wire(e))))
        assert back == e
    for plan in (
        Concat(-1),
        Sum(),
        Replicated(2),
        Staged(((Concat(0), ((0, 1), (2, 3))), (Sum(), ((0, 1),)))),
    ):
        assert wire.plan_from_wire(json.loads(json.dumps(wire.plan_to_wire(plan)))) == plan


def test_bisect_across_two_nodes_gives_the_single_process_json(tp8, tmp_path):
    roots = split(str(tp8 / "bug"), [[0, 1, 2, 3], [4, 5, 6, 7]], str(tmp_path))
    args = ["bisect", "ref", "target", "--json"]
    got = _launch(2, roots, args, cwd=tmp_path)
    want = _single(str(tp8 / "bug"), args)
    assert got[0][0] == want[0] == 1
    assert got[0][1] == want[1]
    assert json.loads(want[1])["first_divergence"]["layer"] == 1


def test_an_unreadable_file_on_one_node_is_its_own_error_on_rank_0(tp8, tmp_path):
    # a damaged manifest that only node 1 reads: every process ends on that error (exit 2),
    # not on its peer leaving (exit 4)
    roots = split(str(tp8 / "whole"), [[0, 1, 2, 3], [4, 5, 6, 7]], str(tmp_path))
    with open(os.path.join(roots[1], "target", "rank006", "manifest.jsonl"), "w") as f:
        f.write("not json\n")
    got = _launch(2, roots, ["compare", "ref", "target"], cwd=tmp_path)
    assert [rc for rc, _, _ in got] == [2, 2]
    assert "rank006/manifest.jsonl" in got[0][2] and "lost" not in got[0][2]


def test_a_reference_copied_to_every_node_is_one_directory(tp8, tmp_path):
    # the same reference on both nodes, copied (other mtimes): the same manifest, so one directory
    roots = split(str(tp8 / "whole"), [[0, 1, 2, 3], [4, 5, 6, 7]], str(tmp_path))
    shutil.copytree(os.path.join(roots[0], "ref"), os.path.join(roots[1], "ref"))
    os.utime(os.path.join(roots[1], "ref", "rank000", "manifest.jsonl"), (1, 1))
    args = ["compare", "ref", "target", "--json"]
    got = _launch(2, roots, args, cwd=tmp_path)
    assert got[0][0] == 0 and got[0][1] == _single(str(tp8 / "whole"), args)[1]
