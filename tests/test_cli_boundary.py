"""The CLIs' one error boundary (`ffdebug.cli.boundary`) and one output sink (`ffdebug.report.sink`).

Every command registered on `ffdebug` is found by walking the click tree, so a command added later
is covered without touching this file: its callback is replaced by one that raises, and the
boundary alone must turn that into one `ffdebug: error:` line with the error's exit code.
"""

from __future__ import annotations

import io
import math
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from ffdebug.cli.app import app
from ffdebug.errors import FFDebugError, InputIdsMismatch

runner = CliRunner()


def _leaf_commands(group, path=()):
    """(command path, click command) of every runnable command below `group`."""
    for name, cmd in sorted(group.commands.items()):
        if hasattr(cmd, "commands"):
            yield from _leaf_commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


def _minimal_args(cmd) -> list[str]:
    """A value for every required argument and option, of the declared type (parsing must succeed)."""
    args: list[str] = []
    for param in cmd.params:
        if not param.required:
            continue
        declared = getattr(param.type_descriptor, "annotation", str)  # typer's record of the annotation
        value = "1" if declared in (int, float) else "x"
        if param.param_type_name == "option":
            args += [param.opts[0], value]
        else:
            args.append(value)
    return args


ROOT = get_command(app)
COMMANDS = list(_leaf_commands(ROOT))


@pytest.fixture(autouse=True)
def _invoke_the_walked_tree(monkeypatch):
    """The runner builds the click tree afresh per call; make it run ROOT, whose callbacks the tests replace."""
    monkeypatch.setattr("typer.testing._get_command", lambda _app: ROOT)


def test_the_walk_finds_every_command():
    """The walk reaches nested groups (playbook show) and plain commands (compare) alike."""
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"compare", "bisect", "inspect", "review", "trace", "playbook show", "weights-diff"} <= names
    assert len(names) == len(COMMANDS) >= 15


@pytest.mark.parametrize("path,cmd", COMMANDS, ids=[" ".join(p) for p, _ in COMMANDS])
def test_every_command_error_goes_through_the_one_boundary(path, cmd, monkeypatch):
    """An FFDebugError from any command body: one stderr line, exit 2, nothing on stdout, no traceback."""

    def bad_input(*args, **kwargs):
        raise FFDebugError(f"{' '.join(path)}: bad input; give a good one")

    monkeypatch.setattr(cmd, "callback", bad_input)
    monkeypatch.delenv("FFDEBUG_DEBUG", raising=False)
    result = runner.invoke(app, [*path, *_minimal_args(cmd)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert result.stderr == f"ffdebug: error: {' '.join(path)}: bad input; give a good one\n"
    assert result.stdout == ""


def test_the_error_keeps_its_exit_code(monkeypatch):
    """InputIdsMismatch is exit 3 (docs/comparing.md "Comparing"), through the same boundary."""
    _, cmd = next(c for c in COMMANDS if c[0] == ("compare",))

    def mismatch(*args, **kwargs):
        raise InputIdsMismatch("input ids differ at position 4; fix tokenization first")

    monkeypatch.setattr(cmd, "callback", mismatch)
    monkeypatch.delenv("FFDEBUG_DEBUG", raising=False)
    result = runner.invoke(app, ["compare", "a", "b"])
    assert (result.exit_code, result.stderr) == (
        3,
        "ffdebug: error: input ids differ at position 4; fix tokenization first\n",
    )


def test_ffdebug_debug_shows_the_traceback(monkeypatch):
    """FFDEBUG_DEBUG=1: the boundary re-raises instead of printing its line."""
    monkeypatch.setenv("FFDEBUG_DEBUG", "1")
    result = runner.invoke(app, ["inspect", "/nonexistent/side"])
    assert isinstance(result.exception, FFDebugError)
    assert "ffdebug: error:" not in result.stderr


def test_an_unknown_exception_is_not_dressed_as_bad_input(monkeypatch):
    """A bug (not an FFDebugError) is re-raised, never answered as a one-line usage error."""
    _, cmd = next(c for c in COMMANDS if c[0] == ("inspect",))

    def bug(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cmd, "callback", bug)
    result = runner.invoke(app, ["inspect", "x"])
    assert isinstance(result.exception, ZeroDivisionError)
    assert "ffdebug: error:" not in result.stderr


def test_a_real_bad_input_ends_at_the_boundary(tmp_path):
    """No decorator left in between: a missing side directory, end to end."""
    missing = tmp_path / "nothing"
    result = runner.invoke(app, ["compare", "ref-vs-target", "--dir", str(missing)])
    assert result.exit_code == 2
    assert result.stderr.startswith(f"ffdebug: error: --dir {missing}: directory does not exist")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_trainer_errors_use_the_same_boundary(tmp_path, capsys):
    """`reference-trainer` answers a bad run directory with `reference-trainer: error:`, exit 2, and the hint."""
    from reference_trainer.cli import main

    code = main(["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    err = capsys.readouterr().err.splitlines()
    assert code == 2
    assert err == [
        f"reference-trainer: error: ConfigError: {tmp_path / 'a' / 'metrics.jsonl'} not found; "
        "give a run directory (it holds metrics.jsonl)",
        "set FFDEBUG_DEBUG=1 for the full traceback",
    ]


def test_trainer_usage_errors_are_one_line(capsys):
    """A bad option value is one line naming the command's help, like ffdebug's."""
    from reference_trainer.cli import main

    code = main(["train", "c.yaml", "--max-steps", "many"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("reference-trainer: error: Invalid value for '--max-steps': ")
    assert err.rstrip().endswith("see 'reference-trainer train --help'") and err.count("\n") == 1


class _Result:
    def __init__(self, value: float):
        self.value = value

    def to_json(self) -> dict:
        return {"value": self.value}


def test_the_sink_writes_json_or_calls_the_renderer():
    """JSON mode: the result's to_json, indent 1; human mode: the renderer with its options, no JSON."""
    from ffdebug.report.sink import Output

    seen = []
    buf = io.StringIO()
    with redirect_stdout(buf):
        Output(json=True).show(_Result(0.5), lambda r, **o: seen.append((r, o)))
    assert buf.getvalue() == '{\n "value": 0.5\n}\n' and seen == []
    buf = io.StringIO()
    result = _Result(0.5)
    with redirect_stdout(buf):
        Output(json=False).show(result, lambda r, **o: seen.append((r, o)), only_problems=True)
    assert buf.getvalue() == "" and seen == [(result, {"only_problems": True})]


def test_the_sink_refuses_nan():
    """A NaN in a result is a bug to surface, not a non-standard `NaN` token in the JSON."""
    from ffdebug.report.sink import Output

    with pytest.raises(ValueError), redirect_stdout(io.StringIO()):
        Output(json=True).show(_Result(math.nan), print)


def test_version_comes_from_one_place(tmp_path):
    """ffdebug.__version__, run.json's tool_version and pyproject's version are one number."""
    import ffdebug
    from ffdebug.version import __version__, source_version

    project = tmp_path / "pyproject.toml"
    project.write_text('[project]\nname = "x"\nversion = "9.8.7"\n\n[tool.ruff]\ntarget-version = "py310"\n')
    assert source_version(str(project)) == "9.8.7"
    assert source_version(str(tmp_path / "missing.toml")) is None
    repo = Path(__file__).resolve().parents[1]  # also when the package runs from an installed wheel
    assert ffdebug.__version__ == __version__ == source_version(str(repo / "pyproject.toml"))
