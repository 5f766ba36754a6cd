"""The automated review checks: a registry of small functions under stable ids.

A file check is `fn(src: SourceFile, config: ReviewConfig) -> Iterable[Finding]`; a project check
(`scope="project"`) is `fn(project: Project) -> Iterable[Finding]` and sees every scanned file at
once (the trainer-registry check pairs a trainer in one file with its arguments in another). A
tool-backed check (`tool="ruff"` / `"bandit"` with the rule `codes` it maps) is
`fn(project: Project, hits: list[ToolHit]) -> Iterable[Finding]`: the tool finds, the check names
the place and the why in review's terms (`review/tools.py` runs the tools).

The checks live by topic: this module holds the registry and the component, data-order and
license checks; `lint_checks.py` the generic ones backed by ruff and bandit (silent excepts,
`torch.load`, public API hints and docstrings); `numeric_checks.py` fp32 cosine and loss terms
under no-grad; `trainer_checks.py` the trainer registry and contracts. Playbook items name these ids
in their `check:` field; `tests/review/` asserts every named id exists and that every check has a
fixture that breaks it.

Ids are stable (playbooks and suppression comments refer to them): add new ones, never rename.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ffdebug.review.source import SourceFile, dotted, has_star_kwargs, keyword, last_name

if TYPE_CHECKING:
    from ffdebug.review.runner import ReviewConfig


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
    """A registered check: id, one-line title, why it matters, the function that runs it, and
    for a tool-backed check the tool and the rule codes it maps."""

    id: str
    title: str
    why: str
    scope: str
    fn: Callable = field(repr=False)
    tool: str | None = None
    codes: tuple[str, ...] = ()


CHECKS: dict[str, Check] = {}


def check(
    check_id: str,
    title: str,
    why: str,
    scope: str = "file",
    tool: str | None = None,
    codes: tuple[str, ...] = (),
) -> Callable[[Callable], Callable]:
    """Register `fn` as the check `check_id` (`scope` "file" or "project"; `tool` with its `codes`)."""

    def decorator(fn: Callable) -> Callable:
        if check_id in CHECKS:
            raise ValueError(f"review check {check_id!r} is registered twice")
        if (tool is None) != (not codes):
            raise ValueError(f"review check {check_id!r}: a tool-backed check names its tool and codes")
        CHECKS[check_id] = Check(check_id, title, why, "project" if tool else scope, fn, tool, codes)
        return fn

    return decorator


def at(check_id: str, src: SourceFile, node: ast.AST, message: str) -> Finding:
    """The finding of `check_id` at `node` (its first line, 1-based column)."""
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
            yield at(
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
            yield at(
                "dataset-distributed-sampler",
                src,
                call,
                "DataLoader without a sampler: pass sampler=DistributedSampler(...) (even at one rank)",
            )
        elif isinstance(sampler, ast.Call) and src.resolve(sampler.func) not in _DIST_SAMPLER:
            yield at(
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
            yield at(
                "dataset-set-epoch",
                src,
                call,
                f"DistributedSampler created but {where} never calls sampler.set_epoch(data_epoch)",
            )


# The checks of the other topics register themselves on import, in this order (after the registry
# above exists, before the license check, which the listing shows last).
from ffdebug.review import lint_checks, numeric_checks, trainer_checks  # noqa: E402, F401

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
