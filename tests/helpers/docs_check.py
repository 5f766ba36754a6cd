"""Checkers of the documentation's consistency (tests/test_docs.py): section citations, the CLI
lines of the markdown's code blocks, and relative links. Plain functions over text and paths, so
that a test can feed each one a planted mistake.

Citations. A file's name, a space and a section title in double quotes: ``README`` ``"Section"``
names a heading of README.md; ``docs/bisect.md`` ``"Patterns"`` (any ``<path>.md``: ``bench/README.md``,
``README.md``) a heading of that file, the path relative to the repository root. (The examples here
are split by backticks so that this file holds no citation of its own.) A comma may stand between
the two, or an opening parenthesis before the quote (``docs/bisect.md`` ``("The zoo")``). The
citation may wrap: a line break (with the next line's indentation and a ``#`` comment marker) may
stand between the file and the quote, and inside the quoted title, where it reads as one space; a
help text may wrap it between two concatenated string literals. A citation names a heading's whole
text (``#`` marks, backticks and surrounding whitespace dropped) or its title before a subtitle: the
text before the first ``": "`` or ``" ("`` (``"Peer dumps"`` names "Peer dumps: ATOM and SGLang as
they are", ``"Engine rewrites"`` names "Engine rewrites (`--engine`)"). Any other prefix does not
count: "Trainer" does not name "Trainer taps".

CLI lines. In every fenced code block, each logical line (``\\`` continuations joined, ``$ `` prompt
and ``# comments`` dropped) is split into shell words and cut into commands at ``|``, ``||``, ``&&``,
``;`` and ``&``; a command stops at its first redirection (``>``, ``>>``, ``<``, …). A command is
checked when it runs ``ffdebug`` or ``reference-trainer`` (a console script of pyproject.toml, also as
``.venv/bin/ffdebug``), ``python -m ffdebug`` / ``python -m reference_trainer``, or ``torchrun … -m
ffdebug``, after any ``NAME=value`` assignments and ``env``; ``bash -c '…'`` / ``sh -c '…'`` is
checked inside. Its words are parsed by the program's own click parser (the command tree typer
builds), which runs nothing: every subcommand must exist, every option must be one of its command
(or, before the command, a global one) and get its value, positionals must not exceed what the
command takes, and every required positional must be there. Placeholders stand as values:
``REF``, ``N``, ``<dir>`` (its brackets dropped); ``...`` / ``…`` and ``[options]`` are dropped,
``[--flag X]`` is read as ``--flag X``.

Links. Every ``[text](target)`` and ``[label]: target`` outside code, whose target is relative (no
scheme such as ``https:`` or ``mailto:``), must name an existing file or directory, relative to the
markdown file (a target starting with ``/`` relative to the repository root). A ``#anchor`` on a
markdown target (or alone, for the same file) must be the GitHub slug of one of its headings, or an
``<a name=…>`` / ``id=…`` anchor in it.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
import shlex
import unicodedata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[2]

# Folders of code whose comments, docstrings and help texts cite sections; markdown is found anywhere.
CODE_DIRS = ("ffdebug", "reference_trainer", "bench", "scripts", "tests", "examples", "playbooks")
CODE_SUFFIXES = (".py", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg")
SKIP_DIRS = {"__pycache__", "node_modules", "fixtures", "build", "dist"}


# --------------------------------------------------------------------------------------------
# Files


def _walk(top: Path, suffixes: tuple[str, ...]) -> Iterator[Path]:
    """Files under ``top`` ending in one of ``suffixes``; hidden folders (the venv), ``SKIP_DIRS``
    and ``*.egg-info`` are not entered."""
    for folder, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if not (d.startswith(".") or d in SKIP_DIRS or d.endswith(".egg-info"))]
        yield from (Path(folder) / f for f in files if f.endswith(suffixes))


def markdown_files(root: Path = REPO) -> list[Path]:
    """Every ``*.md`` of the tree (not under hidden folders, the venv, fixtures or build outputs)."""
    return sorted(_walk(root, (".md",)))


def code_files(root: Path = REPO) -> list[Path]:
    """Source files of ``CODE_DIRS`` (and ``pyproject.toml``) whose comments may cite sections."""
    out = [root / "pyproject.toml"] if (root / "pyproject.toml").is_file() else []
    for top in CODE_DIRS:
        if (root / top).is_dir():
            out += _walk(root / top, CODE_SUFFIXES)
    return sorted(out)


def rel(path: Path, root: Path = REPO) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------------------------
# Markdown structure

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})(.*)$")
_ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?[ \t]*$")
_SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")


@dataclass(frozen=True)
class Block:
    """A fenced code block: the line number of its first content line, its info string, its lines."""

    first_line: int
    info: str
    lines: tuple[str, ...]


def split_fences(text: str) -> tuple[list[tuple[int, str]], list[Block]]:
    """(prose lines with their 1-based numbers, fenced code blocks). An unclosed fence runs to the end."""
    prose: list[tuple[int, str]] = []
    blocks: list[Block] = []
    fence: str | None = None
    info, body, start = "", [], 0
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None:
            if m and not (m.group(1)[0] == "`" and "`" in m.group(2)):
                fence, info, body, start = m.group(1), m.group(2).strip(), [], number + 1
            else:
                prose.append((number, line))
        elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not m.group(2).strip():
            blocks.append(Block(start, info, tuple(body)))
            fence = None
        else:
            body.append(line)
    if fence is not None:
        blocks.append(Block(start, info, tuple(body)))
    return prose, blocks


def heading_text(raw: str) -> str:
    """A heading's text as citations name it: backticks dropped, whitespace collapsed."""
    return " ".join(raw.replace("`", "").split())


def raw_headings(text: str) -> list[str]:
    """The text of every ATX (``#`` … ``######``) and setext heading outside code blocks, in order,
    closing ``#``s dropped, inline markup left as written."""
    out: list[str] = []
    previous: str | None = None  # the prose line before, when it can be a setext heading's text
    last_number = -1
    for number, line in split_fences(text)[0]:
        if number != last_number + 1:
            previous = None  # a code block stood between
        last_number = number
        m = _ATX.match(line)
        if m:
            content = re.sub(r"(?:^|[ \t]+)#+[ \t]*$", "", m.group(2) or "")
            out.append(content.strip())
            previous = None
            continue
        s = _SETEXT.match(line)
        if (
            s
            and previous is not None
            and previous.strip()
            and not previous.lstrip().startswith(("-", "*", ">", "|"))
        ):
            out.append(previous.strip())
            previous = None
            continue
        previous = line
    return out


def headings(text: str) -> list[str]:
    """Every heading's text as a citation compares it (``heading_text``)."""
    return [heading_text(h) for h in raw_headings(text)]


def short_title(heading: str) -> str:
    """A heading's title before its subtitle: the text before the first ``": "`` or ``" ("``."""
    cut = len(heading)
    for mark in (": ", " ("):
        at = heading.find(mark)
        if at > 0:
            cut = min(cut, at)
    return heading[:cut].rstrip()


def names_heading(title: str, heads: Iterable[str]) -> bool:
    """Whether a cited ``title`` names one of ``heads``: the whole text or its ``short_title``."""
    title = heading_text(title)
    return any(title == h or title == short_title(h) for h in heads)


# --------------------------------------------------------------------------------------------
# 1. Section citations

_BREAK = r"[ \t]*\n[ \t]*(?:(?:#|//)[ \t]*)?"  # a line break, the next line's indent and comment marker
# A help text wrapped by string concatenation: one literal ends after the file's name, the next opens
# with the quoted title.
_LITERAL_BREAK = r"[ \t]*[\"'][ \t]*\n[ \t]*[rRbBuUfF]{0,2}[\"']"
CITATION = re.compile(
    r"(?<![\w/.\-])(?P<doc>README(?:\.md)?|(?:[\w.\-]+/)*[\w.\-]+\.md)"
    rf"(?:,?(?:{_LITERAL_BREAK}|{_BREAK}|[ \t]+)\(?)"
    rf'"(?P<title>[^"\n]+(?:{_BREAK}[^"\n]+)?)"'
)


@dataclass(frozen=True)
class Citation:
    line: int
    doc: str  # as written: README, README.md, docs/bisect.md
    title: str  # line breaks read as one space

    @property
    def target(self) -> str:
        """The cited file, relative to the repository root."""
        return "README.md" if self.doc == "README" else self.doc


def citations(text: str) -> list[Citation]:
    """Every section citation in ``text`` (code or markdown)."""
    out = []
    for m in CITATION.finditer(text):
        title = " ".join(re.sub(_BREAK, " ", m.group("title")).split())
        out.append(Citation(text.count("\n", 0, m.start()) + 1, m.group("doc"), title))
    return out


def check_citations(text: str, where: str, root: Path = REPO) -> list[str]:
    """One failure line per citation in ``text`` (from the file ``where``) that names no heading."""
    failures = []
    for c in citations(text):
        heads = _file_headings(root / c.target)
        if heads is None:
            failures.append(
                f'{where}:{c.line}: {c.doc} "{c.title}" names a file that does not exist ({c.target})'
            )
        elif not names_heading(c.title, heads):
            failures.append(f'{where}:{c.line}: {c.doc} "{c.title}" names no heading of {c.target}')
    return failures


def _file_headings(path: Path) -> list[str] | None:
    try:
        return _cached_headings(path.resolve(), path.stat().st_mtime_ns)
    except OSError:
        return None


@functools.cache
def _cached_headings(path: Path, _mtime: int) -> list[str]:
    return headings(path.read_text(encoding="utf-8"))


def citation_failures(root: Path = REPO) -> tuple[list[str], int]:
    """(failures, number of citations) over the code files and the markdown of ``root``."""
    failures, count = [], 0
    for path in code_files(root) + markdown_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        count += len(citations(text))
        failures += check_citations(text, rel(path, root), root)
    return failures, count


# --------------------------------------------------------------------------------------------
# 2. CLI lines


def console_scripts(root: Path = REPO) -> dict[str, str]:
    """pyproject's ``[project.scripts]``: program name -> ``module:function``."""
    text = (root / "pyproject.toml").read_text(encoding="utf-8")
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the table's ``name = "module:function"`` lines
        section = re.search(r"^\[project\.scripts\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
        pairs = re.findall(r'^\s*"?([\w.\-]+)"?\s*=\s*"([^"]+)"', section.group(1) if section else "", re.M)
        return dict(pairs)
    return dict(tomllib.loads(text)["project"]["scripts"])


def cli_roots(root: Path = REPO) -> dict[str, object]:
    """Program name -> the click command typer builds from the module's ``app`` (nothing runs)."""
    import typer.main

    out = {}
    for program, entry in console_scripts(root).items():
        module = importlib.import_module(entry.split(":")[0])
        out[program] = typer.main.get_command(module.app)
    return out


def python_modules(root: Path = REPO) -> dict[str, str]:
    """``python -m`` module -> program: each console script's top-level package."""
    return {entry.split(":")[0].split(".")[0]: program for program, entry in console_scripts(root).items()}


def logical_lines(lines: Iterable[str], first_line: int = 1) -> Iterator[tuple[int, str]]:
    """(number of the first physical line, the line with ``\\`` continuations joined)."""
    pending: list[str] = []
    start = first_line
    for number, line in enumerate(lines, first_line):
        if not pending:
            start = number
        stripped = line.rstrip()
        if stripped.endswith("\\") and not stripped.endswith("\\\\"):
            pending.append(stripped[:-1])
            continue
        pending.append(line)
        yield start, " ".join(p.strip() for p in pending)
        pending = []
    if pending:
        yield start, " ".join(p.strip() for p in pending)


def strip_comment(line: str) -> str:
    """``line`` without its shell comment: a ``#`` at a word's start, outside quotes."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
            elif ch == "\\" and quote == '"':
                continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i]
    return line


_OPERATORS = {"|", "||", "&&", ";", "&", ";;", "|&"}
_PLACEHOLDER = re.compile(r"<([A-Za-z][\w.:/=,\-]*)>")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_ELLIPSES = {"...", "…"}
_OPTIONAL_ALL = {"options", "OPTIONS", "args", "ARGS", "...", "…", ""}  # `[options]`: any options


def shell_words(line: str) -> list[str] | None:
    """The line's words, operators as words of their own; None when it is no well-formed shell line."""
    line = _PLACEHOLDER.sub(r"\1", strip_comment(line))
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        return list(lexer)
    except ValueError:  # an unclosed quote
        return None


def commands(words: list[str]) -> list[list[str]]:
    """The simple commands of a line: cut at operators, each stopped at its first redirection."""
    out, current, redirected = [], [], False
    for w in words:
        if w in _OPERATORS:
            out.append(current)
            current, redirected = [], False
        elif redirected:
            continue
        elif w and set(w) <= set("<>&") and w not in ("&",):
            redirected = True
        else:
            current.append(w)
    out.append(current)
    return [c for c in out if c]


def invocation(
    words: list[str], programs: Iterable[str], modules: dict[str, str]
) -> tuple[str, list[str]] | None:
    """(program, its argument words) when the command runs one of ``programs``, else None."""
    programs = set(programs)
    i = 0
    while i < len(words) and (_ASSIGNMENT.match(words[i]) or words[i] in ("env", "$")):
        i += 1
    words = words[i:]
    if not words:
        return None
    head = words[0].rsplit("/", 1)[-1]
    if head in programs:
        return head, words[1:]
    launchers = re.fullmatch(r"python[\d.]*|torchrun", head)
    if launchers and "-m" in words:
        at = words.index("-m")
        if at + 1 < len(words) and words[at + 1] in modules:
            return modules[words[at + 1]], words[at + 2 :]
    return None


def invocations(line: str, programs: Iterable[str], modules: dict[str, str]) -> list[tuple[str, list[str]]]:
    """Every invocation of ``programs`` in one logical shell line (``bash -c`` scripts included)."""
    words = shell_words(line.strip().removeprefix("$ "))
    if words is None:
        return []
    out = []
    for command in commands(words):
        shells = [
            i
            for i in range(len(command) - 2)
            if command[i].rsplit("/", 1)[-1] in ("bash", "sh") and command[i + 1] == "-c"
        ]
        if shells:  # `bash -c SCRIPT`, also behind a launcher (`srun bash -c …`)
            out += invocations(command[shells[0] + 2], programs, modules)
            continue
        found = invocation(command, programs, modules)
        if found:
            out.append(found)
    return out


def placeholders_read(args: list[str]) -> list[str]:
    """Arguments as the parser gets them: ``...``, ``…``, ``[options]`` and ``[...]`` dropped, the
    brackets of an optional part dropped (``[--x`` ``Y]`` -> ``--x`` ``Y``)."""
    out = []
    for a in args:
        if a in _ELLIPSES:
            continue
        if a.startswith("[") or a.endswith("]"):
            inner = a.lstrip("[").rstrip("]")
            if "[" not in inner and "]" not in inner:  # not a value such as '[0,2]x[1]'
                if a.startswith("[") and a.endswith("]") and inner in _OPTIONAL_ALL:
                    continue
                a = inner
        out.append(a)
    return out


def _usage_error() -> type[Exception]:
    try:
        from typer._click.exceptions import UsageError  # the click typer parses with (vendored)
    except ImportError:  # a typer that runs on click itself
        from click.exceptions import UsageError
    return UsageError


def check_argv(command, program: str, args: list[str]) -> list[str]:
    """Why the click ``command`` (a group or a leaf) would refuse ``args``: the parser's own errors
    (unknown option, option without its value), an unknown subcommand, extra or missing positionals.
    Only the parser runs: no callback, no type conversion, no command body."""
    usage_error = _usage_error()
    path, parent = [program], None
    args = list(args)
    while True:
        settings = dict(getattr(command, "context_settings", None) or {})
        ctx = command.context_class(command, info_name=path[-1], parent=parent, **settings)
        try:
            opts, rest, order = command.make_parser(ctx).parse_args(args=list(args))
        except usage_error as err:
            return [f"{' '.join(path)}: {err.format_message()}"]
        if hasattr(command, "get_command"):  # a group: the next word names the subcommand
            if not rest:
                return []
            # A flag with a callback (--help, --version, --show-completion, --install-completion) ends
            # the program in that callback, which runs before the subcommand is looked up.
            ending = [p for p in order if getattr(p, "is_flag", False) and p.callback is not None]
            if ending:
                return [
                    f"{' '.join(path)}: {ending[0].opts[0]} ends the program; {' '.join(rest)!r} is never read"
                ]
            sub = command.get_command(ctx, rest[0])
            if sub is None:
                known = ", ".join(sorted(command.list_commands(ctx)))
                return [f"{' '.join(path)}: no command {rest[0]!r} (commands: {known})"]
            path.append(rest[0])
            command, parent, args = sub, ctx, rest[1:]
            continue
        failures = []
        if rest and not ctx.allow_extra_args:
            failures.append(f"{' '.join(path)}: unexpected extra argument(s): {' '.join(rest)}")
        for param in command.params:
            if (
                param.param_type_name == "argument"
                and param.required
                and opts.get(param.name) in (None, (), [])
            ):
                failures.append(
                    f"{' '.join(path)}: missing argument {(getattr(param, 'metavar', None) or param.name).upper()}"
                )
        return failures


def cli_lines(
    text: str, programs: Iterable[str], modules: dict[str, str]
) -> list[tuple[int, str, str, list[str] | None]]:
    """(line number, logical line, program, arguments) of every CLI invocation in ``text``'s code
    blocks; the arguments are None for a line that starts with a program but is no well-formed shell
    line (an unclosed quote)."""
    programs = tuple(programs)
    starts = re.compile(
        r"^(?:\$ )?(?:[A-Za-z_]\w*=\S*\s+)*(?:\S*/)?("
        + "|".join(re.escape(p) for p in programs)
        + r")(?:\s|$)"
    )
    out: list[tuple[int, str, str, list[str] | None]] = []
    for block in split_fences(text)[1]:
        for number, line in logical_lines(block.lines, block.first_line):
            found = invocations(line, programs, modules)
            out += [(number, line, program, args) for program, args in found]
            m = starts.match(line.strip())
            if m and not found and shell_words(line.strip().removeprefix("$ ")) is None:
                out.append((number, line, m.group(1), None))
    return out


def check_cli_text(text: str, where: str, roots: dict[str, object], modules: dict[str, str]) -> list[str]:
    """One failure line per CLI line of ``text``'s code blocks that the real parser refuses."""
    failures = []
    for number, line, program, args in cli_lines(text, roots, modules):
        if args is None:
            failures.append(f"{where}:{number}: `{line}`: not a well-formed shell line (an unclosed quote?)")
            continue
        for why in check_argv(roots[program], program, placeholders_read(args)):
            failures.append(f"{where}:{number}: `{line}`: {why}")
    return failures


def cli_failures(root: Path = REPO) -> tuple[list[str], int]:
    """(failures, number of CLI lines) over every markdown file of ``root``."""
    roots, modules = cli_roots(root), python_modules(root)
    failures, count = [], 0
    for path in markdown_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        count += len(cli_lines(text, roots, modules))
        failures += check_cli_text(text, rel(path, root), roots, modules)
    return failures, count


# --------------------------------------------------------------------------------------------
# 3. Relative links

_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE_LINK = re.compile(
    r"!?\[(?P<text>[^\[\]]*(?:\[[^\[\]]*\][^\[\]]*)*)\]\(\s*(?P<target><[^>]*>|[^\s)]+)(?:\s+[\"'(][^)]*)?\)"
)
_REFERENCE_DEF = re.compile(r"^ {0,3}\[(?P<text>[^\]]+)\]:\s*(?P<target><[^>]*>|\S+)")
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*?(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)


def links(text: str) -> list[tuple[int, str, str]]:
    """(line number, link text, target) of every inline link, image and reference definition
    outside code blocks and code spans."""
    out = []
    for number, line in split_fences(text)[0]:
        line = _CODE_SPAN.sub(lambda m: "x" * len(m.group(0)), line)
        for m in _INLINE_LINK.finditer(line):
            out.append((number, m.group("text"), m.group("target").strip("<>")))
        m = _REFERENCE_DEF.match(line)
        if m:
            out.append((number, m.group("text"), m.group("target").strip("<>")))
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading (github-slugger): the rendered text lowercased, every
    character but letters, digits, marks, ``_``, ``-`` and spaces dropped, each space a ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link reads as its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    kept = []
    for ch in text:
        if ch in "-_ " or unicodedata.category(ch)[0] in "LNM":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor of a markdown file: its headings' slugs (``-1``, ``-2`` … for repeats) and its
    HTML ``name`` / ``id`` anchors."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    for h in raw_headings(text):
        slug = github_slug(h)
        if slug in seen:
            seen[slug] += 1
            while f"{slug}-{seen[slug]}" in seen:
                seen[slug] += 1
            slug = f"{slug}-{seen[slug]}"
        seen.setdefault(slug, 0)
        out.add(slug)
    out |= set(_HTML_ANCHOR.findall(text))
    return out


def check_links(text: str, md_path: Path, root: Path = REPO) -> list[str]:
    """One failure line per relative link of the markdown file ``md_path`` (holding ``text``) whose
    target does not exist, or whose ``#anchor`` names no heading of the target."""
    where = rel(md_path, root)
    failures = []
    for number, label, target in links(text):
        if _SCHEME.match(target) or target.startswith("//"):
            continue
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part.split("?", 1)[0])
        if path_part:
            base = root if path_part.startswith("/") else md_path.parent
            dest = (base / path_part.lstrip("/")).resolve()
            if not dest.exists():
                failures.append(f"{where}:{number}: [{label}]({target}): {rel(dest, root)} does not exist")
                continue
        else:
            dest = md_path.resolve()
        if anchor and dest.is_file() and dest.suffix == ".md":
            if unquote(anchor).lower() not in {a.lower() for a in anchors(dest.read_text(encoding="utf-8"))}:
                failures.append(
                    f"{where}:{number}: [{label}]({target}): no heading of {rel(dest, root)} has the anchor #{anchor}"
                )
    return failures


def link_failures(root: Path = REPO) -> tuple[list[str], int]:
    """(failures, number of relative links) over every markdown file of ``root``."""
    failures, count = [], 0
    for path in markdown_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        count += sum(1 for _, _, t in links(text) if not _SCHEME.match(t))
        failures += check_links(text, path, root)
    return failures, count
