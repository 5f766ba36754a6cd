"""Playbooks: every file loads and renders; every command, option, check id and triage flag they name exists."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ffdebug.cli.app import app
from ffdebug.cli.introspect import resolve_invocation, verify_playbooks
from ffdebug.review.checks import CHECKS
from ffdebug.review.playbooks import PlaybookError, load_all, parse_invocations, parse_playbook

EXPECTED = {
    "quick-path",
    "full-protocol",
    "dump-bisect",
    "develop",
    "pre-commit",
    "fix-record",
    "data-flow-trace",
}
runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_every_playbook_is_present_and_valid():
    books = load_all()
    assert set(books) == EXPECTED
    assert books["dump-bisect"].phases == list(range(9))
    assert books["full-protocol"].phases == [1, 2, 3, 4, 5]
    assert books["fix-record"].kind == "template"
    for book in books.values():
        for item in book.items:
            assert item.text and item.why, item.id


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_playbook_renders(name):
    shown = invoke("playbook", "show", name)
    assert shown.exit_code == 0, shown.output
    book = load_all()[name]
    assert book.items[0].id in shown.output
    md = invoke("playbook", "checklist", name, "--format", "md")
    assert md.exit_code == 0, md.output
    assert md.output.startswith(f"## {book.title}")
    if book.kind == "checklist":
        assert md.output.count("- [ ] ") == len(book.items)
    as_json = json.loads(invoke("playbook", "checklist", name, "--format", "json").output)
    assert [i["id"] for i in as_json["items"]] == [i.id for i in book.items]
    full = json.loads(invoke("playbook", "show", name, "--json").output)
    assert sum(len(s["items"]) for s in full["sections"]) == len(book.items)


def test_show_one_phase_and_errors():
    r = invoke("playbook", "show", "dump-bisect", "--phase", "8")
    assert r.exit_code == 0 and "slot-invariance" in r.output and "Phase 8" in r.output
    assert "Phase 1:" not in r.output
    r = invoke("playbook", "show", "dump-bisect", "--phase", "12")
    assert r.exit_code == 2 and "no phase 12" in r.output
    r = invoke("playbook", "show", "nope")
    assert r.exit_code == 2 and "no playbook 'nope'" in r.output
    r = invoke("playbook", "checklist", "pre-commit", "--format", "html")
    assert r.exit_code == 2


def test_list():
    r = invoke("playbook", "list", "--json")
    rows = json.loads(r.output)["playbooks"]
    assert {row["name"] for row in rows} == EXPECTED
    pre = next(row for row in rows if row["name"] == "pre-commit")
    assert set(pre["checks"]) == set(CHECKS), "the pre-commit gate runs every automated check"


def test_every_named_command_option_and_check_exists():
    """Asks the typer apps (ffdebug and reference-trainer) at test time: a renamed command or option fails here."""
    problems = verify_playbooks()
    assert problems == []
    # and the validate command says the same
    r = invoke("playbook", "validate")
    assert r.exit_code == 0 and "PASSED" in r.output


def test_every_named_command_has_help():
    seen = set()
    for book in load_all().values():
        for item in book.items:
            for program, args in item.invocations():
                path, problems = resolve_invocation(program, args)
                assert not problems
                if program == "ffdebug":
                    seen.add(tuple(path[1:]))
    for path in sorted(seen):
        r = invoke(*path, "--help")
        assert r.exit_code == 0, (path, r.output)
    # the playbooks reach the commands of every helper area
    assert {
        ("compare",),
        ("bisect",),
        ("weights-diff",),
        ("load-audit",),
        ("slot-invariance",),
        ("trace",),
    } <= seen


def test_verification_catches_unknown_commands_options_and_checks():
    _, bad = resolve_invocation("ffdebug", ["bisekt", "--dir", "x"])
    assert bad and "no command 'bisekt'" in bad[0]
    _, bad = resolve_invocation("ffdebug", ["compare", "--no-such-option"])
    assert bad == ["`ffdebug compare` has no option --no-such-option"]
    _, bad = resolve_invocation("reference-trainer", ["train", "c.yaml", "--max-step", "1"])
    assert bad == ["`reference-trainer train` has no option --max-step"]
    doc = {
        "name": "x",
        "title": "t",
        "summary": "s",
        "sections": [
            {"id": "a", "title": "A", "items": [{"id": "x.1", "text": "t", "why": "w", "check": "nope"}]}
        ],
    }
    from ffdebug.review.playbooks import unknown_checks

    book = parse_playbook(doc, "x.yaml")
    assert unknown_checks({"x": book}, set(CHECKS)) == [("x", "x.1", "nope")]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("title"), "missing 'title'"),
        (lambda d: d.update(name="other"), "must equal the file name"),
        (lambda d: d.update(kind="poster"), "'kind' must be one of"),
        (lambda d: d.update(extra=1), "unknown key(s) extra"),
        (lambda d: d["sections"][0]["items"][0].update(id="Bad ID"), "must be lower-case"),
        (lambda d: d["sections"][0]["items"][0].pop("why"), "missing 'why'"),
        (lambda d: d["sections"][0].update(items=[]), "'items' must be a non-empty list"),
        (lambda d: d["sections"][0].update(phase="one"), "'phase' must be a non-negative integer"),
        (lambda d: d["sections"][0]["items"][0].update(command=[1]), "'command' must be a string or a list"),
    ],
)
def test_schema_errors_name_the_field(mutate, message):
    doc = {
        "name": "x",
        "title": "t",
        "summary": "s",
        "sections": [
            {"id": "a", "title": "A", "phase": 0, "items": [{"id": "x.1", "text": "t", "why": "w"}]}
        ],
    }
    mutate(doc)
    with pytest.raises(PlaybookError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_playbook(doc, "x.yaml")


def test_parse_invocations():
    line = "FFDEBUG_FWD_DUMP_DIR=$DIR A=1 reference-trainer train c.yaml --max-steps 2 && ffdebug compare a b | head"
    assert parse_invocations(line) == [
        ("reference-trainer", ["train", "c.yaml", "--max-steps", "2"]),
        ("ffdebug", ["compare", "a", "b"]),
    ]
    assert parse_invocations("python run.py --x 1") == []
