"""Playbooks as data: loading, schema validation and rendering (no torch, no CLI).

One YAML file per playbook in the top-level `playbooks/` directory; the package reaches it through
`ffdebug/playbooks`, a symlink in the source tree that setuptools resolves into real files when it
builds a wheel (`[tool.setuptools.package-data] ffdebug = ["playbooks/*.yaml"]`), so the same path
works from a checkout, an editable install and an installed wheel.

Schema (validated on load; an error names the file and the field)::

    name: dump-bisect            # = the file stem
    title: ...                   # one line
    kind: checklist | template   # template: a form to fill in (fix-record)
    summary: ...                 # a paragraph
    use_when: [...]              # optional
    not_for: [...]               # optional
    sources: [...]               # optional: where the item comes from (docs, seeds)
    sections:                    # non-empty
      - id: phase-1
        title: ...
        phase: 1                 # optional integer: `show NAME --phase 1`
        goal / done_when / timebox: ...   # optional strings
        items:                   # non-empty
          - id: db.weights.schema-first      # unique across all playbooks, never renamed
            text: ...            # the step, imperative
            why: ...             # the rationale
            command: ...         # optional: a shell line or a list of them (ffdebug / reference-trainer ...)
            check: [...]         # optional: ids of automated review checks (ffdebug/review/checks.py)
    triage: ...                  # optional decision tree, see ffdebug/review/triage.py
"""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from ffdebug.errors import FFDebugError

PLAYBOOKS_DIR = Path(__file__).resolve().parent.parent / "playbooks"
PROGRAMS = ("ffdebug", "reference-trainer")

_ID = re.compile(r"^[a-z0-9][a-z0-9.-]*$")
_KINDS = ("checklist", "template")
_OPERATORS = {"&&", "||", "|", ";", "&", "(", ")"}


class PlaybookError(FFDebugError):
    """A playbook file is missing or does not follow the schema."""


@dataclass(frozen=True)
class Item:
    """One step: what to do, why, the command that does it, and the automated checks that verify it."""

    id: str
    text: str
    why: str
    command: tuple[str, ...] = ()
    checks: tuple[str, ...] = ()

    def invocations(self) -> list[tuple[str, list[str]]]:
        """(program, arguments) of every ffdebug / reference-trainer call in this item's commands."""
        out = []
        for line in self.command:
            out.extend(parse_invocations(line))
        return out

    def to_json(self) -> dict:
        """Stable keys: id, text, why, command (list), check (list)."""
        return {
            "id": self.id,
            "text": self.text,
            "why": self.why,
            "command": list(self.command),
            "check": list(self.checks),
        }


@dataclass(frozen=True)
class Section:
    """A group of items: a phase of a protocol, or an area of an impact analysis."""

    id: str
    title: str
    items: tuple[Item, ...]
    phase: int | None = None
    goal: str | None = None
    done_when: str | None = None
    timebox: str | None = None

    def to_json(self) -> dict:
        """Stable keys: id, title, phase, goal, done_when, timebox, items."""
        return {
            "id": self.id,
            "title": self.title,
            "phase": self.phase,
            "goal": self.goal,
            "done_when": self.done_when,
            "timebox": self.timebox,
            "items": [i.to_json() for i in self.items],
        }


@dataclass(frozen=True)
class Playbook:
    """A protocol as data."""

    name: str
    title: str
    kind: str
    summary: str
    sections: tuple[Section, ...]
    path: str
    use_when: tuple[str, ...] = ()
    not_for: tuple[str, ...] = ()
    sources: tuple[str, ...] = ()
    triage: dict | None = field(default=None, compare=False)

    @property
    def items(self) -> list[Item]:
        """Every item in order."""
        return [i for s in self.sections for i in s.items]

    @property
    def phases(self) -> list[int]:
        """The phase numbers this playbook defines, in order."""
        return [s.phase for s in self.sections if s.phase is not None]

    def section_for_phase(self, phase: int) -> Section:
        """The section of `phase`; an error listing the phases that exist otherwise."""
        for s in self.sections:
            if s.phase == phase:
                return s
        have = ", ".join(str(p) for p in self.phases) or "none"
        raise PlaybookError(f"playbook {self.name!r} has no phase {phase} (phases: {have})")

    def select(self, phase: int | None) -> list[Section]:
        """All sections, or the one of `phase`."""
        return list(self.sections) if phase is None else [self.section_for_phase(phase)]

    def to_json(self, phase: int | None = None) -> dict:
        """Stable keys: name, title, kind, summary, use_when, not_for, sources, sections."""
        return {
            "name": self.name,
            "title": self.title,
            "kind": self.kind,
            "summary": self.summary,
            "use_when": list(self.use_when),
            "not_for": list(self.not_for),
            "sources": list(self.sources),
            "sections": [s.to_json() for s in self.select(phase)],
        }


# ---------------------------------------------------------------------------------------------
# loading and validation


def playbooks_dir() -> Path:
    """The directory holding the playbook YAML files; an error saying how to restore it if missing."""
    if not PLAYBOOKS_DIR.is_dir():
        raise PlaybookError(
            f"{PLAYBOOKS_DIR}: playbook directory not found; in a checkout it is the symlink "
            "ffdebug/playbooks -> ../playbooks (restore it with `git checkout -- ffdebug/playbooks playbooks`), "
            "in an install it is package data (reinstall ffdebug)"
        )
    return PLAYBOOKS_DIR


def _str(data: dict, key: str, where: str, required: bool = True) -> str | None:
    value = data.get(key)
    if value is None:
        if required:
            raise PlaybookError(f"{where}: missing '{key}'")
        return None
    if not isinstance(value, str) or not value.strip():
        raise PlaybookError(f"{where}: '{key}' must be a non-empty string, got {value!r}")
    return " ".join(value.split())


def _str_list(data: dict, key: str, where: str) -> tuple[str, ...]:
    value = data.get(key)
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise PlaybookError(f"{where}: '{key}' must be a string or a list of non-empty strings")
    return tuple(v.strip() if key == "command" else " ".join(v.split()) for v in value)


def _check_keys(data: dict, allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise PlaybookError(
            f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(allowed))})"
        )


def _item(data: object, where: str) -> Item:
    if not isinstance(data, dict):
        raise PlaybookError(f"{where}: an item must be a mapping")
    _check_keys(data, {"id", "text", "why", "command", "check"}, where)
    item_id = _str(data, "id", where)
    if not _ID.match(item_id):
        raise PlaybookError(f"{where}: id {item_id!r} must be lower-case letters, digits, '.' and '-'")
    where = f"{where} ({item_id})"
    return Item(
        id=item_id,
        text=_str(data, "text", where),
        why=_str(data, "why", where),
        command=_str_list(data, "command", where),
        checks=_str_list(data, "check", where),
    )


def _section(data: object, where: str) -> Section:
    if not isinstance(data, dict):
        raise PlaybookError(f"{where}: a section must be a mapping")
    _check_keys(data, {"id", "title", "phase", "goal", "done_when", "timebox", "items"}, where)
    section_id = _str(data, "id", where)
    where = f"{where} ({section_id})"
    phase = data.get("phase")
    if phase is not None and (not isinstance(phase, int) or isinstance(phase, bool) or phase < 0):
        raise PlaybookError(f"{where}: 'phase' must be a non-negative integer, got {phase!r}")
    items = data.get("items")
    if not isinstance(items, list) or not items:
        raise PlaybookError(f"{where}: 'items' must be a non-empty list")
    return Section(
        id=section_id,
        title=_str(data, "title", where),
        items=tuple(_item(d, f"{where}.items[{i}]") for i, d in enumerate(items)),
        phase=phase,
        goal=_str(data, "goal", where, required=False),
        done_when=_str(data, "done_when", where, required=False),
        timebox=_str(data, "timebox", where, required=False),
    )


def parse_playbook(data: object, path: str) -> Playbook:
    """Validate one playbook document (already YAML-decoded) and build it."""
    where = path
    if not isinstance(data, dict):
        raise PlaybookError(f"{where}: a playbook must be a mapping")
    _check_keys(
        data,
        {"name", "title", "kind", "summary", "use_when", "not_for", "sources", "sections", "triage"},
        where,
    )
    name = _str(data, "name", where)
    stem = Path(path).stem
    if name != stem:
        raise PlaybookError(f"{where}: name {name!r} must equal the file name {stem!r}")
    kind = data.get("kind", "checklist")
    if kind not in _KINDS:
        raise PlaybookError(f"{where}: 'kind' must be one of {', '.join(_KINDS)}, got {kind!r}")
    sections = data.get("sections")
    if not isinstance(sections, list) or not sections:
        raise PlaybookError(f"{where}: 'sections' must be a non-empty list")
    built = tuple(_section(d, f"{where}: sections[{i}]") for i, d in enumerate(sections))
    phases = [s.phase for s in built if s.phase is not None]
    if len(phases) != len(set(phases)):
        raise PlaybookError(f"{where}: a phase number appears twice ({phases})")
    ids = [s.id for s in built]
    if len(ids) != len(set(ids)):
        raise PlaybookError(f"{where}: a section id appears twice ({ids})")
    triage = data.get("triage")
    if triage is not None and not isinstance(triage, dict):
        raise PlaybookError(f"{where}: 'triage' must be a mapping")
    return Playbook(
        name=name,
        title=_str(data, "title", where),
        kind=kind,
        summary=_str(data, "summary", where),
        sections=built,
        path=path,
        use_when=_str_list(data, "use_when", where),
        not_for=_str_list(data, "not_for", where),
        sources=_str_list(data, "sources", where),
        triage=triage,
    )


def load_file(path: Path) -> Playbook:
    """Read and validate one playbook file."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise PlaybookError(f"{path}: cannot read playbook ({' '.join(str(err).split())})") from None
    return parse_playbook(data, str(path))


@functools.lru_cache(maxsize=4)
def _load_all(directory: str) -> dict[str, Playbook]:
    files = sorted(Path(directory).glob("*.yaml"))
    if not files:
        raise PlaybookError(f"{directory}: no playbook files (*.yaml)")
    books = {}
    seen: dict[str, str] = {}
    for f in files:
        book = load_file(f)
        for item in book.items:
            if item.id in seen:
                raise PlaybookError(f"{f}: item id {item.id!r} is already used in {seen[item.id]}")
            seen[item.id] = book.name
        books[book.name] = book
    if books.get("dump-bisect") is not None and books["dump-bisect"].triage is not None:
        from ffdebug.review.triage import parse_tree

        parse_tree(books["dump-bisect"].triage, books, f"{directory}/dump-bisect.yaml: triage")
    return books


def load_all(directory: Path | None = None) -> dict[str, Playbook]:
    """Every playbook, by name, validated (item ids unique across playbooks)."""
    return _load_all(str(directory or playbooks_dir()))


def load(name: str, directory: Path | None = None) -> Playbook:
    """One playbook by name; an error listing the names that exist otherwise."""
    books = load_all(directory)
    if name not in books:
        raise PlaybookError(f"no playbook {name!r}; playbooks: {', '.join(books)}")
    return books[name]


def unknown_checks(books: dict[str, Playbook], known: set[str]) -> list[tuple[str, str, str]]:
    """(playbook, item id, check id) for every check id an item names that `known` lacks."""
    return [(b.name, i.id, c) for b in books.values() for i in b.items for c in i.checks if c not in known]


# ---------------------------------------------------------------------------------------------
# commands named in items


def parse_invocations(line: str) -> list[tuple[str, list[str]]]:
    """(program, args) for each ffdebug / reference-trainer call in a shell line.

    Splits on `&&`, `||`, `|`, `;`; skips leading `VAR=value` assignments. Other programs
    (python, torchrun, git, ruff) are not ours and are not returned.
    """
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    try:
        tokens = list(lexer)
    except ValueError as err:
        raise PlaybookError(f"command {line!r} is not a valid shell line ({err})") from None
    out, segment = [], []
    for tok in [*tokens, ";"]:
        if tok in _OPERATORS:
            while segment and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", segment[0]):
                segment.pop(0)
            if segment and segment[0] in PROGRAMS:
                out.append((segment[0], segment[1:]))
            segment = []
        else:
            segment.append(tok)
    return out


# ---------------------------------------------------------------------------------------------
# rendering (plain text / markdown; the CLI adds colour)


def render_markdown(book: Playbook, phase: int | None = None) -> str:
    """A markdown checklist (kind checklist) or fill-in form (kind template), ready for a PR."""
    lines = [f"## {book.title}", "", book.summary, ""]
    if book.kind == "template":
        for section in book.select(phase):
            lines += [f"### {section.title}", ""]
            for item in section.items:
                lines += [f"**{item.text}**", f"<!-- {item.why} -->", "", "_…_", ""]
        return "\n".join(lines).rstrip() + "\n"
    for section in book.select(phase):
        head = (
            f"### Phase {section.phase}: {section.title}"
            if section.phase is not None
            else f"### {section.title}"
        )
        lines += [head, ""]
        if section.goal:
            lines.append(f"Goal: {section.goal}")
        if section.done_when:
            lines.append(f"Move on when: {section.done_when}")
        if section.goal or section.done_when:
            lines.append("")
        for item in section.items:
            auto = f" _(auto: {', '.join(f'`{c}`' for c in item.checks)})_" if item.checks else ""
            lines.append(f"- [ ] {item.text}{auto} <!-- {item.id} -->")
            for cmd in item.command:
                lines.append(f"  - `{cmd}`")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
