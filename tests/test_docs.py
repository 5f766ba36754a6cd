"""The documentation's consistency, on whatever markdown the tree holds: every section citation in
the code and the markdown names a heading that exists, every CLI line of the markdown's code blocks
parses with the real `ffdebug` / `reference-trainer` parser (nothing runs), and every relative link
points at a file (and heading) that exists. What each check accepts: tests/helpers/docs_check.py.
The planted-mistake tests below show each checker can fail. (Citations in this file are built from
pieces, `Q`, so that the file holds none of its own.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import docs_check as dc

Q = '"'
DOC_A = "docs/a.md"


def cite(doc: str, title: str, between: str = " ") -> str:
    return f"{doc}{between}{Q}{title}{Q}"


def _listing(failures: list[str], what: str) -> str:
    return f"{len(failures)} {what}:\n  " + "\n  ".join(failures)


# --------------------------------------------------------------------------------------------
# The tree


def test_section_citations_name_headings():
    failures, count = dc.citation_failures()
    assert count > 0, "no section citation found: the citation pattern or the file walk is broken"
    assert not failures, _listing(failures, "section citations name no heading")


def test_cli_lines_parse():
    failures, count = dc.cli_failures()
    assert count > 0, "no CLI line found in the markdown's code blocks"
    assert not failures, _listing(failures, "CLI lines of the docs do not parse")


def test_relative_links_resolve():
    assert dc.REPO / "README.md" in dc.markdown_files()
    failures, _count = dc.link_failures()
    assert not failures, _listing(failures, "relative links point nowhere")


# --------------------------------------------------------------------------------------------
# 1. Citations, planted

README = """# Tool

## Peer dumps: ATOM and SGLang as they are
### `--json` keys
## Engine rewrites (`--engine`)
Setext title
------------

```bash
# not a heading
```
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    (tmp_path / "README.md").write_text(README)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Round 1: warm-up ##\n")
    return tmp_path


def test_citations_that_name_headings_pass(tree):
    text = "\n".join(
        [
            cite("README", "Tool"),
            "(" + cite("README", "Peer dumps") + ")",  # the title before its subtitle
            cite("README", "Peer dumps: ATOM and SGLang as they are"),
            cite("README.md", "--json keys"),  # backticks dropped
            cite("README", "Engine rewrites"),  # before " ("
            cite("README", "Setext title"),
            cite("docs/a.md", "Round 1"),
            cite("docs/a.md", "Round 1: warm-up"),  # closing #s dropped
            cite("docs/a.md", "A", between=", "),
            cite("docs/a.md", "A", between=" ("),
            '    """Docstring (README\n    ' + Q + "Peer\n    dumps" + Q + ")",
            "# a comment (README\n# " + Q + "Tool" + Q + ")",
            f"    help=\"... ({DOC_A} \"\n    '{Q}Round 1{Q});'",  # two concatenated literals
        ]
    )
    assert len(dc.citations(text)) == 13
    assert dc.check_citations(text, "x.py", tree) == []


def test_citations_that_name_no_heading_fail(tree):
    text = "\n".join(
        [
            "intro",
            "(" + cite("README", "Trainers") + ")",
            cite("README", "Peer"),  # a prefix, not the title before a subtitle
            cite("README", "not a heading"),  # a comment inside a code block
            cite("docs/a.md", "Round"),
            cite("docs/missing.md", "A"),
            "see the README\n    " + Q + "Nowhere" + Q,
        ]
    )
    assert dc.check_citations(text, "x.py", tree) == [
        f"x.py:2: README {Q}Trainers{Q} names no heading of README.md",
        f"x.py:3: README {Q}Peer{Q} names no heading of README.md",
        f"x.py:4: README {Q}not a heading{Q} names no heading of README.md",
        f"x.py:5: docs/a.md {Q}Round{Q} names no heading of docs/a.md",
        f"x.py:6: docs/missing.md {Q}A{Q} names a file that does not exist (docs/missing.md)",
        f"x.py:7: README {Q}Nowhere{Q} names no heading of README.md",
    ]


def test_not_citations():
    text = "\n".join(
        [
            'x = "README" + "foo"',  # no space before the quote
            'readme = "README.md"',
            '"""See docs/a.md\n"""',  # a docstring's closing quotes
            'path = REPO / "bench/README.md"',
        ]
    )
    assert dc.citations(text) == []


# --------------------------------------------------------------------------------------------
# 2. CLI lines, planted


@pytest.fixture(scope="module")
def cli():
    return dc.cli_roots(), dc.python_modules()


def check_block(lines: str, cli) -> list[str]:
    roots, modules = cli
    return dc.check_cli_text("intro\n\n```bash\n" + lines + "\n```\n", "x.md", roots, modules)


def test_an_unknown_flag_fails(cli):
    failures = check_block("ffdebug compare a b --no-such-flag", cli)
    assert len(failures) == 1 and "No such option: --no-such-flag" in failures[0], failures
    assert failures[0].startswith("x.md:4: `ffdebug compare a b --no-such-flag`: ffdebug compare: ")


def test_valid_cli_lines_pass(cli):
    lines = [
        "ffdebug compare a b --json",
        "$ FFDEBUG_FWD_DUMP_DIR=/tmp/d ffdebug -q compare ref-vs-target --dir <dir> | jq .",
        "ffdebug bisect REF TARGET --json > out.json   # a comment --no-such-flag",
        "python -m ffdebug bisect --dir D 2>/dev/null",
        "torchrun --nnodes N --nproc-per-node P … -m ffdebug compare REF TARGET [options]",
        "ffdebug compare a b \\",
        "    --json   # continued",
        "ffdebug import /tmp/a /tmp/b && ffdebug inspect /tmp/b",
        "srun bash -c 'ffdebug compare a b --json > v.json'",
        "ffdebug weights-diff A B [--layers 0-3] ...",
        "ffdebug playbook show dump-bisect --phase 1",
        "ffdebug trace x.py:main -- --anything goes",
        "ffdebug --version",
        "reference-trainer train CONFIG --set a.b=1 --output-dir runs/x",
        "python -m reference_trainer diff runs/a runs/b",
        ".venv/bin/ffdebug demo",
        "ffdebug: error: a line of output, not a command",
        "pip install ffdebug",
    ]
    assert check_block("\n".join(lines), cli) == []
    roots, modules = cli
    found = dc.cli_lines("```\n" + "\n".join(lines) + "\n```\n", roots, modules)
    assert [n for n, *_ in found] == [2, 3, 4, 5, 6, 7, 9, 9, 10, 11, 12, 13, 14, 15, 16, 17]


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ("ffdebug comprae a b", "ffdebug: no command 'comprae'"),
        ("ffdebug playbook lst", "ffdebug playbook: no command 'lst'"),
        ("ffdebug compare a b --dir", "Option '--dir' requires an argument"),
        ("ffdebug compare --verbose a b", "No such option: --verbose"),  # global options go first
        ("ffdebug inspect a b", "ffdebug inspect: unexpected extra argument(s): b"),
        ("ffdebug weights-diff A", "ffdebug weights-diff: missing argument B"),
        ("reference-trainer train CONFIG --no-such", "No such option: --no-such"),
        ("reference-trainer diff a b c", "unexpected extra argument(s): c"),
        ("FOO=1 python -m ffdebug bisect --dir D --bogus", "No such option: --bogus"),
        ("torchrun --standalone -m ffdebug compare A B --bogus", "No such option: --bogus"),
        ("ffdebug import a b && ffdebug bisect --dir d --bogus", "No such option: --bogus"),
        ("srun bash -c 'ffdebug compare a b --bogus > v.json'", "No such option: --bogus"),
        ("ffdebug --show-completion bash", "--show-completion ends the program; 'bash' is never read"),
        ('ffdebug hunt --ref "python x.py', "not a well-formed shell line"),
    ],
)
def test_cli_lines_that_do_not_parse_fail(cli, line, why):
    failures = check_block(line, cli)
    assert len(failures) == 1 and why in failures[0], failures


def test_a_continued_line_fails_at_its_first_line(cli):
    failures = check_block("ffdebug compare a b \\\n    --bogus", cli)
    assert len(failures) == 1 and failures[0].startswith("x.md:4: ") and "--bogus" in failures[0]


# --------------------------------------------------------------------------------------------
# 3. Links, planted

DOC = """# There

## A heading: with `code`
## Tests
## Tests
<a name="custom"></a>
"""


def test_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text(DOC)
    readme = tmp_path / "README.md"
    text = "\n".join(
        [
            "# Top",
            "[ok](docs/there.md) [dir](docs/) [root](/docs/there.md) [web](https://example.com/x.md)",
            "[mail](mailto:a@b.c) [anchor](docs/there.md#a-heading-with-code) [second](docs/there.md#tests-1)",
            "[html](docs/there.md#custom) [self](#top) ![img](docs/there.md)",
            "`[code](in/code.md)` and [titled](docs/there.md 'a title')",
            "[gone](docs/missing.md)",
            "[bad anchor](docs/there.md#no-such-heading)",
            "[bad self](#nowhere)",
            "![img](img/none.png)",
            "[label]: ref/missing.md",
            "```",
            "[fenced](in/fence.md)",
            "```",
        ]
    )
    readme.write_text(text)
    assert dc.check_links(text, readme, tmp_path) == [
        "README.md:6: [gone](docs/missing.md): docs/missing.md does not exist",
        "README.md:7: [bad anchor](docs/there.md#no-such-heading): no heading of docs/there.md has the anchor #no-such-heading",
        "README.md:8: [bad self](#nowhere): no heading of README.md has the anchor #nowhere",
        "README.md:9: [img](img/none.png): img/none.png does not exist",
        "README.md:10: [label](ref/missing.md): ref/missing.md does not exist",
    ]


@pytest.mark.parametrize(
    ("heading", "slug"),
    [
        ("Peer dumps: ATOM and SGLang as they are", "peer-dumps-atom-and-sglang-as-they-are"),
        ("`--json` keys", "--json-keys"),
        ("FSDP2 (`backend.kind: fsdp2`)", "fsdp2-backendkind-fsdp2"),
        ("1. Two runs on the same inputs", "1-two-runs-on-the-same-inputs"),
        (
            "Results of 2026-12-06 (issue 43, third pass): compare's last 5 %",
            "results-of-2026-12-06-issue-43-third-pass-compares-last-5-",
        ),
        ("Weights diff and load_audit", "weights-diff-and-load_audit"),
        ("See [the docs](docs/x.md)", "see-the-docs"),
    ],
)
def test_github_slug(heading, slug):
    assert dc.github_slug(heading) == slug
