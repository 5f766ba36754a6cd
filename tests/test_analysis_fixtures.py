"""The analysis commands' answers on fixed inputs stay what they were when frozen
(fixtures/analysis/, scripts/make_analysis_fixtures.py): compare, bisect, inspect and weights-diff
on the demo's dumps, a bfloat16 store, a float8 store, a two-rank store and three checkpoints.

These answers were frozen with the torch implementation, before the analysis side dropped torch
(docs/architecture.md, "Analysis without torch"); the check runs in a fresh interpreter whose
import system refuses `torch`, so the numpy implementation must give them without it. Exit codes,
severities, pairings, names and positions must be equal; every float within `ULPS` units in the
last place, relative to its own size (float64 sums taken in another order), except the fields in
`ORDER_MOVED` (relative) and `NEAR_ONE` (absolute), whose values a change of summation order
moves by more.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures" / "analysis"
ANSWERS = sorted((FIXTURES / "expected").glob("*.json"))

ULPS = 4
# Fields computed through exp / log of every logit (libm's scalar kernels against vectorised
# ones): compared to a relative tolerance instead of ULPS. Measured on the frozen demo logits:
# kl_mean 2.2e-12 relative between ATEN_CPU_CAPABILITY=default and avx2; kl_max equal there.
# norm_ratio = √(Σt²) / √(Σr²): the two sums of 64 Ki positive terms per chunk each move by a few
# ulp in another order, and their ratio by both (measured: 5.4 ulp, 0.99918368508279 52 vs 58).
ORDER_MOVED: dict[str, float] = {"kl_mean": 1e-9, "kl_max": 1e-9, "norm_ratio": 16 * 2.0**-52}
# Fields that are 1 − (a ratio of float64 sums near 1), or differences of such O(1) values: the
# sums' rounding (a few ulp of 1, from BLAS's order of a chunk's 64 Ki products against torch's)
# is absolute there, not relative to the small result (rel_diff 4e-4 moved by 5.5e-16, 2.5 ulp
# of 1; cos by 7.8e-16; a rank's rel_diff of 0 from -2.2e-16 to 3.3e-16; a bisect row's cos_out
# by 6.4e-16 under OpenBLAS's Nehalem and Prescott kernels, OPENBLAS_CORETYPE). Allowed: 16 ulp of 1.
NEAR_ONE: dict[str, float] = dict.fromkeys(
    ("cos", "cos_in", "cos_out", "rel_diff", "scale_step", "scale_out", "added", "max_step", "max_added"),
    16 * 2.0**-52,
)
IGNORED = frozenset({"seconds"})  # wall time of a pass
_TIMING = re.compile(r"\(\d+(\.\d+)? s\)")  # "(0.01 s)" inside a note


def _ulp_close(a: float, b: float, ulps: int) -> bool:
    if a == b or (math.isnan(a) and math.isnan(b)):
        return True
    if math.isinf(a) or math.isinf(b):
        return False
    return abs(a - b) <= ulps * math.ulp(max(abs(a), abs(b)))


def differences(want, got, path: str = "$") -> list[str]:
    """Where `got` departs from `want`: a list of 'path: want vs got' lines (empty: the same)."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in sorted(set(want) | set(got)):
            if k in IGNORED:
                continue
            if k not in want or k not in got:
                out.append(f"{path}.{k}: {'missing' if k not in got else 'new'}")
                continue
            out += differences(want[k], got[k], f"{path}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: {len(want)} items vs {len(got)}"]
        return [d for i, (w, g) in enumerate(zip(want, got)) for d in differences(w, g, f"{path}[{i}]")]
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        leaf = path.rsplit(".", 1)[-1].split("[")[0]
        rel = ORDER_MOVED.get(leaf)
        if leaf in NEAR_ONE:
            ok = abs(want - got) <= NEAR_ONE[leaf]
        elif rel is not None:
            ok = abs(want - got) <= rel * max(abs(want), abs(got), 1e-300) or _ulp_close(want, got, ULPS)
        else:
            ok = _ulp_close(want, float(got), ULPS)
        return [] if ok else [f"{path}: {want!r} vs {got!r}"]
    if isinstance(want, str) and isinstance(got, str):
        want, got = _TIMING.sub("(… s)", want), _TIMING.sub("(… s)", got)
    if want != got or type(want) is not type(got):
        return [f"{path}: {want!r} vs {got!r}"]
    return []


_DRIVER = """
import json, sys

class NoTorch:  # the analysis side must run where torch cannot be imported
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name}: blocked, the analysis side must not import torch")

sys.meta_path.insert(0, NoTorch())
from typer.testing import CliRunner
from ffdebug.cli.app import app
runner = CliRunner()
for args in json.loads(sys.argv[1]):
    r = runner.invoke(app, args)
    print(json.dumps({"exit_code": r.exit_code, "stdout": r.stdout}))
"""


def _run_all(commands: list[list[str]]) -> list[tuple[int, str]]:
    """Each command's (exit code, stdout), all in one fresh interpreter run in fixtures/analysis/."""
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("FFDEBUG_")},
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "COLUMNS": "200",
    }
    p = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(commands)],
        cwd=FIXTURES,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return [(r["exit_code"], r["stdout"]) for r in map(json.loads, p.stdout.splitlines())]


@pytest.fixture(scope="module")
def answered() -> dict[str, tuple[int, str]]:
    frozen = [json.loads(a.read_text(encoding="utf-8"))["args"] for a in ANSWERS]
    return dict(zip((a.stem for a in ANSWERS), _run_all(frozen)))


def test_the_comparison_rule_catches_what_it_must():
    """The rule itself: a changed severity, a moved position or a float 5 ulp away is a difference."""
    want = {"severity": "ok", "max_abs_at": [0, 3], "rel": 0.1, "n": 3}
    assert differences(want, dict(want)) == []
    assert differences(want, {**want, "severity": "drift"})
    assert differences(want, {**want, "max_abs_at": [0, 4]})
    five = 0.1
    for _ in range(5):
        five = math.nextafter(five, 1.0)
    three = math.nextafter(math.nextafter(math.nextafter(0.1, 1.0), 1.0), 1.0)
    assert differences(want, {**want, "rel": three}) == [] and differences(want, {**want, "rel": five})
    assert differences(want, {**want, "n": 3.0})  # an int that became a float
    assert differences({"note": "paired 1 (0.01 s)"}, {"note": "paired 1 (0.25 s)"}) == []
    assert differences({"seconds": 0.01}, {"seconds": 3.0}) == []
    assert differences({"rel_diff": 4e-4}, {"rel_diff": 4e-4 + 5e-16}) == []  # absolute near one
    assert differences({"rel_diff": 4e-4}, {"rel_diff": 4e-4 + 1e-14})


@pytest.mark.integration
@pytest.mark.numeric
@pytest.mark.parametrize("answer", ANSWERS, ids=[a.stem for a in ANSWERS])
def test_the_frozen_answer_holds(answer, answered):
    frozen = json.loads(answer.read_text(encoding="utf-8"))
    code, stdout = answered[answer.stem]
    assert code == frozen["exit_code"], stdout[-2000:]
    diffs = differences(frozen["json"], json.loads(stdout))
    assert not diffs, f"{len(diffs)} difference(s), first: " + "; ".join(diffs[:8])
