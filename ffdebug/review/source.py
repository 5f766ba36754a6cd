"""Parsed Python sources for the review checks: the AST, import aliases and small AST helpers.

A check never matches text with a regex where structure matters: it asks a `SourceFile` what a call
resolves to (`F.cosine_similarity` -> `torch.nn.functional.cosine_similarity`, through the file's
imports), which class or function encloses a node, and which lines carry a suppression comment
(`# ffdebug: ignore[check-id]`, or `# ffdebug: ignore` for every check on that line).
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ffdebug.errors import FFDebugError

_SUPPRESS = re.compile(r"#\s*ffdebug:\s*ignore(?:\[([a-z0-9,\s-]+)\])?")


def dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a Name / Attribute chain, else None (calls, subscripts, ...)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def last_name(node: ast.AST) -> str | None:
    """The final identifier of a Name / Attribute (`self.kl` -> `kl`), else None."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    return None


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    """The value of keyword argument `name` of `call`, or None."""
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def has_star_kwargs(call: ast.Call) -> bool:
    """True when the call passes `**kwargs` (its keywords cannot be seen statically)."""
    return any(kw.arg is None for kw in call.keywords)


def decorator_names(fn: ast.AST) -> set[str]:
    """Every decorator of `fn` by its last name and its dotted name (`overload`, `size.setter`)."""
    out = set()
    for d in getattr(fn, "decorator_list", []):
        target = d.func if isinstance(d, ast.Call) else d
        out.add(last_name(target) or "")
        name = dotted(target)
        if name:
            out.add(name)
    return out


def walk_local(node: ast.AST) -> Iterator[ast.AST]:
    """`ast.walk` that does not descend into nested function or class definitions."""
    todo = list(ast.iter_child_nodes(node))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(n))


def is_test_path(path: str) -> bool:
    """Test modules (`test_*.py`, `*_test.py`, `conftest.py`, anything under `tests/`)."""
    p = Path(path)
    return (
        p.name.startswith("test_")
        or p.name.endswith("_test.py")
        or p.name == "conftest.py"
        or "tests" in p.parts[:-1]
    )


@dataclass
class SourceFile:
    """One parsed Python file. `path` is as displayed (relative to the working directory)."""

    path: str
    text: str
    tree: ast.Module
    is_new: bool = False
    aliases: dict[str, str] = field(default_factory=dict)
    parents: dict[int, ast.AST] = field(default_factory=dict)
    suppressions: dict[int, set[str] | None] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str, is_new: bool = False) -> SourceFile:
        """Read and parse `path`; a syntax error is a usage error naming the file and line."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise FFDebugError(f"{path}: cannot read ({err})") from None
        return cls.parse(path, text, is_new=is_new)

    @classmethod
    def parse(cls, path: str, text: str, is_new: bool = False) -> SourceFile:
        """Parse `text` as the contents of `path`."""
        try:
            tree = ast.parse(text, filename=path)
        except SyntaxError as err:
            raise FFDebugError(
                f"{path}:{err.lineno}: not valid Python ({err.msg}); fix it or exclude it"
            ) from None
        src = cls(path=path, text=text, tree=tree, is_new=is_new)
        src._index()
        return src

    def _index(self) -> None:
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[id(child)] = node
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        head = a.name.split(".")[0]
                        self.aliases[head] = head
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for lineno, line in enumerate(self.text.splitlines(), start=1):
            m = _SUPPRESS.search(line)
            if m:
                ids = m.group(1)
                self.suppressions[lineno] = {s.strip() for s in ids.split(",") if s.strip()} if ids else None

    # -- questions checks ask ----------------------------------------------------------------
    @property
    def is_test(self) -> bool:
        """True for test modules (see `is_test_path`)."""
        return is_test_path(self.path)

    def resolve(self, node: ast.AST) -> str | None:
        """Fully qualified dotted name of `node` through this file's imports (`F.x` -> `torch.nn.functional.x`)."""
        name = dotted(node)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        if head in self.aliases:
            full = self.aliases[head]
            return f"{full}.{rest}" if rest else full
        return name

    def calls(self, *qualified: str) -> Iterator[ast.Call]:
        """Every Call node whose function resolves to one of `qualified` names."""
        wanted = set(qualified)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call) and self.resolve(node.func) in wanted:
                yield node

    def parent(self, node: ast.AST) -> ast.AST | None:
        """The syntactic parent of `node`."""
        return self.parents.get(id(node))

    def enclosing(self, node: ast.AST, kinds: tuple[type, ...]) -> ast.AST | None:
        """The nearest ancestor of `node` of one of `kinds`."""
        p = self.parent(node)
        while p is not None and not isinstance(p, kinds):
            p = self.parent(p)
        return p

    def suppressed(self, line: int, check_id: str) -> bool:
        """True when `line` carries `# ffdebug: ignore` or `# ffdebug: ignore[check_id]`."""
        if line not in self.suppressions:
            return False
        ids = self.suppressions[line]
        return ids is None or check_id in ids

    def segment(self, node: ast.AST) -> str:
        """The source text of `node` (one line, shortened)."""
        text = ast.get_source_segment(self.text, node) or ""
        text = " ".join(text.split())
        return text if len(text) <= 60 else text[:57] + "..."


def display_path(path: str) -> str:
    """`path` relative to the working directory when it lies below it, else as given."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel
