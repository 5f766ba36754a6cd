"""Record the trainer goldens with tolerances from the spread across CPU dispatch levels.

    PYTHONPATH=tests .venv/bin/python -m helpers.trainer.record_goldens [-k EXPR] [--workers N]

Runs ``tests/trainer/test_goldens.py::test_first_steps_match_the_golden`` once per dispatch level in a
child pytest (``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS`` and ``ONEDNN_MAX_CPU_ISA`` are read
when torch loads, so each level needs its own process), each run writing its values as a sample
(``golden_utils.SAMPLES_ENV``); then writes ``tests/trainer/goldens/<name>.json`` with the median of
every value, its spread and its tolerance (the formulas: ``golden_utils``). Prints one line per golden:
the largest spread and how many of the levels gave distinct values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from helpers import REPO, TESTS, subprocess_env
from helpers.trainer.golden_utils import GOLDENS, KEYS, SAMPLES_ENV, tolerance

TEST = "tests/trainer/test_goldens.py::test_first_steps_match_the_golden"
# MKL's instruction cap paired with oneDNN's; None: the machine's own (the variable unset)
MKL_LEVELS: tuple[tuple[str | None, str | None], ...] = (("SSE4_2", "SSE41"), ("AVX2", "AVX2"), (None, None))


@dataclass(frozen=True)
class Level:
    """One dispatch level: the variables set for the child process (None: unset)."""

    aten: str
    mkl: str | None
    onednn: str | None

    def environ(self) -> dict[str, str]:
        env = subprocess_env()
        for var in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA"):
            env.pop(var, None)
        env["ATEN_CPU_CAPABILITY"] = self.aten
        if self.mkl:
            env["MKL_ENABLE_INSTRUCTIONS"] = self.mkl
        if self.onednn:
            env["ONEDNN_MAX_CPU_ISA"] = self.onednn
        return env

    def to_json(self) -> dict[str, str]:
        return {
            "ATEN_CPU_CAPABILITY": self.aten,
            "MKL_ENABLE_INSTRUCTIONS": self.mkl or "(own)",
            "ONEDNN_MAX_CPU_ISA": self.onednn or "(own)",
        }


def own_capability() -> str:
    """torch's dispatch level on this CPU with no variable set (``AVX2``, ``AVX512``, ...)."""
    env = subprocess_env()
    env.pop("ATEN_CPU_CAPABILITY", None)
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def levels(own: str) -> list[Level]:
    """Every ATEN level this CPU supports (up to its own) x the MKL levels."""
    aten = ["default", "avx2"] + (["avx512"] if own.upper().startswith("AVX512") else [])
    if own.upper() == "DEFAULT":
        aten = ["default"]
    return [Level(a, mkl, onednn) for a in aten for mkl, onednn in MKL_LEVELS]


def run_level(level: Level, out: Path, select: str | None, workers: int) -> None:
    out.mkdir(parents=True)
    env = level.environ()
    env[SAMPLES_ENV] = str(out)
    env.setdefault("OMP_NUM_THREADS", "1")
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST]
    argv += ["-n", str(workers)] if workers > 1 else []
    argv += ["-k", select] if select else []
    done = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"record_goldens: the golden runs failed at {level.to_json()}:\n{done.stdout[-4000:]}")


def aggregate(name: str, samples: list[dict], levels_run: list[Level], own: str) -> dict:
    first = samples[0]
    for s in samples:
        assert (s["config"], s["overrides"], s["torch"], s["threads"]) == (
            first["config"], first["overrides"], first["torch"], first["threads"]
        ), f"{name}: the levels ran different configs"  # fmt: skip
    document = {
        "torch": first["torch"],
        "threads": first["threads"],
        "config": first["config"],
        "overrides": first["overrides"],
        "recorded_on": {"capability": own, "cpu": cpu_name()},
        "levels": [level.to_json() for level in levels_run],
    }
    spreads: dict[str, list[float]] = {}
    tolerances: dict[str, list[float]] = {}
    for key in KEYS:
        document[key], spreads[key], tolerances[key] = [], [], []
        for step in range(len(first[key])):
            values = [s[key][step] for s in samples]
            median = statistics.median(values)
            spread, tol = tolerance(median, values)
            document[key].append(median)
            spreads[key].append(spread)
            tolerances[key].append(tol)
    document["spread"] = spreads
    document["tolerance"] = tolerances
    document["distinct"] = {
        key: [len({s[key][i] for s in samples}) for i in range(len(first[key]))] for key in KEYS
    }
    return document


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", dest="select", help="pytest -k expression over the trainer names")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    own = own_capability()
    levels_run = levels(own)
    with tempfile.TemporaryDirectory(prefix="goldens-") as tmp:
        for i, level in enumerate(levels_run):
            print(f"level {i + 1}/{len(levels_run)}: {level.to_json()}", flush=True)
            run_level(level, Path(tmp) / f"level{i}", args.select, args.workers)
        names = sorted(p.stem for p in (Path(tmp) / "level0").glob("*.json"))
        for name in names:
            samples = [
                json.loads((Path(tmp) / f"level{i}" / f"{name}.json").read_text())
                for i in range(len(levels_run))
            ]
            reported = [s["capability"] for s in samples]
            expected = [level.aten.upper() for level in levels_run]
            assert reported == expected, f"{name}: the levels did not take effect: {reported} != {expected}"
            document = aggregate(name, samples, levels_run, own)
            (GOLDENS / f"{name}.json").write_text(json.dumps(document, indent=2) + "\n")
            worst = max(max(document["spread"][key]) for key in KEYS)
            distinct = max(max(document["distinct"][key]) for key in KEYS)
            print(
                f"{name}: max spread {worst:.2e}, at most {distinct} distinct values of {len(samples)} levels"
            )
    print(f"wrote {len(names)} golden(s) under {GOLDENS.relative_to(TESTS.parent)}")


if __name__ == "__main__":
    main()
