"""Recovery from damaged run state: checkpoints that fail validation, partial JSONL lines.

The recoveries are checked against an uninterrupted run: after ``--resume latest`` skipped a damaged
newest checkpoint, ``metrics.jsonl`` and ``eval.jsonl`` must equal the uninterrupted run's byte for
byte and the final checkpoint (the model export included) bit for bit. The one-line refusals of every
kind of damage are in ``test_fault_fuzz.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers.trainer.trainer_utils import GRPO_CONFIG
from test_resume import assert_same_files

N = 4
"""Optimizer steps of the uninterrupted run."""
RUN_SETTINGS = ("checkpoint.every=1", "eval.every=2", "eval.num_inference_steps=2")
"""A checkpoint after every step, and evaluations (at 0, 2, 4) whose log the resume must truncate."""


def cli(output_dir: Path, max_steps: int, *extra: str) -> int:
    from reference_trainer.cli import main

    sets = [item for setting in RUN_SETTINGS for item in ("--set", setting)]
    args = ["train", str(GRPO_CONFIG), "--output-dir", str(output_dir), "--max-steps", str(max_steps)]
    return main([*args, *sets, *extra])


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted N-step run."""
    out = tmp_path_factory.mktemp("straight")
    assert cli(out, N) == 0
    return out


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.integration
@pytest.mark.parametrize(
    ("damaged_file", "damage"),
    [
        ("state/variants.safetensors", _truncate),
        ("state/trainer_state.json", _garble),
        ("state/rng.safetensors", Path.unlink),
    ],
    ids=["truncated-variants", "garbled-trainer-state", "missing-rng"],
)
def test_latest_skips_a_damaged_newest_checkpoint_and_matches_the_uninterrupted_run(
    damaged_file, damage, straight, tmp_path, capsys
):
    """A run stopped after step N-1 whose newest checkpoint is then damaged, plus a partial last
    metrics line (a kill mid-write): ``--resume latest`` names the damaged file, resumes from step N-2,
    drops the records after it, and ends exactly where the uninterrupted run ends."""
    from reference_trainer.checkpoint import list_checkpoints

    assert cli(tmp_path, N - 1) == 0
    newest = tmp_path / f"checkpoints/step-{N - 1:06d}"
    assert list_checkpoints(tmp_path)[-1] == newest
    damage(newest / damaged_file)
    metrics_file = tmp_path / "metrics.jsonl"
    complete = metrics_file.stat().st_size
    with open(metrics_file, "a") as stream:
        stream.write('{"optimizer_step": 4, "loss": 0.1')  # no newline: cut mid-write
    capsys.readouterr()

    assert cli(tmp_path, N, "--resume", "latest") == 0
    err = capsys.readouterr().err
    assert f"step-{N - 1:06d}/{damaged_file}" in err and "skipping the damaged checkpoint" in err
    assert f"resuming from step-{N - 2:06d}" in err
    assert f"{metrics_file}: dropping a partial last line at byte offset {complete}" in err
    assert "Traceback" not in err
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (straight / name).read_bytes(), name
    assert_same_files(straight / f"checkpoints/step-{N:06d}", tmp_path / f"checkpoints/step-{N:06d}")
    # the damaged checkpoint was rewritten by the resumed run, and is valid again
    from reference_trainer.checkpoint import validate_checkpoint

    assert validate_checkpoint(newest)["optimizer_step"] == N - 1


@pytest.mark.integration  # `straight` is a trainer run
def test_explicit_resume_of_a_damaged_checkpoint_is_refused_naming_the_file(straight, tmp_path, capsys):
    """``--resume DIR`` never falls back: exit 2, one line naming the file; nothing is rewritten."""
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    checkpoint = run / "checkpoints/step-000003"
    _garble(checkpoint / "state/optimizer.safetensors")
    before = {name: (run / name).read_bytes() for name in ("metrics.jsonl", "eval.jsonl")}
    capsys.readouterr()
    assert cli(run, N + 1, "--resume", str(checkpoint)) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("reference-trainer: error:")]
    assert errors == [
        f"reference-trainer: error: DamagedCheckpointError: {checkpoint}/state/optimizer.safetensors: "
        "contents differ from the sha256 in manifest.json"
    ]
    assert {name: (run / name).read_bytes() for name in before} == before


@pytest.mark.integration  # `straight` is a trainer run
def test_a_bad_line_before_the_last_is_refused_naming_file_and_line(straight, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[1] = '{"optimizer_step": 2, "loss": nan-ish}\n'
    (run / "metrics.jsonl").write_text("".join(lines))
    before = (run / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert cli(run, N + 1, "--resume", "latest") == 2
    errors = [
        line for line in capsys.readouterr().err.splitlines() if line.startswith("reference-trainer: error:")
    ]
    assert len(errors) == 1 and f"LogError: {run / 'metrics.jsonl'}:2: not a JSON record" in errors[0]
    assert (run / "metrics.jsonl").read_bytes() == before


# --------------------------------------------------------------------------------------------------
# the JSONL reader, on its own
# --------------------------------------------------------------------------------------------------

RECORDS = [{"optimizer_step": step, "loss": step / 10} for step in (1, 2, 3)]


def _lines(records) -> bytes:
    return b"".join(json.dumps(record).encode() + b"\n" for record in records)


@pytest.mark.parametrize(
    "tail",
    [b'{"optimizer_step": 4}', b'{"optimizer_step": 4, "lo', b"\x00\x00\x00\n", b'{"optimizer_step": "4"}\n'],
    ids=["complete-json-without-newline", "cut-json", "nul-bytes", "not-a-record"],
)
def test_a_partial_last_line_is_dropped_with_its_byte_offset(tail, tmp_path, capsys):
    from reference_trainer.jsonl import read_jsonl, truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_lines(RECORDS) + tail)
    contents = read_jsonl(path)
    assert list(contents.records) == RECORDS and contents.dropped_at == len(_lines(RECORDS))
    assert (
        f"{path}: dropping a partial last line at byte offset {len(_lines(RECORDS))}"
        in capsys.readouterr().err
    )
    truncate_jsonl(path, 2)
    assert path.read_bytes() == _lines(RECORDS[:2])
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary file left


@pytest.mark.parametrize("bad_line", [2, 3])
def test_a_bad_line_that_is_not_last_is_an_error(bad_line, tmp_path):
    from reference_trainer.jsonl import LogError, read_jsonl

    lines = _lines(RECORDS).splitlines(keepends=True)
    lines[bad_line - 1] = b'{"optimizer_step": \n'
    path = tmp_path / "eval.jsonl"
    path.write_bytes(b"".join(lines) + _lines([{"optimizer_step": 4}]))
    with pytest.raises(LogError, match=rf"^{path}:{bad_line}: "):
        read_jsonl(path)


def test_truncation_keeps_rows_at_or_before_the_step_and_leaves_complete_logs_untouched(tmp_path):
    from reference_trainer.jsonl import truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(_lines(RECORDS))
    inode = path.stat().st_ino
    truncate_jsonl(path, 3)
    assert path.read_bytes() == _lines(RECORDS) and path.stat().st_ino == inode  # nothing to drop
    truncate_jsonl(path, 1)
    assert path.read_bytes() == _lines(RECORDS[:1]) and path.stat().st_ino != inode  # replaced by rename
    truncate_jsonl(tmp_path / "absent.jsonl", 1)
    assert not (tmp_path / "absent.jsonl").exists()


# --------------------------------------------------------------------------------------------------
# checkpoint listing and the fixture's latent shape
# --------------------------------------------------------------------------------------------------


def test_only_step_directories_are_checkpoints(tmp_path):
    from reference_trainer.checkpoint import list_checkpoints

    root = tmp_path / "checkpoints"
    for name in ("step-000002", "step-abc", "step-", ".tmp-step-000003-1", "step-000010"):
        (root / name).mkdir(parents=True)
    (root / "step-000004").write_text("a file")
    assert [path.name for path in list_checkpoints(tmp_path)] == ["step-000002", "step-000010"]


@pytest.mark.parametrize("adapter_name", ["sd3-tiny", "flux-tiny"])
def test_the_fixture_latent_shape_is_the_loaded_one(adapter_name):
    """The memory check reads the latent shape from the fixture's configs; it equals the shape that the
    loaded pipeline reports (and that its samples have)."""
    from reference_trainer.registry import resolve_adapter

    adapter = resolve_adapter(adapter_name)()
    before = adapter.fixture_latent_shape()
    adapter.load_pipeline()
    assert before == adapter.latent_shape
