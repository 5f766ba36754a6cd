"""CLI conventions (docs/cli.md "CLI conventions"): `--version`, completion, flags without `<bool>`, the
`--json` error object, `-v` / `-q`, library messages through `logging`, and tables that stay
readable when piped at 80 columns."""

from __future__ import annotations

import json
import logging
import re
import statistics
from pathlib import Path

import pytest
import torch
from typer.main import get_command
from typer.testing import CliRunner

import ffdebug
from ffdebug import logs
from ffdebug.cli.app import app
from ffdebug.errors import FFDebugError, InputIdsMismatch
from ffdebug.version import source_version
from reference_trainer.cli import app as trainer_app

runner = CliRunner()
ROOT = get_command(app)


def _leaves(group, path=()):
    for name, cmd in sorted(group.commands.items()):
        if hasattr(cmd, "commands"):
            yield from _leaves(cmd, (*path, name))
        else:
            yield (*path, name), cmd


COMMANDS = list(_leaves(ROOT))
JSON_COMMANDS = [(p, c) for p, c in COMMANDS if any("--json" in param.opts for param in c.params)]


@pytest.fixture(autouse=True)
def _library_logging():
    """Every CLI call configures the `ffdebug` logger; each test starts and ends in library mode."""
    logs.reset()
    yield
    logs.reset()
    logging.disable(logging.NOTSET)


@pytest.fixture
def walked_tree(monkeypatch):
    """Run ROOT (whose callbacks a test replaces) rather than a freshly built click tree."""
    monkeypatch.setattr("typer.testing._get_command", lambda _app: ROOT)
    monkeypatch.delenv("FFDEBUG_DEBUG", raising=False)


def _required_args(cmd) -> list[str]:
    args: list[str] = []
    for param in cmd.params:
        if param.required:
            value = "1" if getattr(param.type_descriptor, "annotation", str) in (int, float) else "x"
            args += [param.opts[0], value] if param.param_type_name == "option" else [value]
    return args


def test_version_of_both_programs():
    """`--version` prints the package version (pyproject's) and exits 0 before any command runs."""
    assert ffdebug.__version__ == source_version(str(Path(__file__).resolve().parents[1] / "pyproject.toml"))
    result = runner.invoke(app, ["--version"])
    assert (result.exit_code, result.stdout) == (0, f"ffdebug {ffdebug.__version__}\n")
    result = runner.invoke(trainer_app, ["--version"])
    assert (result.exit_code, result.stdout) == (0, f"reference-trainer {ffdebug.__version__}\n")


def test_completion_completes_commands_and_options(monkeypatch):
    """Typer's completion protocol: `ffdebug comp<TAB>` offers compare, `compare --fa<TAB>` --fail-on.
    `--show-completion` finds the shell from the process tree, which a detached run (nohup, some CI
    runners) does not have: the test names bash for it."""
    import typer.completion

    monkeypatch.setattr(typer.completion, "_get_shell_name", lambda: "bash")
    env = {"_FFDEBUG_COMPLETE": "complete_bash", "COMP_WORDS": "ffdebug comp", "COMP_CWORD": "1"}
    assert runner.invoke(app, [], env=env).stdout.split() == ["compare"]
    env.update(COMP_WORDS="ffdebug compare --fa", COMP_CWORD="2")
    assert runner.invoke(app, [], env=env).stdout.split() == ["--fail-on"]
    shown = runner.invoke(app, ["--show-completion"])
    assert shown.exit_code == 0 and "_FFDEBUG_COMPLETE=complete_bash" in shown.stdout, (
        shown.output,
        shown.exception,
    )


@pytest.mark.parametrize("path", [(), *(p for p, _ in COMMANDS)], ids=lambda p: " ".join(p) or "ffdebug")
def test_help_shows_no_type_beside_a_flag(path):
    """`--json`, not `--json <bool>` (typer prints a type beside every option, flags included), and
    a repeatable option or variadic argument shows its element's type, not `<list[str]>`."""
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.stdout and "--help" in result.stdout
    assert "<list[" not in result.stdout
    if path == ("compare",):
        assert re.search(r"sides\.\.\. +<str> ", result.stdout) and re.search(
            r"--stages +<str> ", result.stdout
        )


def _error_object(result) -> dict:
    data = json.loads(result.stdout)
    assert list(data) == ["error"] and set(data["error"]) == {"exit_code", "message", "hint", "where"}
    return data["error"]


@pytest.mark.parametrize("path,cmd", JSON_COMMANDS, ids=[" ".join(p) for p, _ in JSON_COMMANDS])
def test_json_failure_prints_the_error_object(path, cmd, monkeypatch, walked_tree):
    """Every command with --json: a bad input is the error object on stdout and the line on stderr."""

    def bad_input(*args, **kwargs):
        raise FFDebugError("x: bad input; give a good one")

    monkeypatch.setattr(cmd, "callback", bad_input)
    result = runner.invoke(app, [*path, *_required_args(cmd), "--json"])
    assert result.exit_code == 2
    assert result.stderr == "ffdebug: error: x: bad input; give a good one\n"
    assert _error_object(result) == {
        "exit_code": 2,
        "message": "x: bad input; give a good one",
        "hint": None,
        "where": "ffdebug " + " ".join(path),
    }


def test_json_failure_exit_3_and_usage_errors(monkeypatch, walked_tree):
    """Differing inputs keep exit 3; a usage error names the option and the help to read."""
    _, cmd = next(c for c in COMMANDS if c[0] == ("compare",))

    def mismatch(*args, **kwargs):
        raise InputIdsMismatch("input ids differ at position 4; fix tokenization first")

    monkeypatch.setattr(cmd, "callback", mismatch)
    error = _error_object(result := runner.invoke(app, ["compare", "a", "b", "--json"]))
    assert (
        result.exit_code == 3 and error["exit_code"] == 3 and error["message"].startswith("input ids differ")
    )
    result = runner.invoke(app, ["compare", "a", "b", "--json", "--workers", "0"])
    error = _error_object(result)
    assert result.exit_code == 2 and error["exit_code"] == 2 and "--workers" in error["message"]
    assert error["hint"] == "see 'ffdebug compare --help'" and error["where"] == "ffdebug compare --workers"
    assert result.stderr.startswith("ffdebug: error: ") and result.stderr.endswith(
        "; see 'ffdebug compare --help'\n"
    )
    # without --json nothing reaches stdout
    assert runner.invoke(app, ["compare", "a", "b"]).stdout == ""


def test_no_error_object_after_a_result_document(monkeypatch, walked_tree):
    """A command that printed its result and then fails leaves stdout one document (the result)."""
    from ffdebug.report.sink import Output

    _, cmd = next(c for c in COMMANDS if c[0] == ("inspect",))

    def shown_then_failed(*args, **kwargs):
        Output(json=True).show({"records": 1, "disagreeing": 1}, print)
        raise FFDebugError("1 record(s) disagree with their payloads")

    monkeypatch.setattr(cmd, "callback", shown_then_failed)
    result = runner.invoke(app, ["inspect", "x", "--json"])
    assert result.exit_code == 2 and json.loads(result.stdout) == {"records": 1, "disagreeing": 1}


def _messages(*args, **kwargs):
    logs.get_logger("capture").warning("a library warning")
    logs.get_logger("progress").info("12/40 stages")
    logs.get_logger("capture").debug("a debug detail")


@pytest.mark.parametrize(
    "options,shown",
    [
        ((), {"ffdebug: warning: a library warning", "ffdebug: 12/40 stages"}),
        (("-q",), set()),
        (
            ("-v",),
            {
                "ffdebug: warning: a library warning",
                "ffdebug: 12/40 stages",
                "ffdebug: debug: a debug detail",
            },
        ),
    ],
    ids=["default", "quiet", "verbose"],
)
def test_verbosity_of_the_cli(options, shown, monkeypatch, walked_tree):
    """Default: warnings and progress (INFO) on stderr; -q errors only; -v debug too. stdout stays clean."""
    _, cmd = next(c for c in COMMANDS if c[0] == ("inspect",))
    monkeypatch.setattr(cmd, "callback", _messages)
    result = runner.invoke(app, [*options, "inspect", "x"])
    assert result.exit_code == 0 and result.stdout == ""
    assert set(result.stderr.splitlines()) == shown


@pytest.mark.parametrize("options,expected", [((), 1), (("-q",), 0)], ids=["default", "quiet"])
def test_quiet_silences_a_real_library_warning(options, expected, tmp_path, monkeypatch, walked_tree):
    """A side that captured nothing warns when its capture ends, unless -q (the library's own path)."""
    _, cmd = next(c for c in COMMANDS if c[0] == ("inspect",))

    def dump_nothing(*args, **kwargs):
        with ffdebug.capture(None, dir=tmp_path, side="ref"):
            pass

    monkeypatch.setattr(cmd, "callback", dump_nothing)
    result = runner.invoke(app, [*options, "inspect", "x"])
    assert result.stderr.count("ffdebug: warning: side 'ref' captured nothing") == expected, result.stderr


def test_verbose_compare_says_what_it_paired(long_keys):
    """-v on a real compare: a debug line naming both stores, their record counts and what was
    paired (the fixture: 2 records a side, one call, no warm-up); none without -v."""
    verbose = runner.invoke(app, ["-v", "compare", "ref-vs-target", "--dir", str(long_keys)])
    lines = [line for line in verbose.stderr.splitlines() if line.startswith("ffdebug: debug: compare: ")]
    assert len(lines) == 1, verbose.stderr
    assert (
        "(2 records) against" in lines[0]
        and "1 calls paired, 0 warm-ups set aside, 2 stage units" in lines[0]
    )
    plain = runner.invoke(app, ["compare", "ref-vs-target", "--dir", str(long_keys)])
    assert "debug" not in plain.stderr


BOTH_DIRS = {"FFDEBUG_FWD_DUMP_DIR": "/a", "ATOM_FWD_DUMP_DIR": "/b"}
BOTH_WARNING = "ffdebug: warning: both FFDEBUG_FWD_DUMP_DIR and ATOM_FWD_DUMP_DIR are set; using FFDEBUG_FWD_DUMP_DIR='/a'\n"


def test_library_warnings_go_through_logging(capsys, monkeypatch):
    """Library use: our stderr line by default; nothing under logging.disable(); a user's handler
    gets the record instead of our line (no copy on stderr)."""
    from ffdebug._env import read_dump_config

    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a program that configured no logging

    read_dump_config(BOTH_DIRS)
    assert capsys.readouterr().err == BOTH_WARNING
    logging.disable(logging.WARNING)
    read_dump_config(BOTH_DIRS)
    assert capsys.readouterr().err == ""
    logging.disable(logging.NOTSET)

    records: list[logging.LogRecord] = []
    user = logging.Handler()
    user.emit = records.append
    logging.getLogger().addHandler(user)
    try:
        read_dump_config(BOTH_DIRS)
    finally:
        logging.getLogger().removeHandler(user)
    assert capsys.readouterr().err == ""
    assert [(r.name, r.levelname) for r in records] == [("ffdebug.env", "WARNING")]
    assert "both FFDEBUG_FWD_DUMP_DIR and ATOM_FWD_DUMP_DIR" in records[0].getMessage()


# ---- 80 columns, piped ----------------------------------------------------------------------

LONG = (
    "L012.self_attn.rotary_emb.out.cos_cached_with_a_long_suffix",
    "L013.mlp.experts.gate_up_proj.weight_scale_inv.out",
)
CLASS = "Qwen3MoeDecoderLayer[mlp=Sparse]"


def _column(text: str, header: str) -> str:
    """The cells of one column of the tables that have it, top to bottom, joined (a wrapped key
    reads whole again)."""
    cells, at = [], None
    for line in text.splitlines():
        if line.startswith("┃"):
            heads = [c.strip() for c in line.strip("┃").split("┃")]
            at = heads.index(header) if header in heads else None
        elif line.startswith("│") and at is not None:
            cells.append(line.strip("│").split("│")[at].strip())
    assert cells, f"no table with a {header!r} column"
    return "".join(cells)


def _checked_80(text: str, commands: tuple[str, ...] | set[str] = (), columns: int = 80) -> str:
    """No "…"; every line within `columns` except a shell command (`$ ...`, kept on one line to
    copy), which must be one of `commands`, whole; no boxed table cropped at the edge (a cropped
    row has lost its right border)."""
    assert "…" not in text, text
    for line in text.splitlines():
        if line.lstrip().startswith("$ "):
            assert line.lstrip()[2:] in commands, line
            continue
        assert len(line) <= columns, text
        if line[:1] in "┏┃┡│└":
            assert line.rstrip()[-1:] in "┓┃┩│┘", text
    return text


def _at_80(*args: str, commands: tuple[str, ...] | set[str] = (), columns: int = 80) -> str:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})
    assert result.exit_code in (0, 1), result.output
    return _checked_80(result.stdout, commands, columns)


def _squashed(text: str) -> str:
    """Text without whitespace: a key or sentence that wrapped or folded reads whole again."""
    return "".join(text.split())


@pytest.fixture(scope="module")
def long_keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("long")
    for side in ("ref", "target"):
        with ffdebug.capture(None, dir=d, side=side):
            for key in LONG:
                layer = int(key[1:4])
                t = torch.arange(6.0) + 1
                if side == "target" and layer == 13:
                    t = t * 1.5 + 123456.789  # numbers as wide as they get: 3.17e+06%, 1.23e+05
                ffdebug.tap(key, t, layer=layer, layer_class=CLASS)
    return d


def test_inspect_compare_bisect_at_80_columns(long_keys):
    """Piped at 80 columns, long keys and wide numbers wrap inside their cells and are never cut."""
    text = _at_80("inspect", str(long_keys / "ref"))
    assert all(key in _squashed(text) for key in LONG)
    # too narrow for a table with whole numbers: a key line and `name=value` words per tensor,
    # every statistic whole (std of 1..6 is sqrt(17.5/6), printed to 4 significant digits)
    words = text.split()
    assert {"mean=3.5", "std=1.708", "min=1", "max=6", "absmax=6", "nan/inf=0/0"} <= set(words), text
    wide = CliRunner().invoke(app, ["inspect", str(long_keys / "ref")], env={"COLUMNS": "200"}).stdout
    assert all(key in _column(wide, "key") for key in LONG) and "1.708" in _column(wide, "std")
    text = _at_80("compare", "ref-vs-target", "--dir", str(long_keys))
    stages = _column(text, "stage")
    assert all(key[5:] in stages for key in LONG)  # the layer has its own column
    assert CLASS in _column(text, "class") and "3.17e+06%" in _column(text, "rel")
    assert "1.23e+05" in _column(text, "max_abs")
    text = _at_80("bisect", "--dir", str(long_keys))
    assert LONG[1][5:] in _column(text, "stage")
    # narrower than the numbers need: they fold too, and no column is cropped at the edge
    text = _at_80("compare", "ref-vs-target", "--dir", str(long_keys), columns=60)
    assert all(key[5:] in _column(text, "stage") for key in LONG) and "3.17e+06%" in _column(text, "rel")


def test_weights_diff_at_80_columns(tmp_path):
    from safetensors.torch import save_file

    names = [
        f"model.layers.{i}.self_attn.rotary_embedding_projection_with_a_long_name.weight" for i in (3, 4)
    ]
    a = {n: torch.arange(12.0).reshape(3, 4) + i for i, n in enumerate(names)}
    b = {n: t * 2.5 for n, t in a.items()}
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    text = _at_80("weights-diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"))
    tensors = _column(text, "tensor")
    assert all(n in tensors for n in names), tensors


TRACE_TARGET = """
import torch
from torch import nn

import ffdebug


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary_embedding_projection_with_a_long_name = nn.Linear(4, 4)

    def forward(self, x):
        return self.rotary_embedding_projection_with_a_long_name(x)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.decoder_layers_with_long_names = nn.ModuleList([Block()])

    def forward(self, x):
        for block in self.decoder_layers_with_long_names:
            x = block(x)
        return x


def step():
    Model()(torch.ones(2, 16, 4))
    ffdebug.tap(KEY, torch.tensor([-123456.789, 234567.0, 0.5, -0.25]))
"""


def _simple_tables(text: str, first: str) -> list[tuple[list[str], str]]:
    """trace's borderless tables: (header words, the first column's cells joined) per table."""
    tables, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.split()[:2] == ["name", first]:
            cut, cells = line.index(first), []
            for row in lines[i + 2 :]:
                if not row.strip():
                    break
                cells.append(row[:cut].strip())
            tables.append((line.split(), "".join(cells)))
    return tables


def test_trace_at_80_columns(tmp_path):
    """Ten columns of wide numbers and long module / tap / parameter names: the names fold, the
    numbers stay whole, no column is cropped."""
    target = tmp_path / "long_names.py"
    target.write_text(TRACE_TARGET.replace("KEY", repr(LONG[1])))
    text = _at_80("trace", f"{target}:step", "--params")
    (rows_head, names), (params_head, params) = _simple_tables(text, "shape")
    assert rows_head == ["name", "shape", "dtype", "mean", "std", "min", "max", "nan", "grad", "n"]
    assert params_head == rows_head[:-1]
    assert "decoder_layers_with_long_names.0.rotary_embedding_projection_with_a_long_name" in names
    assert LONG[1] in names
    weight = "Model.decoder_layers_with_long_names.0.rotary_embedding_projection_with_a_long_name.weight"
    assert weight in params
    # the tap's row, every number whole: mean, std (the population's, as every ffdebug statistic),
    # min, max of the four values, 0 NaN
    values = [-123456.789, 234567.0, 0.5, -0.25]
    stats = [format(f(values), ".3g") for f in (statistics.mean, statistics.pstdev, min, max)]
    assert stats == ["2.78e+04", "1.3e+05", "-1.23e+05", "2.35e+05"]
    tap_row = next(line for line in text.splitlines() if line.startswith(" " + LONG[1][:8]))
    assert tap_row.split()[-7:] == [*stats, "0", "·", "1"]


def test_hunt_isolate_replay_at_80_columns(monkeypatch, capsys):
    """Constructed results through hunt's renderers: prose wraps, keys fold, tables are never cut,
    and a reproduce command stays one whole line to copy."""
    from ffdebug.hunt.isolate import FixOutcome, IsolateResult
    from ffdebug.hunt.replay import ReplayResult, ReplayRun
    from ffdebug.hunt.state import HuntState, Round
    from ffdebug.report import hunt_text
    from ffdebug.verdict import Severity

    monkeypatch.setenv("COLUMNS", "80")
    key = LONG[1]
    command = "python serve_the_target_model_with_a_long_script_name.py --config configs/moe_long.yaml"
    env = {"FFDEBUG_FWD_DUMP_DIR": "/tmp/hunt/round-2/target", "FFDEBUG_FWD_DUMP_BLOCK_CLASS": CLASS}
    r = Round(2, {"target": env}, "python ref.py", command, 123456789, f"the error starts at {key}", [key])
    hunt_text.print_round(r, resumed=False)
    hunt_text.print_hunt(HuntState([r], 13, CLASS, key, local=True, complete=True))
    reproduce = (
        f"FFDEBUG_FWD_DUMP_BLOCK_CLASS='{CLASS}' FFDEBUG_FWD_DUMP_DIR=/tmp/hunt/round-2/target {command}"
    )
    text = _squashed(_checked_80(capsys.readouterr().out, {reproduce}))
    assert _squashed(f"round 2: the error starts at {key} 123,456,789 bytes") in text
    assert _squashed(f"layer 13 ({CLASS}), sub-stage {key}, local to this layer") in text

    fix = "patches/0001-restore-the-routed-scaling-factor-in-the-moe-router.patch"
    outside = {"fast_kernels_with_a_long_module_name": "/opt/site-packages/fast_kernels_with_a_long_name"}
    bug = (0.898726, 31700.0, 0.0, Severity.BUG)  # rel 31700 -> 3.17e+06%
    fixes = [FixOutcome(fix, "critical", *bug, outside_imports=outside)]
    hunt_text.print_isolate(IsolateResult(key, fixes, True, Severity.OK))
    text = _checked_80(capsys.readouterr().out)
    assert fix in _column(text, "fix") and "0.898726" in _column(text, "cos")
    assert "3.17e+06%" in _column(text, "rel") and "0%" in _column(text, "bit-equal")
    ((name, path),) = outside.items()
    assert _squashed(f"{name} ({path})") in _column(text, "outside")  # its header wraps too

    runs = [
        ReplayRun(f, i, *(bug if f == "target" else (1.0, 0.0, 1.0, Severity.OK)))
        for f in ("ref", "target")
        for i in ("ref", "target")
    ]
    hunt_text.print_replay(ReplayResult(key, [f"{key}.in", f"{key}.in.1"], runs, "kernel", f"{key} differs"))
    text = _checked_80(capsys.readouterr().out)
    assert _squashed(f"replay of {key} on {key}.in, {key}.in.1") in _squashed(text)
    assert _column(text, "severity") == 2 * Severity.OK.value + 2 * Severity.BUG.value
    assert _column(text, "rel") == "0%0%3.17e+06%3.17e+06%"


def test_review_at_80_columns(tmp_path):
    """A finding under a long path: its `path:line` reads whole; the checklist's commands are
    whole lines."""
    from ffdebug.review.playbooks import load_all

    deep = tmp_path / "a_long_directory_name_for_the_review_fixture_that_runs_past_eighty_columns"
    deep.mkdir()
    source = deep / "torch_load_with_a_long_file_name.py"
    source.write_text((Path(__file__).resolve().parents[1] / "fixtures/review/torch_load.py").read_text())
    commands = {c for book in load_all().values() for item in book.items for c in item.command}
    text = _at_80("review", str(source), commands=commands)
    assert f"{source}:9" in _squashed(text) and "FAILED" in text


def test_playbook_triage_and_list_at_80_columns():
    """Triage's answers wrap and its commands stay whole lines; `playbook list`'s titles fold."""
    args = ("playbook", "triage", "--symptom", "wrong-output", "--deterministic", "--reference")
    expected = json.loads(CliRunner().invoke(app, [*args, "--json"]).stdout)["commands"]
    text = _at_80(*args, commands=set(expected))
    assert [line.strip()[2:] for line in text.splitlines() if line.strip().startswith("$ ")] == expected
    assert _squashed("weights-verified=no (assumed; pass --weights-verified to change)") in _squashed(text)
    text = _at_80("playbook", "list")
    assert _squashed("Full debug protocol for trainer failures") in _squashed(_column(text, "title"))


def test_reference_trainer_list_at_80_columns():
    """`reference-trainer list`: every trainer's name, contract and arguments class whole."""
    info = json.loads(CliRunner().invoke(trainer_app, ["list", "--json"]).stdout)["trainers"]
    result = CliRunner().invoke(trainer_app, ["list"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    text = _checked_80(result.stdout)
    for column in ("trainer", "contract", "arguments"):
        key = "name" if column == "trainer" else column
        assert _column(text, column) == "".join(t[key] for t in info)


def test_help_markup_keeps_every_literal_bracket():
    """Help is rendered as rich markup ([bold]Examples[/bold]): a literal bracket that is not
    escaped is read as a tag and silently dropped (`pip install 'ffdebug[review]'` shown as
    `pip install 'ffdebug'`). Every help text of both programs renders to its own plain text."""
    import re

    import typer.main
    from rich.text import Text

    import reference_trainer.cli as trainer_cli
    from ffdebug.cli.introspect import cli_root

    tags = re.compile(r"\[/?(bold|dim|italic)\]")

    def texts(cmd, path):
        yield path, cmd.help or ""
        for param in getattr(cmd, "params", []):
            yield f"{path} {param.name}", getattr(param, "help", None) or ""
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from texts(sub, f"{path} {name}")

    roots = ((cli_root("ffdebug"), "ffdebug"), (typer.main.get_command(trainer_cli.app), "reference-trainer"))
    lost = [
        where
        for root, program in roots
        for where, text in texts(root, program)
        if Text.from_markup(text).plain != tags.sub("", text).replace("\\[", "[")
    ]
    assert lost == []


@pytest.mark.parametrize(
    "option,value",
    [("--fail-on", "bogus"), ("--threshold", "garbage"), ("--noise", "/nonexistent/noise-run")],
)
def test_a_value_our_code_refuses_names_its_option(option, value, long_keys):
    """A value the command's own code refuses (not click's type checks) is placed like a usage
    error: `where` ends with the option, the message names it and the fix, exit 2."""
    for given in ([option, value], [f"{option}={value}"]):  # both spellings of an option's value
        result = runner.invoke(app, ["compare", "ref-vs-target", "--dir", str(long_keys), *given, "--json"])
        error = json.loads(result.stdout)["error"]
        assert result.exit_code == 2 and error["where"] == f"ffdebug compare {option}", error
        assert error["message"].startswith(f"{option} ") and value in error["message"]


def _no_layer_stores(root: Path) -> tuple[Path, Path]:
    """Stores with only `embed.input_ids` and `final.logits` (the target's negated: a bug)."""
    for side, sign in (("ref", 1.0), ("target", -1.0)):
        with ffdebug.capture(None, dir=root, side=side):
            ffdebug.tap("embed.input_ids", torch.tensor([[1, 2, 3]]), input_ids=True)
            ffdebug.tap("final.logits", sign * torch.arange(30.0).reshape(3, 10))
    return root / "ref", root / "target"


@pytest.mark.parametrize("option", ["-q", "--quiet", "-v", "--verbose"])
def test_a_global_option_after_the_command_says_where_it_goes(option, tmp_path):
    """`ffdebug compare A B -q` is a usage error (exit 2) whose one line says -q goes before the
    command, not only "No such option"."""
    ref, tgt = _no_layer_stores(tmp_path)
    result = runner.invoke(app, ["compare", str(ref), str(tgt), option], prog_name="ffdebug")
    assert result.exit_code == 2
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1
    assert f"{option} is an option of ffdebug itself, not of compare: put it before the command" in line
    assert f"'ffdebug {option} compare …'" in line
    assert runner.invoke(app, [option, "compare", str(ref), str(tgt)]).exit_code == 1  # there it works


def test_bisect_without_layer_stages_says_so_instead_of_an_empty_table(tmp_path):
    ref, tgt = _no_layer_stores(tmp_path)
    result = runner.invoke(app, ["bisect", str(ref), str(tgt), "--all"], env={"COLUMNS": "100"})
    assert result.exit_code == 1
    assert "No layer table: neither store holds a layer stage (L<n>.*)." in result.stdout
    assert "layers (block output vs reference)" not in result.stdout
    assert "final.logits" in result.stdout
