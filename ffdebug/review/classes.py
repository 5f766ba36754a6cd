"""The classes of the reviewed packages, indexed across files for the project-scope checks.

Read by the trainer-registry checks (registrations, execution contracts, inheritance) and by
`public-api-docstring` (an override inherits its base method's docstring).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ffdebug.review.source import SourceFile, decorator_names, keyword, last_name

if TYPE_CHECKING:
    from ffdebug.review.runner import Project


@dataclass
class ClassInfo:
    """One class of the scanned packages: its bases, registrations and declared execution contract."""

    src: SourceFile
    node: ast.ClassDef
    bases: list[str]
    registered: dict[str, str]  # "trainer" / "arguments" -> registry name
    arguments_class: str | None  # register_trainer(NAME, arguments=CLASS): the CLASS name
    contract: ast.expr | None
    contract_node: ast.AST | None
    abstract: bool


def _registration(src: SourceFile, cls: ast.ClassDef) -> tuple[dict[str, str], str | None]:
    """(registry names by kind, the class passed as ``register_trainer(NAME, arguments=CLASS)``)."""
    out, arguments_class = {}, None
    for d in cls.decorator_list:
        if isinstance(d, ast.Call) and d.args and isinstance(d.args[0], ast.Constant):
            name = last_name(d.func)
            if name in ("register_trainer", "register_arguments"):
                out[name.split("_", 1)[1]] = str(d.args[0].value)
            arguments = keyword(d, "arguments") if name == "register_trainer" else None
            if arguments is not None:
                arguments_class = last_name(arguments)
    return out, arguments_class


def _class_info(src: SourceFile, cls: ast.ClassDef) -> ClassInfo:
    contract = contract_node = None
    for stmt in cls.body:
        target = None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            target = stmt.target
        if isinstance(target, ast.Name) and target.id == "execution_contract":
            contract, contract_node = stmt.value, stmt
    abstract = (
        cls.name.startswith(("Base", "_", "Abstract"))
        or any(last_name(b) in ("ABC", "Protocol") for b in cls.bases)
        or any(
            "abstractmethod" in decorator_names(f)
            for f in cls.body
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        )
    )
    registered, arguments_class = _registration(src, cls)
    return ClassInfo(
        src,
        cls,
        [last_name(b) or "" for b in cls.bases],
        registered,
        arguments_class,
        contract,
        contract_node,
        abstract,
    )


def _contract_value(expr: ast.expr | None, constants: dict[str, tuple]) -> tuple | str | None:
    """Normalise ExecutionContract(...) / a named preset to (acquisition, feedback) where possible."""
    if expr is None:
        return None
    if isinstance(expr, ast.Call) and last_name(expr.func) == "ExecutionContract":
        values = {kw.arg: kw.value for kw in expr.keywords}
        for name, arg in zip(("acquisition", "feedback"), expr.args):
            values[name] = arg
        acq, fb = values.get("acquisition"), values.get("feedback")
        if isinstance(acq, ast.Constant) and isinstance(fb, ast.Constant):
            return (acq.value, fb.value)
        return ast.unparse(expr)
    name = last_name(expr)
    if name is not None:
        return constants.get(name, name)
    return ast.unparse(expr)


def describe(value: tuple | str | None) -> str:
    """A contract value as `acquisition+feedback` (or its source text)."""
    if isinstance(value, tuple):
        return "+".join(str(v) for v in value)
    return str(value)


class ClassIndex:
    """Every class of the scanned files' packages, with registrations, contracts and bases."""

    def __init__(self, project: Project) -> None:
        self.classes: dict[str, list[ClassInfo]] = {}
        self.constants: dict[str, tuple] = {}
        for src in project.resolution_files():
            for stmt in src.tree.body:
                if isinstance(stmt, ast.ClassDef):
                    self.classes.setdefault(stmt.name, []).append(_class_info(src, stmt))
                elif (
                    isinstance(stmt, ast.Assign)
                    and len(stmt.targets) == 1
                    and isinstance(stmt.targets[0], ast.Name)
                    and isinstance(stmt.value, ast.Call)
                ):
                    value = _contract_value(stmt.value, {})
                    if isinstance(value, tuple):  # NAME = ExecutionContract("generation", "none")
                        self.constants[stmt.targets[0].id] = value
        for infos in list(self.classes.values()):  # register_trainer(NAME, arguments=CLASS) registers CLASS
            for info in infos:
                arguments = self.info(info.arguments_class) if info.arguments_class else None
                if arguments is not None and "trainer" in info.registered:
                    arguments.registered.setdefault("arguments", info.registered["trainer"])

    def info(self, name: str) -> ClassInfo | None:
        """The first class named `name` in the scan, or None."""
        found = self.classes.get(name)
        return found[0] if found else None

    def is_trainer(self, info: ClassInfo, seen: frozenset = frozenset()) -> bool:
        """True for a registered trainer or a subclass of BaseTrainer (through known bases)."""
        if info.registered.get("trainer"):
            return True
        for base in info.bases:
            if base == "BaseTrainer":
                return True
            parent = self.info(base)
            if parent is not None and base not in seen and self.is_trainer(parent, seen | {base}):
                return True
        return False

    def contract(
        self, info: ClassInfo, seen: frozenset = frozenset()
    ) -> tuple[tuple | str | None, ClassInfo]:
        """The class's execution_contract value, inherited through bases known to the scan."""
        if info.contract is not None:
            return _contract_value(info.contract, self.constants), info
        for base in info.bases:
            parent = self.info(base)
            if parent is not None and base not in seen:
                value, owner = self.contract(parent, seen | {base})
                if value is not None:
                    return value, owner
        return None, info

    def registered(self, kind: str) -> dict[str, ClassInfo]:
        """Registry name -> class, for `kind` "trainer" or "arguments"."""
        return {
            i.registered[kind]: i for infos in self.classes.values() for i in infos if kind in i.registered
        }


def documented_in_base(
    index: ClassIndex, cls: ast.ClassDef, method: str, seen: frozenset = frozenset()
) -> bool:
    """True when a base class known to the scan defines `method` with a docstring (it is inherited)."""
    for base in cls.bases:
        name = last_name(base) or ""
        parent = index.info(name)
        if parent is None or name in seen:
            continue
        for stmt in parent.node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == method:
                if ast.get_docstring(stmt) is not None:
                    return True
        if documented_in_base(index, parent.node, method, seen | {name}):
            return True
    return False
