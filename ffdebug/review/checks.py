"""The automated review checks. Each is one small function registered under a stable id.

A file check is `fn(src: SourceFile, config: ReviewConfig) -> Iterable[Finding]`; a project check
(`scope="project"`) is `fn(project: Project) -> Iterable[Finding]` and sees every scanned file at
once (the trainer-registry check pairs a trainer in one file with its arguments in another).
Playbook items name these ids in their `check:` field; `tests/review/` asserts every named id
exists here and that every check has a fixture that breaks it.

Ids are stable (playbooks and suppression comments refer to them): add new ones, never rename.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ffdebug.review.source import SourceFile, dotted, has_star_kwargs, keyword, last_name, walk_local

if TYPE_CHECKING:
    from ffdebug.review.runner import Project, ReviewConfig


@dataclass(frozen=True)
class Finding:
    """One failed check at one place: `path:line` and a one-line why."""

    check: str
    path: str
    line: int
    col: int
    message: str

    @property
    def location(self) -> str:
        """`path:line`, the form editors and terminals turn into links."""
        return f"{self.path}:{self.line}"

    def to_json(self) -> dict:
        """Stable JSON keys: check, path, line, col, message."""
        return {
            "check": self.check,
            "path": self.path,
            "line": self.line,
            "col": self.col,
            "message": self.message,
        }


@dataclass(frozen=True)
class Check:
    """A registered check: id, one-line title, why it matters, and the function that runs it."""

    id: str
    title: str
    why: str
    scope: str
    fn: Callable = field(repr=False)


CHECKS: dict[str, Check] = {}


def check(check_id: str, title: str, why: str, scope: str = "file") -> Callable[[Callable], Callable]:
    """Register `fn` as the check `check_id` (`scope` is "file" or "project")."""

    def decorator(fn: Callable) -> Callable:
        if check_id in CHECKS:
            raise ValueError(f"review check {check_id!r} is registered twice")
        CHECKS[check_id] = Check(check_id, title, why, scope, fn)
        return fn

    return decorator


def _at(check_id: str, src: SourceFile, node: ast.AST, message: str) -> Finding:
    return Finding(
        check_id, src.path, getattr(node, "lineno", 1), getattr(node, "col_offset", 0) + 1, message
    )


# ---------------------------------------------------------------------------------------------
# component-hasattr

_COMPONENT_OWNER = re.compile(r"adapter|pipeline|pipe$|components?$|runtime|bundle", re.IGNORECASE)
_COMPONENT_NAMES = {
    "transformer",
    "unet",
    "vae",
    "text_encoder",
    "text_encoder_2",
    "text_encoder_3",
    "tokenizer",
    "tokenizer_2",
    "tokenizer_3",
    "scheduler",
    "image_encoder",
    "feature_extractor",
    "controlnet",
    "fake_score",
    "real_score",
}


def _is_adapter_class(cls: ast.ClassDef | None) -> bool:
    if cls is None:
        return False
    names = [cls.name] + [last_name(b) or "" for b in cls.bases]
    return any(n.endswith("Adapter") for n in names)


@check(
    "component-hasattr",
    "components are resolved through the component runtime, never hasattr()",
    "hasattr(adapter, 'vae') cannot tell a declared-but-absent optional component (None) from an "
    "undeclared name, and silently takes the fallback path; use has_component / get_component / "
    "_require_component.",
)
def check_component_hasattr(src: SourceFile, config: ReviewConfig) -> Iterator[Finding]:
    """hasattr(obj, name) / getattr(obj, name, default) where obj is an adapter or pipeline, or name a component."""
    for call in src.calls("hasattr", "getattr"):
        fn = call.func.id if isinstance(call.func, ast.Name) else ""
        if len(call.args) < 2 or (fn == "getattr" and len(call.args) < 3):
            continue
        owner, attr = call.args[0], call.args[1]
        owner_name = dotted(owner) or ""
        attr_name = attr.value if isinstance(attr, ast.Constant) and isinstance(attr.value, str) else None
        on_adapter = bool(_COMPONENT_OWNER.search(owner_name.split(".")[-1])) or (
            owner_name in ("self", "cls") and _is_adapter_class(src.enclosing(call, (ast.ClassDef,)))
        )
        if on_adapter or attr_name in _COMPONENT_NAMES:
            yield _at(
                "component-hasattr",
                src,
                call,
                f"{src.segment(call)} probes an attribute: resolve components with has_component() / "
                "get_component() / _require_component()",
            )


# ---------------------------------------------------------------------------------------------
# dataset-distributed-sampler, dataset-set-epoch

_DATALOADER = ("torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader")
_DIST_SAMPLER = ("torch.utils.data.DistributedSampler", "torch.utils.data.distributed.DistributedSampler")


@check(
    "dataset-distributed-sampler",
    "dataset loaders use torch's DistributedSampler, even at one rank",
    "Without DistributedSampler the data order differs between one rank and N ranks and between "
    "runs, so an exact resume and a rank-count change both change the trajectory.",
)
def check_dataset_sampler(src: SourceFile, config: ReviewConfig) -> Iterator[Finding]:
    """DataLoader(...) with no sampler, or with a sampler built from anything but DistributedSampler."""
    for call in src.calls(*_DATALOADER):
        if has_star_kwargs(call):
            continue
        sampler = keyword(call, "sampler") or keyword(call, "batch_sampler")
        if sampler is None and len(call.args) < 4:  # the 4th positional argument is the sampler
            yield _at(
                "dataset-distributed-sampler",
                src,
                call,
                "DataLoader without a sampler: pass sampler=DistributedSampler(...) (even at one rank)",
            )
        elif isinstance(sampler, ast.Call) and src.resolve(sampler.func) not in _DIST_SAMPLER:
            yield _at(
                "dataset-distributed-sampler",
                src,
                sampler,
                f"DataLoader sampler {src.segment(sampler.func)}(...) is not a DistributedSampler",
            )


@check(
    "dataset-set-epoch",
    "every DistributedSampler gets set_epoch(data_epoch) before each epoch",
    "Without set_epoch every epoch replays the first epoch's order: training silently sees less "
    "shuffling, and a resumed run cannot reproduce the epoch it resumes into.",
)
def check_set_epoch(src: SourceFile, config: ReviewConfig) -> Iterator[Finding]:
    """A DistributedSampler created in a class (or module) that never calls .set_epoch()."""
    for call in src.calls(*_DIST_SAMPLER):
        scope = src.enclosing(call, (ast.ClassDef,)) or src.tree
        calls_set_epoch = any(
            isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "set_epoch"
            for n in ast.walk(scope)
        )
        if not calls_set_epoch:
            where = f"class {scope.name}" if isinstance(scope, ast.ClassDef) else "this module"
            yield _at(
                "dataset-set-epoch",
                src,
                call,
                f"DistributedSampler created but {where} never calls sampler.set_epoch(data_epoch)",
            )


# ---------------------------------------------------------------------------------------------
# torch-load-weights-only


@check(
    "torch-load-weights-only",
    "torch.load always passes weights_only=True",
    "weights_only=False unpickles arbitrary objects: loading a checkpoint can run code. Pass "
    "weights_only=True explicitly (older torch defaults to False), or use safetensors.",
)
def check_torch_load(src: SourceFile, config: ReviewConfig) -> Iterator[Finding]:
    """torch.load(...) without weights_only=True (missing, False, or not a literal True)."""
    for call in src.calls("torch.load"):
        value = keyword(call, "weights_only")
        if isinstance(value, ast.Constant) and value.value is True:
            continue
        why = "without weights_only=True" if value is None else f"with weights_only={src.segment(value)}"
        yield _at("torch-load-weights-only", src, call, f"torch.load {why}: it can unpickle arbitrary code")


# ---------------------------------------------------------------------------------------------
# silent-except

_BROAD = {"Exception", "BaseException", "builtins.Exception", "builtins.BaseException"}


def _is_broad(src: SourceFile, handler: ast.ExceptHandler) -> bool:
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(src.resolve(t) in _BROAD for t in types)


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
)
def check_silent_except(src: SourceFile, config: ReviewConfig) -> Iterator[Finding]:
    """Bare `except:`, or `except Exception` / `BaseException` whose body neither raises nor calls anything."""
    for node in ast.walk(src.tree):
        if not isinstance(node, ast.ExceptHandler):
            continue
        if node.type is None:
            yield _at(
                "silent-except",
                src,
                node,
                "bare except: catch the exceptions you expect (it also swallows KeyboardInterrupt)",
            )
        elif _is_broad(src, node) and _is_silent(node):
            yield _at(
                "silent-except",
                src,
                node,
                f"except {src.segment(node.type)} swallows the error silently: re-raise, narrow it, or log it",
            )


# ---------------------------------------------------------------------------------------------
# fp32-cosine

_COSINE = (
    "torch.nn.functional.cosine_similarity",
    "torch.cosine_similarity",
    "torch.nn.CosineSimilarity",
    "torch.nn.modules.distance.CosineSimilarity",
)
_NORMS = {"norm", "vector_norm", "sqrt"}


def _mentions_float64(src: SourceFile, node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and n.attr in ("double", "float64"):
            return True
        if isinstance(n, ast.Constant) and n.value in ("float64", "double"):
            return True
    return False


def _float64_names(src: SourceFile, node: ast.AST) -> set[str]:
    """Names assigned from a float64 expression in the function enclosing `node` (`r = ref.double()`)."""
    scope = src.enclosing(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or src.tree
    names: set[str] = set()
    for stmt in ast.walk(scope):
        if not isinstance(stmt, ast.Assign):
            continue
        for target in stmt.targets:
            if isinstance(target, ast.Name) and _mentions_float64(src, stmt.value):
                names.add(target.id)
            elif isinstance(target, ast.Tuple) and isinstance(stmt.value, ast.Tuple):
                for t, v in zip(target.elts, stmt.value.elts):
                    if isinstance(t, ast.Name) and _mentions_float64(src, v):
                        names.add(t.id)
    return names


def _is_norm(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and last_name(node.func) in _NORMS


def _is_norm_product(node: ast.AST) -> bool:
    if _is_norm(node):
        return True
    return (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Mult)
        and _is_norm(node.left)
        and _is_norm(node.right)
    )


@check(
    "fp32-cosine",
    "comparison code measures cosine in float64 (ffdebug's metrics), not cosine_similarity in fp32",
    "An fp32 / bf16 cosine rounds: it reads 1.0 (even > 1) on tensors that differ by 1e-5 relative, "
    "hides drift that compounds over layers, and is dominated by outliers. Use ffdebug.compare / "
    "ffdebug.comparison.metrics, which accumulate in float64 and also report rel.",
)
def check_fp32_cosine(src: SourceFile, config: ReviewConfig) -> Iterator[Finding]:
    """cosine_similarity / CosineSimilarity, or a hand-rolled dot / (norm * norm), with no float64 in sight."""
    seen: set[int] = set()
    for call in src.calls(*_COSINE):
        if not _mentions_float64(src, call):
            seen.add(call.lineno)
            yield _at(
                "fp32-cosine",
                src,
                call,
                f"{src.segment(call.func)} computes cosine in the input dtype: use ffdebug's float64 metrics",
            )
    for node in ast.walk(src.tree):
        if (
            isinstance(node, ast.BinOp)
            and isinstance(node.op, ast.Div)
            and _is_norm_product(node.right)
            and not _is_norm(node.right)  # x / x.norm() normalises; dot / (‖a‖‖b‖) is a cosine
            and node.lineno not in seen
            and not _mentions_float64(src, node)
            and not {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & _float64_names(src, node)
        ):
            yield _at(
                "fp32-cosine",
                src,
                node,
                "hand-rolled cosine (dot / (norm * norm)) in the input dtype: use ffdebug's float64 metrics",
            )


# ---------------------------------------------------------------------------------------------
# loss-under-no-grad

_NO_GRAD = {
    "torch.no_grad",
    "torch.inference_mode",
    "torch.autograd.no_grad",
    "torch.autograd.grad_mode.no_grad",
}
_LOSS_WORDS = {"loss", "losses", "kl", "kld", "penalty", "objective", "regularizer", "regulariser"}
_NOT_A_TERM = {
    "mask",
    "weight",
    "weights",
    "coef",
    "coeff",
    "scale",
    "beta",
    "fn",
    "type",
    "name",
    "names",
    "config",
    "cfg",
    "key",
    "keys",
    "log",
    "logs",
    "history",
    "metric",
    "metrics",
}
_TO_PYTHON = {"item", "tolist", "float", "int"}


def _is_no_grad_expr(src: SourceFile, expr: ast.AST) -> bool:
    target = expr.func if isinstance(expr, ast.Call) else expr
    name = src.resolve(target)
    if name in _NO_GRAD:
        return True
    if name in ("torch.set_grad_enabled", "torch.autograd.set_grad_enabled") and isinstance(expr, ast.Call):
        arg = expr.args[0] if expr.args else None
        return isinstance(arg, ast.Constant) and arg.value is False
    return False


def _is_loss_name(name: str | None) -> bool:
    if not name:
        return False
    words = set(name.lower().strip("_").split("_"))
    return bool(words & _LOSS_WORDS) and not words & _NOT_A_TERM


def _is_python_number(value: ast.AST) -> bool:
    """`x.item()`, `float(x)`, `x.tolist()`: a logged metric, not a term of the loss."""
    return isinstance(value, ast.Call) and last_name(value.func) in _TO_PYTHON


def _no_grad_regions(src: SourceFile) -> Iterator[tuple[ast.AST, list[ast.stmt]]]:
    """(owner, body) for every `with torch.no_grad():` block and every @torch.no_grad function."""
    for node in ast.walk(src.tree):
        if isinstance(node, (ast.With, ast.AsyncWith)) and any(
            _is_no_grad_expr(src, item.context_expr) for item in node.items
        ):
            yield node, node.body
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
            _is_no_grad_expr(src, d) for d in node.decorator_list
        ):
            yield node, node.body


@check(
    "loss-under-no-grad",
    "no loss term is computed under torch.no_grad() / inference_mode()",
    "A term computed without grad adds its value to the loss but nothing to the gradient: the loss "
    "curve looks right while the term has no effect (a KL penalty that never pulls). It shows from "
    "the second optimizer step on, or at once in gradient dumps (FFDEBUG_FWD_DUMP_GRADS=1).",
)
def check_loss_no_grad(src: SourceFile, config: ReviewConfig) -> Iterator[Finding]:
    """A loss-named assignment, or .backward(), inside a no-grad region; a loss function decorated no-grad."""
    for owner, body in _no_grad_regions(src):
        if isinstance(owner, (ast.FunctionDef, ast.AsyncFunctionDef)) and _is_loss_name(owner.name):
            yield _at(
                "loss-under-no-grad",
                src,
                owner,
                f"{owner.name}() is decorated no-grad: the loss it returns carries no gradient",
            )
            continue
        for stmt in body:
            for node in [stmt, *walk_local(stmt)]:
                if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names = [last_name(t) for t in targets]
                    hit = next((n for n in names if _is_loss_name(n)), None)
                    if hit and not _is_python_number(node.value):
                        yield _at(
                            "loss-under-no-grad",
                            src,
                            node,
                            f"'{hit}' is computed under no_grad: it adds to the loss but not to the gradient",
                        )
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "backward"
                ):
                    yield _at(
                        "loss-under-no-grad", src, node, "backward() under no_grad: there is no graph to run"
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


def _decorator_names(fn: ast.AST) -> set[str]:
    out = set()
    for d in getattr(fn, "decorator_list", []):
        target = d.func if isinstance(d, ast.Call) else d
        out.add(last_name(target) or "")
        name = dotted(target)
        if name:
            out.add(name)
    return out


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
    decorators = _decorator_names(node)
    return (
        src.is_test
        or "overload" in decorators
        or any(d.endswith((".setter", ".deleter")) for d in decorators)
    )


@check(
    "public-api-typed",
    "public functions and methods have type hints on every parameter and the return",
    "Types are the contract callers and reviewers read first; an untyped public boundary lets a "
    "wrong dtype / shape / None through to a place far from the cause.",
)
def check_public_typed(src: SourceFile, config: ReviewConfig) -> Iterator[Finding]:
    """Public module-level functions and public methods of public classes with unannotated parameters or return."""
    for node, cls in _public_api(src):
        if isinstance(node, ast.ClassDef) or _skip_api(src, node):
            continue
        a = node.args
        params = [*a.posonlyargs, *a.args]
        if cls is not None and params and "staticmethod" not in _decorator_names(node):
            params = params[1:]  # self / cls
        params += a.kwonlyargs + [p for p in (a.vararg, a.kwarg) if p is not None]
        missing = [p.arg for p in params if p.annotation is None]
        if node.returns is None:
            missing.append("return")
        if missing:
            what = f"{cls.name}.{node.name}" if cls else node.name
            yield _at(
                "public-api-typed", src, node, f"public {what}() has no type hint for: {', '.join(missing)}"
            )


# ---------------------------------------------------------------------------------------------
# trainer-registered, trainer-contract-match (project scope)


@dataclass
class _ClassInfo:
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


def _class_info(src: SourceFile, cls: ast.ClassDef) -> _ClassInfo:
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
            "abstractmethod" in _decorator_names(f)
            for f in cls.body
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        )
    )
    registered, arguments_class = _registration(src, cls)
    return _ClassInfo(
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


def _describe(value: tuple | str | None) -> str:
    if isinstance(value, tuple):
        return "+".join(str(v) for v in value)
    return str(value)


class _ClassIndex:
    """Every class of the scanned files' packages, with registrations, contracts and bases."""

    def __init__(self, project: Project) -> None:
        self.classes: dict[str, list[_ClassInfo]] = {}
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

    def info(self, name: str) -> _ClassInfo | None:
        found = self.classes.get(name)
        return found[0] if found else None

    def is_trainer(self, info: _ClassInfo, seen: frozenset = frozenset()) -> bool:
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
        self, info: _ClassInfo, seen: frozenset = frozenset()
    ) -> tuple[tuple | str | None, _ClassInfo]:
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

    def registered(self, kind: str) -> dict[str, _ClassInfo]:
        return {
            i.registered[kind]: i for infos in self.classes.values() for i in infos if kind in i.registered
        }


def _documented_in_base(
    index: _ClassIndex, cls: ast.ClassDef, method: str, seen: frozenset = frozenset()
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
        if _documented_in_base(index, parent.node, method, seen | {name}):
            return True
    return False


@check(
    "public-api-docstring",
    "public classes, functions and methods have a docstring",
    "The docstring states the contract (shapes, units, what is cached, who owns what) that the code "
    "alone does not; reviewers check the change against it. A method overriding a documented method "
    "of a base class in the same package inherits that docstring.",
    scope="project",
)
def check_public_docstring(project: Project) -> Iterator[Finding]:
    """Public module-level classes / functions and public methods without a docstring (own or inherited)."""
    index = None
    for src in project.files:
        for node, cls in _public_api(src):
            if _skip_api(src, node) or ast.get_docstring(node) is not None:
                continue
            if cls is not None:
                index = index or _ClassIndex(project)
                if _documented_in_base(index, cls, node.name):
                    continue
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            what = f"{cls.name}.{node.name}()" if cls else node.name + ("" if kind == "class" else "()")
            yield _at("public-api-docstring", src, node, f"public {kind} {what} has no docstring")


@check(
    "trainer-registered",
    "every concrete trainer is registered, with TrainingArguments under the same name",
    "Trainers are derived from the registries, never from a hard-coded list: an unregistered trainer "
    "is unreachable from configs, and a name registered on one side only fails at run time.",
    scope="project",
)
def check_trainer_registered(project: Project) -> Iterator[Finding]:
    """A concrete BaseTrainer subclass without @register_trainer, or a name registered on one side only."""
    model = _ClassIndex(project)
    trainers, arguments = model.registered("trainer"), model.registered("arguments")
    for infos in model.classes.values():
        for info in infos:
            if not project.scanned(info.src):
                continue
            if model.is_trainer(info) and not info.registered.get("trainer") and not info.abstract:
                yield _at(
                    "trainer-registered",
                    info.src,
                    info.node,
                    f"trainer {info.node.name} is not registered: add "
                    "@register_trainer(NAME, arguments=ITS_TRAINING_ARGUMENTS)",
                )
            name = info.registered.get("trainer")
            if name and name not in arguments and info.arguments_class is None:
                yield _at(
                    "trainer-registered",
                    info.src,
                    info.node,
                    f"trainer {name!r} has no TrainingArguments: register them with "
                    f"@register_trainer({name!r}, arguments=...)",
                )
            name = info.registered.get("arguments")
            if name and name not in trainers:
                yield _at(
                    "trainer-registered",
                    info.src,
                    info.node,
                    f"arguments {name!r} ({info.node.name}) have no trainer registered with @register_trainer({name!r})",
                )


@check(
    "trainer-contract-match",
    "a trainer and its TrainingArguments declare the same ExecutionContract",
    "The contract, not the batch contents, decides the execution path; when the two declarations "
    "differ the run is rejected before loading (or, worse, takes the other path where unchecked).",
    scope="project",
)
def check_trainer_contract(project: Project) -> Iterator[Finding]:
    """Registered trainer / arguments pairs whose execution_contract values differ or are missing."""
    model = _ClassIndex(project)
    arguments = model.registered("arguments")
    for name, trainer in model.registered("trainer").items():
        args = arguments.get(name)
        if args is None:
            continue  # trainer-registered reports it
        t_value, t_owner = model.contract(trainer)
        a_value, a_owner = model.contract(args)
        for value, info in ((t_value, trainer), (a_value, args)):
            if value is None and project.scanned(info.src):
                yield _at(
                    "trainer-contract-match",
                    info.src,
                    info.node,
                    f"{info.node.name} ({name!r}) declares no execution_contract",
                )
        if t_value is None or a_value is None or t_value == a_value:
            continue
        for owner in (a_owner, t_owner):
            if project.scanned(owner.src):
                yield _at(
                    "trainer-contract-match",
                    owner.src,
                    owner.contract_node or owner.node,
                    f"{name!r}: trainer {trainer.node.name} declares {_describe(t_value)} but "
                    f"{args.node.name} declares {_describe(a_value)}",
                )
                break


# ---------------------------------------------------------------------------------------------
# license-header


@check(
    "license-header",
    "new source files carry the license header",
    "The project's license header must be on every new file (configure the text with "
    "[tool.ffdebug.review] license-header in pyproject.toml or --license-header).",
)
def check_license_header(src: SourceFile, config: ReviewConfig) -> Iterable[Finding]:
    """The configured header text missing from the first lines of a new (or, by config, any) file."""
    if not config.license_header:
        return []
    if config.license_scope == "new" and not src.is_new:
        return []
    head = "\n".join(src.text.splitlines()[: config.license_lines])
    if config.license_header in head:
        return []
    return [
        Finding(
            "license-header",
            src.path,
            1,
            1,
            f"no license header {config.license_header!r} in the first {config.license_lines} lines",
        )
    ]
