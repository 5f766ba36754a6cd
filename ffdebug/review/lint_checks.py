"""The generic review checks: ruff and bandit find, review names the place in its own terms.

| check | rules (`review/tools.py` runs them) | what review adds to the rule |
|---|---|---|
| `silent-except` | ruff E722, BLE001, S110, S112 | a blind except counts when its handler neither raises nor calls anything (BLE001 alone also flags `raise OtherError(...) from None` and a reported error); one finding per handler, at its `except` line |
| `torch-load-weights-only` | bandit B614 | the call B614 cannot resolve: `from torch import load` in a module that never imports `torch` itself |
| `public-api-typed` | ruff ANN001-003, ANN201-202, ANN205-206 | the public API only (module level and public classes, per `__all__`; tests, overloads and property setters exempt); one finding per def, at the `def` line, naming the parameters |
| `public-api-docstring` | ruff D101-D103 | the same scope; an override of a documented method of a base class in the reviewed packages inherits its docstring |

Ruff's D1 rules count members of a private module (`_name.py`) as private, so review does too.
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ffdebug.review.checks import Finding, at, check
from ffdebug.review.classes import ClassIndex, documented_in_base
from ffdebug.review.source import SourceFile, decorator_names, keyword, walk_local

if TYPE_CHECKING:
    from ffdebug.review.runner import Project
    from ffdebug.review.tools import ToolHit

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef)
_TORCH_LOADS = ("torch.load", "torch.serialization.load")
_BACKTICKED = re.compile(r"`\**(\w+)`")


def _by_file(project: Project, hits: list[ToolHit]) -> Iterator[tuple[SourceFile, list[ToolHit]]]:
    """The reviewed files with the tool's hits in each (hits elsewhere are not under review)."""
    grouped: dict[str, list[ToolHit]] = {}
    for hit in hits:
        grouped.setdefault(hit.path, []).append(hit)
    for src in project.files:
        found = grouped.get(os.path.abspath(src.path))
        if found:
            yield src, sorted(found, key=lambda h: (h.line, h.col, h.code))


def _innermost(nodes: list[ast.AST], line: int) -> ast.AST | None:
    """The node whose lines hold `line` and that starts last: the innermost def / handler there."""
    holding = [n for n in nodes if n.lineno <= line <= (n.end_lineno or n.lineno)]
    return max(holding, key=lambda n: n.lineno, default=None)


def _nodes(src: SourceFile, kinds: tuple[type, ...]) -> list[ast.AST]:
    return [n for n in ast.walk(src.tree) if isinstance(n, kinds)]


def _rules(tool: str, codes: set[str]) -> str:
    return f"({tool} {', '.join(sorted(codes))})"


# ---------------------------------------------------------------------------------------------
# silent-except


def _is_silent(handler: ast.ExceptHandler) -> bool:
    """No raise and no call at all in the handler: the error vanishes without a trace."""
    for stmt in handler.body:
        for node in [stmt, *walk_local(stmt)]:
            if isinstance(node, (ast.Raise, ast.Call)):
                return False
    return True


@check(
    "silent-except",
    "no bare except, and no broad except that swallows the error",
    "A bare `except:` also catches KeyboardInterrupt and SystemExit; `except Exception: pass` turns "
    "a loading or training failure into a silent fallback that surfaces much later as wrong numbers.",
    tool="ruff",
    codes=("E722", "BLE001", "S110", "S112"),
)
def check_silent_except(project: Project, hits: list[ToolHit]) -> Iterator[Finding]:
    """Bare `except:` (E722), or a blind except (BLE001, S110, S112) whose handler is silent."""
    for src, file_hits in _by_file(project, hits):
        handlers = _nodes(src, (ast.ExceptHandler,))
        found: dict[int, tuple[ast.ExceptHandler, set[str]]] = {}
        for hit in file_hits:
            handler = _innermost(handlers, hit.line)
            if handler is not None and (hit.code == "E722" or _is_silent(handler)):
                found.setdefault(id(handler), (handler, set()))[1].add(hit.code)
        for handler, codes in found.values():
            if handler.type is None:
                why = "bare except: catch the exceptions you expect (it also swallows KeyboardInterrupt)"
            else:
                why = f"except {ast.unparse(handler.type)} swallows the error silently: re-raise, narrow it, or log it"
            yield at("silent-except", src, handler, f"{why} {_rules('ruff', codes)}")


# ---------------------------------------------------------------------------------------------
# torch-load-weights-only


def _unsafe_loads(src: SourceFile) -> Iterator[ast.Call]:
    """torch.load / torch.serialization.load calls (through the file's imports) without weights_only=True."""
    for call in src.calls(*_TORCH_LOADS):
        value = keyword(call, "weights_only")
        if not (isinstance(value, ast.Constant) and value.value is True):
            yield call


def _load_why(src: SourceFile, call: ast.Call | None) -> str:
    value = keyword(call, "weights_only") if call is not None else None
    how = "without weights_only=True" if value is None else f"with weights_only={src.segment(value)}"
    name = src.segment(call.func) if call is not None else "torch.load"
    return f"{name} {how}: it can unpickle arbitrary code"


def _imports_torch(src: SourceFile) -> bool:
    """`import torch` (or `import torch as t`): the only form under which bandit's B614 resolves names."""
    return any(
        isinstance(node, ast.Import) and any(a.name == "torch" for a in node.names)
        for node in ast.walk(src.tree)
    )


@check(
    "torch-load-weights-only",
    "torch.load always passes weights_only=True",
    "weights_only=False unpickles arbitrary objects: loading a checkpoint can run code. Pass "
    "weights_only=True explicitly (older torch defaults to False), or use safetensors.",
    tool="bandit",
    codes=("B614",),
)
def check_torch_load(project: Project, hits: list[ToolHit]) -> Iterator[Finding]:
    """torch.load / torch.serialization.load without a literal weights_only=True (bandit B614)."""
    flagged = {(h.path, h.line): h for h in hits}
    for src in project.files:
        path = os.path.abspath(src.path)
        calls = {c.lineno: c for c in _unsafe_loads(src)}
        for (hit_path, line), hit in sorted(flagged.items()):
            if hit_path == path:
                why = _load_why(src, calls.get(line))
                yield Finding(
                    "torch-load-weights-only", src.path, line, hit.col, f"{why} (bandit {hit.code})"
                )
        if _imports_torch(src):
            continue
        for line, call in calls.items():  # B614 skips modules that never `import torch`
            if (path, line) not in flagged:
                why = _load_why(src, call)
                yield at(
                    "torch-load-weights-only", src, call, f"{why} (B614 misses it: no `import torch` here)"
                )


# ---------------------------------------------------------------------------------------------
# public-api-typed, public-api-docstring


def _module_all(src: SourceFile) -> set[str] | None:
    for stmt in src.tree.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets
        ):
            if isinstance(stmt.value, (ast.List, ast.Tuple)):
                return {
                    e.value
                    for e in stmt.value.elts
                    if isinstance(e, ast.Constant) and isinstance(e.value, str)
                }
    return None


def _public_api(src: SourceFile) -> Iterator[tuple[ast.AST, ast.ClassDef | None]]:
    """(node, enclosing class) of public module-level functions, classes and their methods."""
    exported = _module_all(src)
    for stmt in src.tree.body:
        if getattr(stmt, "name", "_").startswith("_"):
            continue
        if exported is not None and stmt.name not in exported:
            continue
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield stmt, None
        elif isinstance(stmt, ast.ClassDef):
            yield stmt, None
            for item in stmt.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith(
                    "_"
                ):
                    yield item, stmt


def _skip_api(src: SourceFile, node: ast.AST) -> bool:
    decorators = decorator_names(node)
    return (
        src.is_test
        or "overload" in decorators
        or any(d.endswith((".setter", ".deleter")) for d in decorators)
    )


def _public(src: SourceFile, with_classes: bool) -> dict[int, tuple[ast.AST, ast.ClassDef | None]]:
    """id(node) -> (node, enclosing class) of the public API under review in `src`."""
    return {
        id(node): (node, cls)
        for node, cls in _public_api(src)
        if (with_classes or not isinstance(node, ast.ClassDef)) and not _skip_api(src, node)
    }


def _parameter(fn: ast.AST, hit: ToolHit) -> str:
    """The parameter an ANN00x hit points at (by position, else the name in its message), or `return`."""
    if hit.code.startswith("ANN2"):
        return "return"
    a = fn.args
    for p in [*a.posonlyargs, *a.args, a.vararg, *a.kwonlyargs, a.kwarg]:
        if p is not None and (p.lineno, p.col_offset + 1) == (hit.line, hit.col):
            return p.arg
    named = _BACKTICKED.search(hit.message)
    return named.group(1) if named else hit.code


@check(
    "public-api-typed",
    "public functions and methods have type hints on every parameter and the return",
    "Types are the contract callers and reviewers read first; an untyped public boundary lets a "
    "wrong dtype / shape / None through to a place far from the cause.",
    tool="ruff",
    codes=("ANN001", "ANN002", "ANN003", "ANN201", "ANN202", "ANN205", "ANN206"),
)
def check_public_typed(project: Project, hits: list[ToolHit]) -> Iterator[Finding]:
    """Public module-level functions and public methods of public classes that ruff's ANN rules flag."""
    for src, file_hits in _by_file(project, hits):
        public, defs = _public(src, with_classes=False), _nodes(src, _DEFS)
        missing: dict[int, list[ToolHit]] = {}
        for hit in file_hits:
            fn = _innermost(defs, hit.line)
            if fn is not None and id(fn) in public:
                missing.setdefault(id(fn), []).append(hit)
        for key, fn_hits in missing.items():
            node, cls = public[key]
            names = [_parameter(node, h) for h in sorted(fn_hits, key=lambda h: h.code.startswith("ANN2"))]
            what = f"{cls.name}.{node.name}" if cls else node.name
            yield at(
                "public-api-typed",
                src,
                node,
                f"public {what}() has no type hint for: {', '.join(dict.fromkeys(names))} "
                + _rules("ruff", {h.code for h in fn_hits}),
            )


@check(
    "public-api-docstring",
    "public classes, functions and methods have a docstring",
    "The docstring states the contract (shapes, units, what is cached, who owns what) that the code "
    "alone does not; reviewers check the change against it. A method overriding a documented method "
    "of a base class in the same package inherits that docstring.",
    tool="ruff",
    codes=("D101", "D102", "D103"),
)
def check_public_docstring(project: Project, hits: list[ToolHit]) -> Iterator[Finding]:
    """Public classes / functions / methods that ruff's D101-D103 flag, less inherited docstrings."""
    index = None
    for src, file_hits in _by_file(project, hits):
        public, nodes = _public(src, with_classes=True), _nodes(src, (ast.ClassDef, *_DEFS))
        for hit in file_hits:
            node = _innermost(nodes, hit.line)
            if node is None or id(node) not in public:
                continue
            node, cls = public[id(node)]
            if cls is not None:
                index = index or ClassIndex(project)
                if documented_in_base(index, cls, node.name):
                    continue
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            what = f"{cls.name}.{node.name}()" if cls else node.name + ("" if kind == "class" else "()")
            yield at(
                "public-api-docstring", src, node, f"public {kind} {what} has no docstring (ruff {hit.code})"
            )
