"""Numerical review checks: cosine measured in fp32, and loss terms computed without a graph."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ffdebug.review.checks import Finding, at, check
from ffdebug.review.source import SourceFile, last_name, walk_local

if TYPE_CHECKING:
    from ffdebug.review.runner import ReviewConfig


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
            yield at(
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
            yield at(
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
            yield at(
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
                        yield at(
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
                    yield at(
                        "loss-under-no-grad", src, node, "backward() under no_grad: there is no graph to run"
                    )
