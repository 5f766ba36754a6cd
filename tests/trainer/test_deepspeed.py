"""``backend.kind: deepspeed`` (ZeRO-1/2, ``reference_trainer.zero``).

In CI (deepspeed never imported): the extra missing is refused naming the install command; the plan
rules (ZeRO-3, Muon, a missing ``zero_stage``, no torchrun launch) are in ``test_distributed.py``.

Opt-in (``FFDEBUG_TEST_DEEPSPEED=1``, the extra installed with ``DS_BUILD_OPS=0``; the first launch
JIT-builds DeepSpeed's shared-memory op, a few minutes on a busy machine): two two-rank torchrun
launches, DMD2 under ZeRO-2 (two roles, one engine each, cut inside a rollout iteration; 4 steps
straight, 2 then resumed to 4) and SFT under ZeRO-1 (two backward calls per step; 3 straight, 1 then
resumed to 3). Metrics and the final checkpoint are bitwise equal; each matches a one-process run with
the same global batch (metrics within 1e-7 + 1e-5·|value|, exported weights within
1e-5); the checkpoint has the single backend's layout (same files, same optimizer skeleton, same tensor
names and shapes).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.trainer.trainer_utils import assert_rank_layout_matches, example, load, metrics
from safetensors import safe_open
from safetensors.torch import load_file
from test_distributed import FAST_EVAL, _files, torchrun

OPT_IN = os.environ.get("FFDEBUG_TEST_DEEPSPEED") == "1"
opt_in = pytest.mark.skipif(
    not OPT_IN,
    reason="opt-in: set FFDEBUG_TEST_DEEPSPEED=1 with the extra installed "
    "(DS_BUILD_OPS=0 pip install 'ffdebug[deepspeed]')",
)
CASES = {
    # trainer: (N, M, two-rank overrides; the one-rank run has the same global batch with none)
    "dmd2": (4, 2, ["train.prompts_per_iteration=2", "backend.kind=deepspeed", "backend.zero_stage=2"]),
    # two backward calls per step (gradient_accumulation_steps: 2), ZeRO-1
    "sft": (3, 1, ["data.batch_size=1", "backend.kind=deepspeed", "backend.zero_stage=1"]),
}


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


@pytest.fixture(scope="module", params=sorted(CASES))
def runs(request, tmp_path_factory):
    """(trainer, N, the two-rank launch's directory, a one-rank run of N steps)."""
    from reference_trainer.run import train

    name = request.param
    n, m, overrides = CASES[name]
    two = tmp_path_factory.mktemp(f"deepspeed-{name}")
    torchrun("resume", str(two), name, str(n), str(m), FAST_EVAL, *overrides)
    one = tmp_path_factory.mktemp(f"deepspeed-one-rank-{name}")
    torch.set_num_threads(1)
    train(load(example(name), FAST_EVAL, max_steps=n), one)
    return name, n, two, one


@opt_in
@pytest.mark.integration
def test_two_rank_exact_resume(runs):
    name, n, two, _ = runs
    straight, cut = two / "straight", two / "cut"
    assert (straight / "metrics.jsonl").read_bytes() == (cut / "metrics.jsonl").read_bytes()
    assert [r["optimizer_step"] for r in metrics(straight)] == list(range(1, n + 1))
    final = f"checkpoints/step-{n:06d}"
    a, b = _files(straight / final), _files(cut / final)
    assert a.keys() == b.keys()
    if name == "dmd2":  # two roles, cut inside a rollout iteration
        assert {r["role"] for r in metrics(straight)} == {"fake", "generator"}
        assert "state/cycle_start.safetensors" in _files(cut / "checkpoints/step-000002")
    assert [key for key in a if a[key] != b[key]] == []
    assert json.loads((straight / "run.json").read_text())["backend"] == {
        "kind": "deepspeed",
        "world_size": 2,
    }


@opt_in
@pytest.mark.integration
def test_two_ranks_match_one_rank(runs):
    _, n, two, one = runs
    single, double = metrics(one), metrics(two / "straight")
    assert len(single) == len(double) == n
    assert_rank_layout_matches(single, double)
    final = f"checkpoints/step-{n:06d}/model"
    for variant in sorted(p.name for p in (one / final).iterdir()):
        full = load_file(one / final / variant / "diffusion_pytorch_model.safetensors")
        gathered = load_file(two / "straight" / final / variant / "diffusion_pytorch_model.safetensors")
        assert full.keys() == gathered.keys()
        for key, value in full.items():
            assert float((gathered[key] - value).abs().max()) <= 1e-5, (variant, key)


def _shapes(path):
    with safe_open(str(path), "pt") as handle:
        return {key: list(handle.get_slice(key).get_shape()) for key in handle.keys()}


@opt_in
@pytest.mark.integration
def test_checkpoint_has_the_single_backend_layout(runs):
    _, n, two, one = runs
    final = f"checkpoints/step-{n:06d}"
    zero, single = two / "straight" / final, one / final
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


class _Engine:
    """Stands in for a ``DeepSpeedEngine`` in the role routing of ``ZeroOptimizer`` (no deepspeed)."""

    def __init__(self):
        self.backwards = 0

    def backward(self, loss):
        self.backwards += 1
        loss.backward()


def test_a_loss_reaching_another_roles_parameters_is_refused():
    from torch import nn

    from reference_trainer.config import OptimizerConfig
    from reference_trainer.optim import build_optimizer
    from reference_trainer.zero import ZeroOptimizer

    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    layout = build_optimizer(
        {"a": list(a.parameters()), "b": list(b.parameters())},
        {"a": OptimizerConfig(role="a"), "b": OptimizerConfig(role="b")},
    )
    engines = {"a": _Engine(), "b": _Engine()}
    zero = ZeroOptimizer(layout, engines)
    x = torch.ones(1, 2)
    zero.backward("a", a(b(x).detach()).sum())  # b's output without gradient: accepted
    assert (engines["a"].backwards, b.weight.grad) == (1, None)
    with pytest.raises(
        RuntimeError, match=r"'a' loss back-propagates into the parameters of role\(s\) \['b'\]"
    ):
        zero.backward("a", a(b(x)).sum())
