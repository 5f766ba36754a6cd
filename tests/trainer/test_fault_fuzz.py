"""Config and checkpoint fuzz through the trainer's Python entry (``reference_trainer.cli.main``).

Every case must end with exit code 2 and exactly one ``error:`` line on stderr that names the field,
the file (and line), or the checkpoint file at fault — never a traceback. The cases:

* **fields** — generated from the config dataclasses themselves (every section, every trainer's
  ``train:`` arguments): a value of the wrong type for each field's annotation, non-finite numbers
  for float fields, and an unknown key in every section, each given as ``--set``;
* **semantic** — values of the right type that no run can use (the fault-injection list of
  ``issues show 18``: huge thread counts and rollouts, dataset fields on a generation trainer, an
  empty optimizer list, missing fixtures, unknown rewards, ...);
* **yaml** — bad config files (syntax, tabs, binary, NUL, ``!!python`` tags that must never run,
  duplicate keys, a top level that is not a mapping) and bad ``--set`` forms;
* **checkpoint** — each file of a real checkpoint missing, truncated, garbled or emptied, tensors of
  the wrong shape with a consistent manifest, and malformed trainer states, each resumed both as
  ``--resume DIR`` and as ``--resume latest`` over a run whose only checkpoint it is.

``test_case_counts`` prints the number of cases of each kind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import types
import typing
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO
from helpers.trainer.trainer_utils import GRPO_CONFIG
from safetensors.torch import load_file, save_file

from reference_trainer.config import RunConfig
from reference_trainer.registry import resolve_trainer, trainer_names


def example(trainer: str) -> Path:
    return REPO / "examples" / trainer / "full" / "sd3_tiny" / "default.yaml"


def invoke(capsys, args: list[str]) -> list[str]:
    """Run the CLI in process; assert exit 2 and one error line without a traceback; that line."""
    from reference_trainer.cli import main

    capsys.readouterr()
    code = main(args)
    captured = capsys.readouterr()
    output = captured.out + captured.err
    assert "Traceback" not in output, output
    errors = [line for line in captured.err.splitlines() if line.startswith("reference-trainer: error:")]
    assert code == 2, output
    assert len(errors) == 1, output
    return errors[0]


# --------------------------------------------------------------------------------------------------
# fields: generated from the dataclasses
# --------------------------------------------------------------------------------------------------

WRONG_TYPE: dict[object, tuple[str, ...]] = {
    int: ("abc", "1.5", "true"),
    float: ("abc", ".inf", ".nan", "true"),
    bool: ("maybe", "1"),
    str: ("1", "[a]"),
    "literal": ("not-an-option", "7"),
    "tuple": ("7", "{a: 1}"),
    "dict": ("[1]", "7"),
    "dataclass": ("7", "[1]"),
}


def _kind(annotation: object) -> tuple[object, object]:
    """(a key of WRONG_TYPE, the annotation without its ``None`` option)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    origin = typing.get_origin(annotation)
    if dataclasses.is_dataclass(annotation):
        return "dataclass", annotation
    if origin is typing.Literal:
        return "literal", annotation
    if origin is tuple:
        return "tuple", annotation
    if origin is dict or annotation is dict:
        return "dict", annotation
    return annotation, annotation


def _field_cases(cls: type, prefix: str, raw: object) -> list[tuple[str, str, str]]:
    """(``--set`` key, bad value, expected field name) for every field of ``cls``, recursively; list
    entries present in the example (``optimizers.0``) are fuzzed field by field too."""
    cases = [(f"{prefix}.no_such_field", "1", f"{prefix}.no_such_field")]
    hints = typing.get_type_hints(cls)
    for spec in dataclasses.fields(cls):
        if not spec.init:
            continue
        key = f"{prefix}.{spec.name}" if prefix else spec.name
        kind, annotation = _kind(hints[spec.name])
        cases += [(key, value, key) for value in WRONG_TYPE.get(kind, ())]
        value = raw.get(spec.name) if isinstance(raw, dict) else None
        if kind == "dataclass":
            cases += _field_cases(annotation, key, value)
        element = typing.get_args(annotation)[0] if kind == "tuple" else None
        if dataclasses.is_dataclass(element) and isinstance(value, list) and value:
            cases += [
                (k, v, f"{key}[0]" + name[len(key) + 2 :])
                for k, v, name in _field_cases(element, f"{key}.0", value[0])
            ]
    return cases


def field_cases() -> list[tuple[str, str, str, str]]:
    """(trainer, key, value, field): every section once (GRPO's example), ``train:`` for every trainer
    (a ``train.*`` key and value that an earlier trainer already had, e.g. ``max_grad_norm``, once)."""
    cases = []
    grpo_raw = yaml.safe_load(GRPO_CONFIG.read_text())
    for key, value, name in _field_cases(RunConfig, "", grpo_raw):
        if key != "train" and not key.startswith("train.") and key not in ("trainer", ".no_such_field"):
            cases.append(("grpo", key, value, name))
    for trainer in trainer_names():
        _, arguments = resolve_trainer(trainer)
        raw = yaml.safe_load(example(trainer).read_text()).get("train", {})
        seen = {(key, value) for _, key, value, _ in cases}
        cases += [
            (trainer, key, value, name)
            for key, value, name in _field_cases(arguments, "train", raw)
            if (key, value) not in seen
        ]
    return cases


FIELD_CASES = field_cases()


@pytest.mark.parametrize(
    ("trainer", "key", "value", "field"), FIELD_CASES, ids=[f"{c[0]}:{c[1]}={c[2]}" for c in FIELD_CASES]
)
def test_bad_field_value(trainer, key, value, field, capsys, tmp_path):
    line = invoke(
        capsys, ["train", str(example(trainer)), "--output-dir", str(tmp_path), "--set", f"{key}={value}"]
    )
    assert f"ConfigError: {field}" in line, line


# --------------------------------------------------------------------------------------------------
# semantic: well-typed values that no run can use
# --------------------------------------------------------------------------------------------------

SEMANTIC_CASES: list[tuple[str, tuple[str, ...], str]] = [
    ("grpo", ("runtime.threads=1000000",), "runtime.threads: must be <= "),
    (
        "grpo",
        ("train.group_size=1000000000",),
        "train.prompts_per_iteration, train.group_size, train.num_inference_steps: one rollout needs",
    ),
    (
        "dmd2",
        ("train.prompts_per_iteration=100000000000",),
        "train.prompts_per_iteration, train.fake_updates_per_generator_update: one rollout needs",
    ),
    (
        "grpo",
        ("eval.every=1", "eval.samples_per_prompt=1000000000"),
        "eval.samples_per_prompt, eval.num_inference_steps: one rollout needs",
    ),
    ("grpo", ("data.dataset=tiny",), "data.dataset: is not read by trainer 'grpo'"),
    ("online_dpo", ("data.batch_size=4",), "data.batch_size: is not read by trainer 'online_dpo'"),
    ("dmd2", ("data.shuffle=false",), "data.shuffle: is not read by trainer 'dmd2'"),
    ("sft", ("data.prompts=[a cat]",), "data.prompts: is not read by trainer 'sft'"),
    ("grpo", ("optimizers=[]",), "optimizers: is an empty list"),
    ("grpo", ("optimizers.0.role=critic",), "optimizers[0].role: 'critic' is not a role of 'grpo'"),
    ("grpo", ("optimizers=[{role: policy}, {role: policy}]",), "optimizers: roles listed more than once"),
    ("grpo", ("train.max_grad_norm=.inf",), "train.max_grad_norm: must be a finite number"),
    ("grpo", ("train.max_grad_norm=-1",), "train.max_grad_norm: must be >= 0"),
    ("grpo", ("optimizers.0.lr=.inf",), "optimizers[0].lr: must be a finite number"),
    ("grpo", ("optimizers.0.lr=1e400",), "optimizers[0].lr: must be a finite number"),
    ("grpo", ("optimizers.0.lr=0",), "optimizers[0].lr: must be > 0"),
    ("grpo", ("seed=-1",), "seed: must be in [0, 2**63)"),
    ("grpo", ("seed=18446744073709551616",), "seed: must be in [0, 2**63)"),
    ("grpo", ("eval.seed=-5",), "eval.seed: must be in [0, 2**63)"),
    ("grpo", ("max_steps=0",), "max_steps: must be >= 1"),
    ("grpo", ("trainer=ppo",), "trainer: unknown trainer 'ppo'"),
    ("grpo", ("model.adapter=sdxl",), "unknown adapter 'sdxl'"),
    (
        "grpo",
        ("model.fixture_dir=/nonexistent/fixture",),
        "model.fixture_dir: /nonexistent/fixture does not exist",
    ),
    ("grpo", ("model.fixture_dir={tmp}",), "model.fixture_dir: {tmp} has no tokenizer, text_encoder, vae"),
    ("grpo", ("model.fixture_dir={file}",), "model.fixture_dir: {file} is not a directory"),
    ("grpo", ("model.fixture_dir={broken}",), "model.fixture_dir: {broken} does not load"),
    ("grpo", ("train.rewards=[{name: aesthetic}]",), "train.rewards[0].name: unknown reward 'aesthetic'"),
    (
        "grpo",
        ("train.rewards=[{name: brightness, kwargs: {colour: 1}}]",),
        "train.rewards[0].kwargs: reward 'brightness': bad arguments",
    ),
    (
        "grpo",
        ("train.rewards.0.kwargs.target=2",),
        "train.rewards[0].kwargs: brightness.target must be in [0, 1]",
    ),
    (
        "grpo",
        ("train.rewards.0.kwargs.target=abc",),
        "train.rewards[0].kwargs: reward 'brightness': bad arguments",
    ),
    (
        "grpo",
        ("train.rewards=[{name: jpeg_compressibility, kwargs: {quality: 1000}}]",),
        "train.rewards[0].kwargs: quality must be an integer in [1, 100]",
    ),
    (
        "grpo",
        ("train.rewards=[{name: rank_within_group, kwargs: {base: nope}}]",),
        "train.rewards[0].kwargs: unknown reward 'nope'",
    ),
    (
        "grpo",
        ("train.rewards=[{name: brightness}, {name: brightness}]",),
        "train.rewards: rewards listed more than once",
    ),
    (
        "grpo",
        ("train.advantage.weights={contrast: 2.0}",),
        "train.advantage.weights.contrast: is not a configured reward",
    ),
    (
        "grpo",
        ("eval.rewards=[{name: color_target, kwargs: {target: [1, 0]}}]",),
        "eval.rewards[0].kwargs: color_target.target must be 3 values",
    ),
    ("grpo", ("eval.rewards=[]",), "eval.rewards: needs at least one reward"),
    (
        "sft",
        ("train.gradient_accumulation_steps=3",),
        "train.gradient_accumulation_steps: a rank-local epoch has 4 batches",
    ),
    (
        "sft",
        ("data.dataset=/nonexistent/dataset",),
        "data.dataset: /nonexistent/dataset/demonstrations.jsonl not found",
    ),
    ("grpo", ("--output-dir={file}",), "--output-dir: {file} is a file, not a directory"),
    ("grpo", ("--output-dir={file}/run",), "--output-dir: {file}/run is inside {file}, which is a file"),
]


@pytest.mark.parametrize(
    ("trainer", "sets", "expected"),
    SEMANTIC_CASES,
    ids=[c[2].split(":")[0] + "|" + ",".join(c[1]) for c in SEMANTIC_CASES],
)
def test_unusable_value(trainer, sets, expected, capsys, tmp_path):
    a_file, broken = tmp_path / "a_file", tmp_path / "broken"
    a_file.write_text("not a directory\n")
    shutil.copytree(REPO / "reference_trainer/fixtures/sd3_tiny", broken)
    (broken / "transformer/config.json").write_text("{ not json")
    names = {"tmp": str(tmp_path / "empty"), "file": str(a_file), "broken": str(broken)}
    (tmp_path / "empty").mkdir()
    args = ["train", str(example(trainer)), "--output-dir", str(tmp_path / "out")]
    for setting in sets:
        for name, value in names.items():
            setting = setting.replace("{" + name + "}", value)
        args += setting.split("=", 1) if setting.startswith("--") else ["--set", setting]
    line = invoke(capsys, args)
    for name, value in names.items():
        expected = expected.replace("{" + name + "}", value)
    assert expected in line, line


# --------------------------------------------------------------------------------------------------
# yaml: bad files and bad --set forms
# --------------------------------------------------------------------------------------------------

GOOD = GRPO_CONFIG.read_text()

YAML_CASES: list[tuple[str, bytes | None, tuple[str, ...], str]] = [
    (
        "unclosed-flow",
        b"seed: 0\ntrainer: grpo\ndata: {prompts: [a, b\n",
        (),
        "cfg.yaml:4:1: while parsing a flow",
    ),
    (
        "tab-indent",
        b"seed: 0\nmodel:\n\tadapter: sd3-tiny\n",
        (),
        "cfg.yaml:3:1: while scanning for the next token; found character '\\t'",
    ),
    (
        "tab-in-mapping",
        GOOD.replace("  group_size: 4", "\tgroup_size: 4").encode(),
        (),
        "(YAML indents with spaces, never tabs)",
    ),
    ("binary", bytes(range(256)) * 4, (), "cfg.yaml: not a UTF-8 text file (byte 128)"),
    (
        "latin-1",
        "seed: 0\ntrainer: grpo # caf\xe9\n".encode("latin-1"),
        (),
        "cfg.yaml: not a UTF-8 text file (byte 27)",
    ),
    ("nul-byte", b"seed: 0\x00\ntrainer: grpo\n", (), "cfg.yaml:byte 7: unacceptable character #x0000"),
    (
        "python-tag",
        b"seed: !!python/object/apply:os.getpid []\n",
        (),
        "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.getpid'",
    ),
    (
        "python-name-tag",
        b"trainer: !!python/name:os.system\n",
        (),
        "cfg.yaml:1:10: could not determine a constructor",
    ),
    ("custom-tag", b"seed: !secret 3\n", (), "could not determine a constructor for the tag '!secret'"),
    (
        "duplicate-key",
        GOOD.replace("seed: 0\n", "seed: 0\nseed: 1\n", 1).encode(),
        (),
        "key 'seed' is given twice",
    ),
    (
        "nested-duplicate",
        GOOD.replace("  group_size: 4\n", "  group_size: 4\n  group_size: 8\n").encode(),
        (),
        "key 'group_size' is given twice",
    ),
    ("undefined-alias", b"seed: *nothing\n", (), "cfg.yaml:1:7: found undefined alias 'nothing'"),
    (
        "top-level-list",
        b"- seed: 0\n",
        (),
        "cfg.yaml: the top level must be a mapping of config fields, got [{'seed': 0}] (list)",
    ),
    ("top-level-scalar", b"just text\n", (), "cfg.yaml: the top level must be a mapping"),
    ("empty-file", b"", (), "cfg.yaml: the top level must be a mapping of config fields, got None"),
    (
        "integer-key",
        GOOD.replace("seed: 0\n", "seed: 0\n1: one\n", 1).encode(),
        (),
        "ConfigError: 1: unknown top-level field",
    ),
    (
        "train-scalar",
        GOOD.replace("train:\n", "train: 3\nold_train:\n").encode(),
        (),
        "train: must be a mapping",
    ),
    ("missing-file", None, (), "config file not found"),
    ("directory", b"", ("dir",), "config file not found"),
    (
        "set-no-equals",
        GOOD.encode(),
        ("--set", "train.group_size"),
        "--set: expected dotted.key=value, got 'train.group_size'",
    ),
    ("set-empty-key", GOOD.encode(), ("--set", "=3"), "--set: expected dotted.key=value"),
    (
        "set-bad-yaml",
        GOOD.encode(),
        ("--set", "train.group_size=[4"),
        "--set train.group_size:1:3: while parsing a flow sequence",
    ),
    (
        "set-python-tag",
        GOOD.encode(),
        ("--set", "seed=!!python/object/apply:os.getpid []"),
        "--set seed:1:1: could not determine a constructor",
    ),
    ("set-tab", GOOD.encode(), ("--set", "seed=\t3: x"), "--set seed:"),
    (
        "set-duplicate",
        GOOD.encode(),
        ("--set", "train.advantage={global_std: true, global_std: false}"),
        "key 'global_std' is given twice",
    ),
    (
        "set-index-out-of-range",
        GOOD.encode(),
        ("--set", "optimizers.5.lr=1.0"),
        "optimizers.5: is not an index of a list of 1 entries",
    ),
    ("set-inside-scalar", GOOD.encode(), ("--set", "seed.value=1"), "seed: is not a mapping or a list"),
    (
        "set-unknown-section",
        GOOD.encode(),
        ("--set", "logging.level=debug"),
        "logging: unknown top-level field",
    ),
]


@pytest.mark.parametrize(
    ("text", "extra", "expected"), [c[1:] for c in YAML_CASES], ids=[c[0] for c in YAML_CASES]
)
def test_bad_yaml(text, extra, expected, capsys, tmp_path, monkeypatch):
    import os

    calls: list[str] = []
    monkeypatch.setattr(os, "getpid", lambda: calls.append("getpid") or 1)  # a tag must never run
    path = tmp_path / "cfg.yaml"
    if extra[:1] == ("dir",):
        path.mkdir()
        extra = ()
    elif text is not None:
        path.write_bytes(text)
    monkeypatch.chdir(tmp_path)
    line = invoke(capsys, ["train", "cfg.yaml", "--output-dir", str(tmp_path / "out"), *extra])
    monkeypatch.undo()
    assert expected in line, line
    assert calls == []


# --------------------------------------------------------------------------------------------------
# checkpoint: damaged files of every kind
# --------------------------------------------------------------------------------------------------

CHECKPOINT_FILES = (
    "manifest.json",
    "model/policy/config.json",
    "model/policy/diffusion_pytorch_model.safetensors",
    "state/optimizer.json",
    "state/optimizer.safetensors",
    "state/rng.json",
    "state/rng.safetensors",
    "state/trainer_state.json",
    "state/variants.safetensors",
)
"""Every file of a GRPO checkpoint between cycles (``test_the_fuzzed_checkpoint_has_these_files``)."""
STEP = "step-000002"
RUN_ARGS = ("--max-steps", "3", "--set", "checkpoint.every=1")


@pytest.fixture(scope="module")
def source_run(tmp_path_factory) -> Path:
    """A 2-step GRPO run with a checkpoint after each step."""
    from reference_trainer.cli import main

    out = tmp_path_factory.mktemp("source")
    assert (
        main(
            [
                "train",
                str(GRPO_CONFIG),
                "--output-dir",
                str(out),
                "--max-steps",
                "2",
                "--set",
                "checkpoint.every=1",
            ]
        )
        == 0
    )
    return out


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for index in range(len(data) // 3, len(data) // 3 + 8):
        data[index] ^= 0x5A
    path.write_bytes(bytes(data))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


DAMAGES: dict[str, Callable[[Path], None]] = {
    "missing": Path.unlink,
    "truncated": _truncate,
    "garbled": _garble,
    "emptied": _empty,
}


def _rewrite_manifest(checkpoint: Path) -> None:
    """Re-hash the checkpoint: a damage the hashes cannot see (the layout checks must)."""
    from reference_trainer.checkpoint import write_manifest

    (checkpoint / "manifest.json").unlink()
    write_manifest(checkpoint)


def _reshape_first(file: str, key_filter: Callable[[str], bool] = lambda key: True) -> Callable[[Path], None]:
    def damage(checkpoint: Path) -> None:
        tensors = load_file(checkpoint / file)
        key = next(
            k for k in sorted(tensors) if key_filter(k) and tensors[k].ndim >= 1 and tensors[k].numel() > 1
        )
        tensors[key] = tensors[key].reshape(-1)[:-1].clone()
        save_file(tensors, checkpoint / file)
        _rewrite_manifest(checkpoint)

    return damage


def _edit_state(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(checkpoint: Path) -> None:
        path = checkpoint / "state/trainer_state.json"
        state = json.loads(path.read_text())
        change(state)
        path.write_text(json.dumps(state))
        _rewrite_manifest(checkpoint)

    return damage


def _manifest_text(files: dict) -> str:
    """A well-formed manifest of ``files`` (with the sha256 of its own entries, as documented)."""
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    return json.dumps({"format": 1, "files": files, "sha256": digest})


def _drop_from_manifest(file: str) -> Callable[[Path], None]:
    def damage(checkpoint: Path) -> None:
        files = json.loads((checkpoint / "manifest.json").read_text())["files"]
        del files[file]
        (checkpoint / "manifest.json").write_text(_manifest_text(files))

    return damage


def _on_file(damage: Callable[[Path], None], file: str) -> Callable[[Path], None]:
    return lambda checkpoint: damage(checkpoint / file)


def _torch_rng_too_short(checkpoint: Path) -> None:
    tensors = load_file(checkpoint / "state/rng.safetensors")
    key = next(k for k, t in tensors.items() if t.dtype == torch.uint8)
    tensors[key] = tensors[key][:100].clone()
    save_file(tensors, checkpoint / "state/rng.safetensors")
    _rewrite_manifest(checkpoint)


CONSISTENT_DAMAGES: dict[str, tuple[Callable[[Path], None], str]] = {
    "variants-wrong-shape": (
        _reshape_first("state/variants.safetensors"),
        "state/variants.safetensors: tensor variant.policy.",
    ),
    "export-wrong-shape": (
        _reshape_first("model/policy/diffusion_pytorch_model.safetensors"),
        "model/policy/diffusion_pytorch_model.safetensors: tensor ",
    ),
    "optimizer-wrong-shape": (
        _reshape_first("state/optimizer.safetensors", lambda k: "exp_avg" in k),
        "state/optimizer.safetensors: composite[0] state ",
    ),
    "rng-wrong-size": (_torch_rng_too_short, "state/rng.safetensors: not a valid RNG state"),
    "state-step-text": (
        _edit_state(lambda s: s.update(optimizer_step="2")),
        "state/trainer_state.json: optimizer_step must be a non-negative integer",
    ),
    "state-no-sampler": (
        _edit_state(lambda s: s.pop("sampler")),
        "state/trainer_state.json: sampler.data_epoch must be",
    ),
    "state-negative-cycle": (
        _edit_state(lambda s: s["cycle"].update(steps_done=-1)),
        "state/trainer_state.json: cycle.steps_done must be",
    ),
    "state-wrong-step": (
        _edit_state(lambda s: s.update(optimizer_step=5)),
        "state/trainer_state.json: records optimizer_step 5, the directory is step-000002",
    ),
    "state-no-schema": (
        _edit_state(lambda s: s["identity"].pop("schema")),
        "state/trainer_state.json: identity.schema.variants is missing",
    ),
    "state-cycle-without-weights": (
        _edit_state(lambda s: s["cycle"].update(steps_done=1)),
        "manifest.json: does not list state/cycle_start.safetensors",
    ),
    "state-json-list": (
        lambda c: ((c / "state/trainer_state.json").write_text("[]"), _rewrite_manifest(c)),
        "state/trainer_state.json: not a JSON object",
    ),
    "optimizer-json-garbage": (
        lambda c: ((c / "state/optimizer.json").write_text('{"__dict__": 3}'), _rewrite_manifest(c)),
        "state/optimizer.json: does not match state/optimizer.safetensors",
    ),
    "manifest-not-json": (lambda c: (c / "manifest.json").write_text("{"), "manifest.json: not valid JSON"),
    "manifest-wrong-format": (
        lambda c: (c / "manifest.json").write_text('{"format": 9, "files": {}}'),
        "manifest.json: not a format-1 manifest",
    ),
    "manifest-escapes": (
        lambda c: (c / "manifest.json").write_text(_manifest_text({"../x": {"sha256": "0", "bytes": 1}})),
        "manifest.json: malformed entry for '../x'",
    ),
    "manifest-drops-rng": (
        _drop_from_manifest("state/rng.json"),
        "manifest.json: does not list state/rng.json",
    ),
    "manifest-drops-export": (
        _drop_from_manifest("model/policy/diffusion_pytorch_model.safetensors"),
        "manifest.json: does not list model/policy/diffusion_pytorch_model.safetensors",
    ),
}

CHECKPOINT_CASES = [
    (
        f"{kind}:{file}",
        _on_file(damage, file),
        file + ("" if file != "manifest.json" or kind != "missing" else ": missing"),
    )
    for file in CHECKPOINT_FILES
    for kind, damage in DAMAGES.items()
] + [(name, damage, expected) for name, (damage, expected) in CONSISTENT_DAMAGES.items()]
MODES = ("explicit", "latest")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("damage", "expected"), [c[1:] for c in CHECKPOINT_CASES], ids=[c[0] for c in CHECKPOINT_CASES]
)
def test_damaged_checkpoint(damage, expected, mode, source_run, capsys, tmp_path):
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / STEP  # the damaged checkpoint is the run's only one
    shutil.copytree(source_run / "checkpoints" / STEP, checkpoint)
    damage(checkpoint)
    resume = str(checkpoint) if mode == "explicit" else "latest"
    line = invoke(
        capsys, ["train", str(GRPO_CONFIG), "--output-dir", str(run), *RUN_ARGS, "--resume", resume]
    )
    assert f"{checkpoint}/{expected}" in line, line
    if mode == "latest":
        assert "--resume latest: no valid checkpoint under" in line


STRAY_CASES = [
    (
        "step-abc-directory",
        lambda root: (root / "step-abc").mkdir(),
        "--resume latest: no complete checkpoint under",
    ),
    (
        "step-file",
        lambda root: (root / "step-000007").write_text("x"),
        "--resume latest: no complete checkpoint under",
    ),
    (
        "tmp-of-a-killed-save",
        lambda root: (root / ".tmp-step-000002-99/state").mkdir(parents=True),
        "no complete checkpoint",
    ),
]


@pytest.mark.parametrize(("make", "expected"), [c[1:] for c in STRAY_CASES], ids=[c[0] for c in STRAY_CASES])
def test_stray_entries_are_not_checkpoints(make, expected, capsys, tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    make(root)
    line = invoke(
        capsys, ["train", str(GRPO_CONFIG), "--output-dir", str(tmp_path), *RUN_ARGS, "--resume", "latest"]
    )
    assert expected in line, line


def test_resume_of_a_path_that_is_not_a_checkpoint(capsys, tmp_path):
    line = invoke(
        capsys, ["train", str(GRPO_CONFIG), "--output-dir", str(tmp_path), "--resume", str(tmp_path / "nope")]
    )
    assert f"--resume {tmp_path / 'nope'}: not a checkpoint directory" in line


def test_the_fuzzed_checkpoint_has_these_files(source_run):
    """The file list fuzzed above is the real checkpoint's: a new file kind cannot go unfuzzed."""
    checkpoint = source_run / "checkpoints" / STEP
    files = sorted(
        path.relative_to(checkpoint).as_posix() for path in checkpoint.rglob("*") if path.is_file()
    )
    assert files == sorted(CHECKPOINT_FILES)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert sorted(manifest["files"]) == sorted(set(CHECKPOINT_FILES) - {"manifest.json"})


def test_case_counts(capsys):
    counts = Counter(
        {
            "fields": len(FIELD_CASES),
            "semantic": len(SEMANTIC_CASES),
            "yaml": len(YAML_CASES),
            "checkpoint": len(CHECKPOINT_CASES) * len(MODES) + len(STRAY_CASES) + 1,
        }
    )
    with capsys.disabled():
        print(f"\nfault fuzz cases: {dict(counts)}, total {sum(counts.values())}")
    assert counts["checkpoint"] >= len(CHECKPOINT_FILES) * len(DAMAGES) * len(MODES)
    assert sum(counts.values()) >= 100
