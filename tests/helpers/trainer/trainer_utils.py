"""Helpers of the reference-trainer tests (framework and algorithm tests alike); not a test module.

The one owner of: the example configs (``example``, ``GRPO_CONFIG``), loading a config (``load``),
reading a run's ``metrics.jsonl`` (``metrics``), building and running trainers (``make_trainer``,
``learning_run``), state snapshots and digests, the fixed-noise evaluation reward, and the asserts on
frozen / updated parameters."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from helpers import REPO


def example(algorithm: str, variant: str = "default") -> Path:
    """The example config of ``algorithm`` for the tiny SD3 fixtures."""
    return REPO / "examples" / algorithm / "full" / "sd3_tiny" / f"{variant}.yaml"


GRPO_CONFIG = example("grpo")


def load(config: Path | str = GRPO_CONFIG, *overrides: str, max_steps: int | None = None):
    from reference_trainer.config import load_config

    return load_config(config, overrides=overrides, max_steps=max_steps)


def metrics(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def state_digest(module: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (names and bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def clone_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.state_dict().items()}


@torch.no_grad()
def eval_reward(trainer, samples_per_prompt: int = 4, seed: int = 1234) -> float:
    """Mean training reward of the current policy on every configured prompt, with fixed noise."""
    prompts = list(trainer.prompts.prompts)
    repeated = [prompt for prompt in prompts for _ in range(samples_per_prompt)]
    condition = trainer.conditions.get(repeated)
    trajectory = trainer.adapter.inference(
        condition,
        num_steps=trainer.args.num_inference_steps,
        noise_level=trainer.args.noise_level,
        generator=torch.Generator().manual_seed(seed),
        module=trainer.variants.variant("policy"),
    )
    images = trainer.adapter.decode_latents(trajectory.final)
    group_ids = torch.arange(len(prompts)).repeat_interleave(samples_per_prompt)
    rewards = trainer.feedback.reward_processor(images, repeated, group_ids)
    return float(sum(values for values in rewards.values()).mean())


def make_trainer(
    algorithm: str, out: Path, max_steps: int, *overrides: str, resume: str | None = None
) -> Any:
    from reference_trainer.run import build_trainer

    return build_trainer(load(example(algorithm), *overrides, max_steps=max_steps), out, resume=resume)


def frozen_state(trainer: Any) -> dict[str, torch.Tensor]:
    """Clones of everything that must never change: frozen components and every snapshot."""
    state = {}
    for name in trainer.adapter.component_names():
        component = trainer.adapter.get_component(name)
        if isinstance(component, torch.nn.Module) and component is not trainer.adapter.trainable_module():
            for key, value in component.state_dict().items():
                state[f"{name}.{key}"] = value.detach().clone()
    for name, params in trainer.variants.snapshots.items():
        for key, value in params.items():
            state[f"snapshot.{name}.{key}"] = value.detach().clone()
    return state


def variant_state(trainer: Any) -> dict[str, dict[str, torch.Tensor]]:
    return {
        name: {key: p.detach().clone() for key, p in module.named_parameters()}
        for name, module in trainer.variants.variants.items()
    }


def assert_bit_identical(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    changed = [key for key in before if not torch.equal(before[key], after[key])]
    assert not changed, f"frozen tensors changed: {changed[:5]}"


def learning_run(name: str, out, steps: int, *overrides: str) -> dict[str, Any]:
    """Train ``name`` for ``steps`` steps into ``out``: the trainer, its frozen state and variants
    before, and the fixed-noise evaluation reward before and after (the learning tests' fixture)."""
    trainer = make_trainer(name, out, steps, *overrides)
    frozen, initial = frozen_state(trainer), variant_state(trainer)
    before = eval_reward(trainer)
    trainer.start()
    after = eval_reward(trainer)
    return dict(trainer=trainer, out=out, frozen=frozen, initial=initial, before=before, after=after)


def assert_frozen_except_followers(
    before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], following: tuple[str, ...]
) -> None:
    """Frozen state is bit-identical except the snapshots that follow the policy (key prefixes in
    ``following``), and each of those changed."""
    assert_bit_identical(
        {k: v for k, v in before.items() if not k.startswith(following)},
        {k: v for k, v in after.items() if not k.startswith(following)},
    )
    for prefix in following:
        assert any(not torch.equal(v, after[k]) for k, v in before.items() if k.startswith(prefix)), prefix


def gradient_free_parameters(trainer: Any, module: torch.nn.Module) -> set[str]:
    """Parameters that get no gradient from any velocity output (e.g. the context query of SD3's last,
    ``context_pre_only`` block): probed with one backward through a deep copy of ``module``."""
    probe = copy.deepcopy(module)
    condition = trainer.adapter.encode_prompt(["a red cat", "a blue dog"])
    x = torch.randn((2, *trainer.adapter.latent_shape), generator=torch.Generator().manual_seed(0))
    v = trainer.adapter.forward(x, torch.tensor([0.3, 0.7]), condition, module=probe)
    v.square().sum().backward()
    return {key for key, p in probe.named_parameters() if p.grad is None or not bool(p.grad.abs().sum() > 0)}


def assert_every_parameter_changed(
    trainer: Any, before: dict[str, torch.Tensor], module: torch.nn.Module, role: str
) -> None:
    """Every parameter of ``role`` that can receive a gradient was updated."""
    unchanged = {key for key, p in module.named_parameters() if torch.equal(before[key], p.detach())}
    unchanged -= gradient_free_parameters(trainer, module)
    assert not unchanged, f"role {role!r}: parameters not updated: {sorted(unchanged)[:5]}"


def assert_rollout_velocities_replay(trainer: Any) -> None:
    """A fresh rollout of a GRPO-family trainer: the rollout step recomputed from the stored velocities
    (``GRPOTrainer.rollout_step``) gives the stored log p_old of every step, bit for bit."""
    samples = trainer.sample()
    index = torch.arange(len(samples.prompts))
    assert samples.trajectory.velocities.shape[:2] == samples.trajectory.log_probs.shape
    with torch.no_grad():
        for j in range(trainer.args.num_inference_steps):
            _, _, sde_args = trainer.policy_step(samples, index, j)
            _, old = trainer.rollout_step(samples, index, j, sde_args)
            assert torch.equal(old.log_prob, samples.trajectory.log_probs[:, j]), f"step {j}"


def rank_split(config_path: Path, world_size: int, *overrides: str) -> list[str]:
    """The overrides that give each of ``world_size`` ranks its equal share of the global batch that
    one process runs with ``config_path`` (and ``overrides``): the first factor of the trainer's rollout
    size (prompts per iteration, per rank) or, for dataset trainers, ``data.batch_size``, divided by
    ``world_size``. Read from the config, so a newly registered trainer is covered without a table.

    Raises:
        ValueError: the per-rank size does not divide by ``world_size``.
    """
    config = load(config_path, *overrides)
    size = config.train.rollout_size()
    field, value = size.factors[0] if size is not None else ("data.batch_size", config.data.batch_size)
    if value % world_size:
        raise ValueError(f"{config_path}: {field} = {value} does not split over {world_size} ranks")
    return [f"{field}={value // world_size}"]


def parity_cases() -> dict[str, Path]:
    """Every example config of every registered trainer on the tiny SD3 fixtures, by case name:
    ``<trainer>`` for ``default.yaml``, ``<trainer>-<variant>`` for ``<variant>.yaml``."""
    from reference_trainer.registry import load_builtins, trainer_names

    load_builtins()
    cases = {}
    for name in trainer_names():
        for path in sorted(example(name).parent.glob("*.yaml")):
            cases[name if path.stem == "default" else f"{name}-{path.stem}"] = path
    return cases


PARITY_MODES = ("trained", "still")
"""The rank-parity runs: with the example learning rates, and with every learning rate at 1e-12."""


def still_overrides(config_path: Path, mode: str) -> list[str]:
    """``mode`` "still": every optimizer's ``lr`` at 1e-12 (the weights do not move, every step reads the
    initial weights); "trained": none."""
    if mode == "trained":
        return []
    return [f"optimizers.{i}.lr=1e-12" for i in range(len(load(config_path).optimizers))]


RANK_LAYOUT_ABS = 1e-7
RANK_LAYOUT_REL = 1e-5


def assert_rank_layout_matches(
    single: list[dict[str, Any]],
    double: list[dict[str, Any]],
    *,
    abs_tol: float = RANK_LAYOUT_ABS,
    rel_tol: float = RANK_LAYOUT_REL,
) -> None:
    """A run on several ranks logs the numbers of one process with the same global batch: every float of
    every record within ``abs_tol + rel_tol·|value|``, everything else equal.

    Not bit-equal: each rank's forward runs a smaller batch, whose GEMMs take other kernels (which ones
    depends on the CPU), and the gradients are summed over ranks in another order; AdamW's first steps
    carry those last bits on. The defaults hold with margin wherever the logged numbers are not
    differences of larger terms or amplified by a large factor (worst measured 0.45 x at
    ATEN_CPU_CAPABILITY avx2 and default, on ``advantage_mean``, a mean of normalised advantages near 0);
    a test of one that is passes larger tolerances and says why. A rank that misses the other's samples moves them by orders of magnitude."""
    assert len(single) == len(double)
    worst: tuple[float, float, Any, str] = (0.0, 0.0, None, "")
    for one, two in zip(single, double):
        assert one.keys() == two.keys()
        for key, value in one.items():
            if isinstance(value, float):
                off = abs(value - two[key])
                ratio = off / (abs_tol + rel_tol * abs(value))
                if ratio > worst[0]:
                    worst = (ratio, off, one["optimizer_step"], key)
            else:
                assert value == two[key], key
    assert worst[0] <= 1.0, (
        f"step {worst[2]} {worst[3]}: one rank and several differ by {worst[1]:.3g}, {worst[0]:.2f} x the tolerance"
    )
