"""``backend.kind: deepspeed`` (ZeRO-1/2, ``reference_trainer.zero``).

In CI (deepspeed never imported): the extra missing is refused naming the install command; the plan
rules (ZeRO-3, Muon, a missing ``zero_stage``, no torchrun launch) are in ``test_distributed.py``.

Opt-in (``FFDEBUG_TEST_DEEPSPEED=1``, the extra installed with ``DS_BUILD_OPS=0``; the first launch
JIT-builds DeepSpeed's shared-memory op, a few minutes on a busy machine): one two-rank torchrun launch
of DMD2 (two roles, one engine each, cut inside a rollout iteration) under ZeRO-2 runs 4 steps straight
and 2 then resumed to 4. Metrics and the final checkpoint are bitwise equal; the run matches a
one-process run with the same global batch (metrics within 1e-7 + 1e-5·|value|, exported weights within
1e-5); the checkpoint has the single backend's layout (same files, same optimizer skeleton, same tensor
names and shapes).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_distributed import FAST_EVAL, _files, torchrun
from trainer_utils import example, load, metrics

OPT_IN = os.environ.get("FFDEBUG_TEST_DEEPSPEED") == "1"
opt_in = pytest.mark.skipif(
    not OPT_IN,
    reason="opt-in: set FFDEBUG_TEST_DEEPSPEED=1 with the extra installed "
    "(DS_BUILD_OPS=0 pip install 'ffdebug[deepspeed]')",
)
DMD2 = ("dmd2", 4, 2, ["train.prompts_per_iteration=2", "backend.kind=deepspeed", "backend.zero_stage=2"])


def test_missing_extra_is_refused_naming_the_install_command(monkeypatch):
    import importlib.util

    from reference_trainer import zero
    from reference_trainer.config import BackendConfig
    from reference_trainer.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a)
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(
        ConfigError, match=r"backend.kind: deepspeed is not installed.*DS_BUILD_OPS=0 pip install"
    ):
        zero.DeepSpeedBackend(BackendConfig(kind="deepspeed", zero_stage=2), max_grad_norm=1.0)


@pytest.fixture(scope="module")
def dmd2_run(tmp_path_factory):
    name, n, m, overrides = DMD2
    out = tmp_path_factory.mktemp("deepspeed-dmd2")
    torchrun("resume", str(out), name, str(n), str(m), FAST_EVAL, *overrides)
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    from reference_trainer.run import train

    _, n, _, _ = DMD2
    out = tmp_path_factory.mktemp("deepspeed-one-rank")
    torch.set_num_threads(1)
    train(load(example("dmd2"), FAST_EVAL, max_steps=n), out)
    return out


@opt_in
@pytest.mark.integration
def test_zero2_dmd2_two_rank_exact_resume(dmd2_run):
    _, n, _, _ = DMD2
    straight, cut = dmd2_run / "straight", dmd2_run / "cut"
    assert (straight / "metrics.jsonl").read_bytes() == (cut / "metrics.jsonl").read_bytes()
    assert [r["optimizer_step"] for r in metrics(straight)] == list(range(1, n + 1))
    assert {r["role"] for r in metrics(straight)} == {"fake", "generator"}
    final = f"checkpoints/step-{n:06d}"
    a, b = _files(straight / final), _files(cut / final)
    assert a.keys() == b.keys() and "state/cycle_start.safetensors" in _files(cut / "checkpoints/step-000002")
    assert [key for key in a if a[key] != b[key]] == []
    assert json.loads((straight / "run.json").read_text())["backend"] == {
        "kind": "deepspeed",
        "world_size": 2,
    }


@opt_in
@pytest.mark.integration
def test_zero2_dmd2_two_ranks_match_one_rank(dmd2_run, one_rank):
    _, n, _, _ = DMD2
    single, double = metrics(one_rank), metrics(dmd2_run / "straight")
    assert len(single) == len(double) == n
    for one, two in zip(single, double):
        for key, value in one.items():
            if isinstance(value, float):
                assert abs(value - two[key]) <= 1e-7 + 1e-5 * abs(value), (one["optimizer_step"], key)
            else:
                assert value == two[key], key
    final = f"checkpoints/step-{n:06d}/model"
    for variant in ("generator", "fake"):
        full = load_file(one_rank / final / variant / "diffusion_pytorch_model.safetensors")
        gathered = load_file(dmd2_run / "straight" / final / variant / "diffusion_pytorch_model.safetensors")
        assert full.keys() == gathered.keys()
        for key, value in full.items():
            assert float((gathered[key] - value).abs().max()) <= 1e-5, (variant, key)


def _shapes(path):
    with safe_open(str(path), "pt") as handle:
        return {key: list(handle.get_slice(key).get_shape()) for key in handle.keys()}


@opt_in
@pytest.mark.integration
def test_zero2_checkpoint_has_the_single_backend_layout(dmd2_run, one_rank):
    _, n, _, _ = DMD2
    final = f"checkpoints/step-{n:06d}"
    zero, single = dmd2_run / "straight" / final, one_rank / final
    assert _files(zero).keys() == _files(single).keys()
    assert json.loads((zero / "state/optimizer.json").read_text()) == json.loads(
        (single / "state/optimizer.json").read_text()
    )
    for name in ("state/optimizer.safetensors", "state/variants.safetensors"):
        assert _shapes(zero / name) == _shapes(single / name), name
    # the gathered moments are the one-process moments (not one rank's partition, not zeros)
    moments, expected = (
        load_file(zero / "state/optimizer.safetensors"),
        load_file(single / "state/optimizer.safetensors"),
    )
    worst = max(float((moments[key] - value).abs().max()) for key, value in expected.items())
    assert worst <= 1e-5 and any(float(v.abs().max()) > 0 for v in moments.values())
