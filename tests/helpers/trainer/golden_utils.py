"""Golden values of a trainer run: the first optimizer steps' ``loss`` and ``grad_norm`` (not a test module).

A golden file ``tests/trainer/goldens/<name>.json`` holds, for every value, the median over the CPU
dispatch levels it was recorded at and a tolerance set from the spread measured across them
(``helpers.trainer.record_goldens``):

    spread    = max_levels |v - median| / |median|          (relative, per value)
    tolerance = max(10 x spread x |median|, 8 float32 ulp of the median)   (absolute, per value)

The levels are every ``ATEN_CPU_CAPABILITY`` the recording machine supports (``default``, ``avx2``,
``avx512`` where the CPU has it) crossed with ``MKL_ENABLE_INSTRUCTIONS`` in {``SSE4_2``, ``AVX2``, the
machine's own} (each paired with the matching ``ONEDNN_MAX_CPU_ISA``); the file records the levels, the
spread and the tolerance. What these variables cannot emulate: the other vendor's code paths inside MKL
(Intel and AMD CPUs take different kernels at the same instruction level) and AVX-512 on a CPU without
it; 10 x the emulated spread is the margin for those. Checked once: the goldens were recorded on an AMD
EPYC (AVX2, 6 levels), and the values of the goldens they replaced, recorded on another machine's CPU
with one level only, lie within 0.58 x the new tolerances (the largest: dmd2's third loss).

``test_goldens.py`` checks one golden for every registered trainer (its example config with
``GOLDEN_OVERRIDES``, 3 steps, one thread); the learning runs of several trainers check theirs too (the
same first steps of a longer run). ``check_golden`` skips, saying why, on another torch version, and
``test_goldens.py::test_every_golden_is_sensitive`` shows each tolerance is tight enough to see a
0.1 % change of the learning rate.

Record (after an intended change of the maths, for a new torch version or a new trainer)::

    PYTHONPATH=tests .venv/bin/python -m helpers.trainer.record_goldens          # every trainer
    PYTHONPATH=tests .venv/bin/python -m helpers.trainer.record_goldens -k grpo  # one

which runs ``tests/trainer/test_goldens.py`` once per level in a child process (the variables are read
when torch loads), then rewrites the files; review the diff and commit it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import pytest
import torch

from helpers import TESTS

GOLDENS = TESTS / "trainer" / "goldens"
SAMPLES_ENV = "REFERENCE_TRAINER_GOLDEN_SAMPLES"
"""Set by the recorder: ``check_golden`` writes the run's values under this directory instead of checking."""
RECORD_COMMAND = "PYTHONPATH=tests .venv/bin/python -m helpers.trainer.record_goldens"
STEPS = 3
GOLDEN_STEPS: dict[str, int] = {
    # the authors' TDM-R1 steps its three roles from the weights the iteration started with: steps 1-3
    # read no update, the 4th is the first that does (a golden of 3 would not see the learning rate)
    "tdm_r1": 4,
}
"""Trainers whose golden pins more than the first ``STEPS`` optimizer steps."""
KEYS = ("loss", "grad_norm")
SPREAD_FACTOR = 10.0
ULPS = 8

GOLDEN_OVERRIDES: dict[str, list[str]] = {
    # a KL reference, so the KL term is pinned too; two minibatches: step 2 is off-policy (ratio ≠ 1)
    "grpo": ["train.kl_beta=0.001", "train.gradient_steps_per_iteration=2"],
    "grpo_guard": ["train.kl_beta=0.001"],
    "dppo": ["train.kl_beta=0.001"],
    "nft": ["train.kl_beta=0.001"],
    "dgpo": ["train.kl_beta=0.001"],
    "awm": ["train.kl_beta=0.001", "train.ema_kl_beta=0.1"],
    # evaluations off: they do not touch the training numbers, only the time
    "dmd2": ["eval.every=0"],
    "tdm": ["eval.every=0"],
    "tdm_r1": ["eval.every=0"],
    "offline_dpo": ["eval.every=0"],
    "sft": ["eval.every=0"],
}
"""Overrides of each trainer's example config for its golden run (a trainer not listed: none)."""


def golden_steps(name: str) -> int:
    """How many optimizer steps the golden of ``name`` pins (``STEPS`` unless ``GOLDEN_STEPS`` says more)."""
    return GOLDEN_STEPS.get(name, STEPS)


def golden_values(records: list[dict[str, Any]], steps: int = STEPS) -> dict[str, list[float]]:
    """The first ``steps`` records' ``loss`` and ``grad_norm.<role>`` (pre-clip, of the step's role)."""
    assert len(records) >= steps, f"a golden needs {steps} optimizer steps, the run made {len(records)}"
    first = records[:steps]
    return {
        "loss": [float(r["loss"]) for r in first],
        "grad_norm": [float(r[f"grad_norm.{r['role']}"]) for r in first],
    }


def float32_ulp(value: float) -> float:
    """The spacing of float32 at ``value`` (the logged numbers are float32 results)."""
    return float(np.spacing(np.float32(abs(value))))


def tolerance(median: float, samples: list[float]) -> tuple[float, float]:
    """(relative spread, absolute tolerance) of one value from its samples over the dispatch levels."""
    deviation = max(abs(v - median) for v in samples)
    spread = deviation / abs(median) if median else deviation
    return spread, max(SPREAD_FACTOR * deviation, ULPS * float32_ulp(median))


def deviations(values: dict[str, list[float]], golden: dict[str, Any]) -> list[str]:
    """One line per value outside its golden tolerance (empty: the run matches the golden)."""
    out = []
    for key in KEYS:
        for step, (value, expected, tol) in enumerate(
            zip(values[key], golden[key], golden["tolerance"][key])
        ):
            if not abs(value - expected) <= tol:
                out.append(
                    f"{key}[{step}] = {value!r}, golden {expected!r} ± {tol:.3g} "
                    f"(off by {abs(value - expected):.3g}, {abs(value - expected) / tol:.1f} x the tolerance)"
                )
    return out


def check_golden(name: str, records: list[dict[str, Any]], *, config: str, overrides: list[str]) -> None:
    """Compare the run's first steps with the golden of ``name`` (the recorder: write them as a sample)."""
    path = GOLDENS / f"{name}.json"
    values = golden_values(records, golden_steps(name))
    samples = os.environ.get(SAMPLES_ENV)
    if samples:
        sample = {
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "capability": torch.backends.cpu.get_cpu_capability(),
            "config": config,
            "overrides": overrides,
            **values,
        }
        target = os.path.join(samples, f"{name}.json")
        with open(target + ".tmp", "w") as f:
            json.dump(sample, f)
        os.replace(target + ".tmp", target)
        return
    assert path.is_file(), f"no golden {path.name}; record it with {RECORD_COMMAND} -k {name}"
    golden = json.loads(path.read_text())
    assert (golden["config"], golden["overrides"]) == (config, overrides), "the golden is of another run"
    assert torch.get_num_threads() == golden["threads"] == 1
    if golden["torch"] != torch.__version__:
        pytest.skip(
            f"golden {path.name} was recorded with torch {golden['torch']}, this is torch {torch.__version__}: "
            f"re-record it with {RECORD_COMMAND} (tests/helpers/trainer/golden_utils.py)"
        )
    off = deviations(values, golden)
    assert not off, f"{name} differs from its golden ({path.name}): " + "; ".join(off)
