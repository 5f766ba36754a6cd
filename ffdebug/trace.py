"""`ffdebug trace`: a data-flow trace of one training step or one user function (playbook
data-flow-trace).

While the traced function runs, process-wide module hooks (`torch.nn.modules.module.
register_module_forward_pre_hook` / `register_module_forward_hook`) see every forward of every
module, and an explicit capture session sends every `ffdebug.tap(...)` to the tracer, its sink
(capture/sinks.py). No model object is
needed: a module's name is its path below the outermost module that called it (`SD3Transformer2DModel
.transformer_blocks.0.attn`), found from the call stack of modules.

Per module output (and tap) the trace keeps the first call in each context — context = grad mode
(a rollout under no_grad and the training forward are two rows) and the `phase` step tag — with
shape, dtype, mean, std, min, max, NaN / Inf counts (float64, chunked) and requires_grad, and counts
the further calls. Each tap (and returned tensor) is matched to the module output it is: the same
storage, else bit-equal values (trace_sources.py: holds outputs within a memory budget). Every
tensor whose name contains "mask" (a tap, a forward keyword argument, a key
of the returned dict) gets a loss-mask summary: positions counted, first counted position per row.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import importlib.util
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ffdebug._entry import resolve_entry
from ffdebug.capture import state as _state
from ffdebug.capture.session import Session, explicit_config
from ffdebug.errors import FFDebugError
from ffdebug.trace_sources import DEFAULT_BUDGET_MIB, OutputIndex, Source

if TYPE_CHECKING:
    import torch

MAX_MASK_ROWS = 8
_FROM_TAGS = object()  # Tracer.record's phase: the step tags' one


@dataclass
class TraceRow:
    """One traced tensor: a module output, a tap, a returned value or a parameter."""

    name: str
    kind: str  # "module" | "tap" | "return" | "param"
    module_class: str | None
    shape: list[int]
    dtype: str
    requires_grad: bool
    grad_enabled: bool
    phase: str | None
    stats: dict
    calls: int = 1
    order: int = 0
    source: Source | None = None  # taps and returned tensors: the module output they are

    def to_json(self) -> dict:
        """Stable keys: name, kind, module_class, shape, dtype, requires_grad, grad_enabled, phase,
        calls, mean, std, min, max, nan, inf, source (taps and returns: `Source.to_json`, else
        null)."""
        s = self.stats
        return {
            "name": self.name,
            "kind": self.kind,
            "module_class": self.module_class,
            "shape": self.shape,
            "dtype": self.dtype,
            "requires_grad": self.requires_grad,
            "grad_enabled": self.grad_enabled,
            "phase": self.phase,
            "calls": self.calls,
            **{k: s.get(k) for k in ("mean", "std", "min", "max", "nan", "inf")},
            "source": None if self.source is None else self.source.to_json(),
        }


@dataclass
class MaskSummary:
    """Which positions a mask keeps: count, and the first kept position of each row."""

    name: str
    shape: list[int]
    total: int
    unmasked: int
    first_unmasked: int | None
    row_first: list[int | None]
    rows: int
    additive: bool

    def to_json(self) -> dict:
        """Stable keys: name, shape, total, unmasked, first_unmasked, row_first, rows, additive."""
        return dict(self.__dict__)

    def describe(self) -> str:
        """One line: `name [1, 536]: 510/536 counted, first at 26`."""
        first = "none counted" if self.first_unmasked is None else f"first at position {self.first_unmasked}"
        rows = ""
        if self.rows > 1:
            shown = ", ".join("-" if r is None else str(r) for r in self.row_first)
            rows = f"; first per row: {shown}{', ...' if self.rows > len(self.row_first) else ''}"
        kind = " (additive mask: 0 = kept)" if self.additive else ""
        return (
            f"{self.name} {self.shape}: {self.unmasked}/{self.total} positions counted, {first}{rows}{kind}"
        )


@dataclass
class TraceResult:
    """What `ffdebug trace` prints."""

    entry: str
    rows: list[TraceRow] = field(default_factory=list)
    masks: list[MaskSummary] = field(default_factory=list)
    params: list[TraceRow] = field(default_factory=list)
    error: str | None = None
    elapsed_s: float = 0.0
    match_budget_mib: float = DEFAULT_BUDGET_MIB
    held_peak_mib: float = 0.0

    def to_json(self) -> dict:
        """Stable keys: entry, rows, masks, params, error, elapsed_s, match_budget_mib (the identity
        match's memory budget), held_peak_mib (the most output storage it held)."""
        return {
            "entry": self.entry,
            "match_budget_mib": self.match_budget_mib,
            "held_peak_mib": round(self.held_peak_mib, 3),
            "rows": [r.to_json() for r in self.rows],
            "masks": [m.to_json() for m in self.masks],
            "params": [p.to_json() for p in self.params],
            "error": self.error,
            "elapsed_s": round(self.elapsed_s, 3),
        }


def mask_summary(name: str, mask: torch.Tensor) -> MaskSummary:
    """Summarise a loss / attention mask: nonzero (or, for additive float masks, zero) entries count."""
    import torch

    m = mask.detach()
    additive = bool(m.is_floating_point() and m.numel() and float(m.min()) < 0)
    kept = (m == 0) if additive else (m != 0)
    rows = kept.reshape(1, -1) if kept.dim() <= 1 else kept.reshape(-1, kept.shape[-1])
    row_first: list[int | None] = []
    for r in rows[:MAX_MASK_ROWS]:
        idx = torch.nonzero(r, as_tuple=False)
        row_first.append(int(idx[0, 0]) if idx.numel() else None)
    return MaskSummary(
        name=name,
        shape=list(m.shape),
        total=int(m.numel()),
        unmasked=int(kept.sum()),
        first_unmasked=row_first[0] if row_first else None,
        row_first=row_first,
        rows=int(rows.shape[0]),
        additive=additive,
    )


def _tensor_leaves(obj, prefix: str = "", brackets: bool = False):
    """(name, tensor) for a tensor, or the tensors directly inside a tuple / list / dict / ModelOutput.

    Module outputs use brackets (`blocks.0[1]`, `model[sample]`) so an output index never reads as a
    submodule path; returned dicts use dots (`return.loss`).
    """
    import torch

    def join(key) -> str:
        return f"{prefix}[{key}]" if brackets else f"{prefix}.{key}"

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, torch.Tensor):
                yield join(k), v
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            if isinstance(v, torch.Tensor):
                yield join(i), v


class Tracer:
    """Collects rows while installed; `with Tracer(...) as t:` installs the global hooks.

    The sink of the trace's capture session (capture/sinks.py): free taps arrive through `write`;
    module stages of `ffdebug.install` hooks are not sent, the global hooks see every module."""

    takes_module_stages = False

    def __init__(
        self,
        modules: tuple[str, ...] = (),
        depth: int | None = None,
        all_calls: bool = False,
        match_budget_mib: float = DEFAULT_BUDGET_MIB,
    ) -> None:
        self.outputs = OutputIndex(int(match_budget_mib * 2**20))
        self.held_peak = 0
        self.modules = modules
        self.depth = depth
        self.all_calls = all_calls
        self.rows: dict[tuple, TraceRow] = {}
        self.masks: dict[str, MaskSummary] = {}
        self.roots: dict[str, object] = {}
        self._names: dict[int, str] = {}
        self._relative: dict[int, dict[int, str]] = {}
        self._stack: list[object] = []
        self._handles: list = []
        self._order = 0
        self._first_seen: dict[str, int] = {}

    # -- naming ---------------------------------------------------------------------------------
    def _name_of(self, module) -> str:
        known = self._names.get(id(module))
        if known is not None:
            return known
        name = None
        for parent in reversed(self._stack):
            rel = self._relative.get(id(parent))
            if rel is None:
                rel = {id(m): n for n, m in parent.named_modules() if n}
                self._relative[id(parent)] = rel
            if id(module) in rel:
                name = f"{self._names[id(parent)]}.{rel[id(module)]}"
                break
        if name is None:  # a root: the outermost module called
            base = type(module).__name__
            name, n = base, 1
            while name in self.roots:
                n += 1
                name = f"{base}#{n}"
            self.roots[name] = module
        self._names[id(module)] = name
        return name

    def _wanted(self, name: str) -> bool:
        if self.depth is not None and name.count(".") > self.depth:
            return False
        return not self.modules or any(fnmatch.fnmatchcase(name, g) for g in self.modules)

    # -- recording ------------------------------------------------------------------------------
    def record(
        self,
        name: str,
        kind: str,
        tensor: torch.Tensor,
        module_class: str | None = None,
        phase: object = _FROM_TAGS,
    ) -> None:
        """Add (or count) one tensor under `name` in the current grad mode and `phase` (by default
        the step tags' one)."""
        import torch

        from ffdebug.store.schema import tensor_stats

        grad = torch.is_grad_enabled()
        if phase is _FROM_TAGS:
            phase = _state.current_tags().get("phase")
        key = (name, grad, phase) if not self.all_calls else (name, grad, phase, self._order)
        row = self.rows.get(key)
        if row is not None:
            row.calls += 1
            return
        self._order += 1
        order = self._first_seen.get(name.split("[")[0], self._order) if kind == "module" else self._order
        stats = tensor_stats(tensor) if not tensor.is_complex() else {}
        self.rows[key] = TraceRow(
            name=name,
            kind=kind,
            module_class=module_class,
            shape=list(tensor.shape),
            dtype=str(tensor.dtype).replace("torch.", ""),
            requires_grad=bool(tensor.requires_grad),
            grad_enabled=grad,
            phase=None if phase is None else str(phase),
            stats=stats,
            order=order,
            source=self.outputs.match(tensor) if kind in ("tap", "return") else None,
        )
        if "mask" in name.lower():
            self.mask(name, tensor)

    # -- the capture sink ------------------------------------------------------------------------
    def write(
        self, key: str, tensor: object, meta: dict, always_payload: bool = False, payload_of: object = None
    ) -> None:
        """A free tap from the trace session: one row, in the phase the session resolved."""
        import torch

        if isinstance(tensor, torch.Tensor):
            self.record(key, "tap", tensor, phase=meta.get("phase"))

    def update_run_info(self, **fields: object) -> None:
        """A trace has no run.json."""

    def count_skip(self, reason: str) -> None:
        """Nothing is skipped from a trace's rows but graph captures, which have no tensors to read."""

    def close(self) -> None:
        """The rows stay readable after the session closes."""

    def mask(self, name: str, tensor: torch.Tensor) -> None:
        """Keep a mask summary for `name` (first occurrence)."""
        if name not in self.masks and tensor.numel():
            self.masks[name] = mask_summary(name, tensor)

    def _pre(self, module, args) -> None:
        name = self._name_of(module)
        if name not in self._first_seen:  # rows are listed in call order, parents before children
            self._order += 1
            self._first_seen[name] = self._order
        self._stack.append(module)

    def _post(self, module, args, kwargs, output) -> None:
        if self._stack and self._stack[-1] is module:
            self._stack.pop()
        elif module in self._stack:
            self._stack.remove(module)
        name = self._names.get(id(module)) or self._name_of(module)
        if output is not None:  # every output is a candidate source of a tap, wanted or not
            for leaf, t in _tensor_leaves(output, name, brackets=True):
                self.outputs.add(leaf, t)
            self.held_peak = max(self.held_peak, self.outputs.held_bytes)
        if not self._wanted(name):
            return
        import torch

        for key, value in (kwargs or {}).items():
            if "mask" in key.lower() and isinstance(value, torch.Tensor):
                self.mask(f"{name}({key}=)", value)
        if output is None:
            return
        for leaf, t in _tensor_leaves(output, name, brackets=True):
            self.record(leaf, "module", t, type(module).__name__)

    def __enter__(self) -> Tracer:
        from torch.nn.modules import module as nn_module

        self._handles.append(nn_module.register_module_forward_pre_hook(self._pre))
        self._handles.append(
            nn_module.register_module_forward_hook(self._post, with_kwargs=True, always_call=True)
        )
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


@contextlib.contextmanager
def _argv(argv: list[str] | None):
    if argv is None:
        yield
        return
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


def trace(
    entry: str,
    args: list[str] | None = None,
    modules: tuple[str, ...] = (),
    depth: int | None = None,
    all_calls: bool = False,
    params: bool = False,
    match_budget_mib: float = DEFAULT_BUDGET_MIB,
) -> TraceResult:
    """Run `entry` (a callable spec) under the tracer; `args` become sys.argv[1:] during the call.

    The function is called without arguments. A dict (or tensor) it returns is traced as
    `return.<key>`. An exception inside it ends the trace and is reported in `error`. Taps and
    returned tensors are matched to module outputs held within `match_budget_mib` (0: no match).
    """
    import torch

    if not math.isfinite(match_budget_mib) or match_budget_mib < 0:
        raise FFDebugError(
            f"--match-memory {match_budget_mib} is invalid: give MiB >= 0 (0 turns the match off)"
        )
    fn = resolve_entry(entry)
    result = TraceResult(entry=entry, match_budget_mib=match_budget_mib)
    tracer = Tracer(modules, depth, all_calls, match_budget_mib)
    traced_session = Session(explicit_config("<trace>", "trace", mode="stats"), sink=tracer)
    start = time.perf_counter()
    returned = None
    _state.push_explicit(traced_session)
    try:
        # the traced code's prints go to stderr: stdout carries the trace (and its JSON)
        with tracer, _argv([entry, *args] if args else None), contextlib.redirect_stdout(sys.stderr):
            try:
                returned = fn()
            except SystemExit as exc:  # console-script entry points end with sys.exit
                if exc.code not in (0, None):
                    result.error = f"{entry} exited with status {exc.code}"
            except Exception as exc:  # noqa: BLE001 - reported with the partial trace, not swallowed
                result.error = f"{type(exc).__name__}: {exc}"
    finally:
        _state.pop_explicit(traced_session)
    for suffix, t in _tensor_leaves(returned, "return"):
        tracer.record(suffix, "return", t)
    result.elapsed_s = time.perf_counter() - start
    result.held_peak_mib = tracer.held_peak / 2**20
    tracer.outputs = OutputIndex(0)  # the held outputs go with the trace's end
    result.rows = sorted(tracer.rows.values(), key=lambda r: r.order)
    result.masks = list(tracer.masks.values())
    if params:
        from ffdebug.store.schema import tensor_stats

        for root_name, root in tracer.roots.items():
            for pname, p in root.named_parameters():
                result.params.append(
                    TraceRow(
                        name=f"{root_name}.{pname}",
                        kind="param",
                        module_class=type(root).__name__,
                        shape=list(p.shape),
                        dtype=str(p.dtype).replace("torch.", ""),
                        requires_grad=bool(p.requires_grad),
                        grad_enabled=torch.is_grad_enabled(),
                        phase=None,
                        stats=tensor_stats(p.detach()),
                    )
                )
    return result


def train_entry(config: str, steps: int, output_dir: str) -> tuple[str, list[str]]:
    """(entry, argv) that run `reference-trainer train CONFIG --max-steps N --output-dir DIR` in-process."""
    if not os.path.isfile(config):
        raise FFDebugError(f"{config}: no such config file")
    if importlib.util.find_spec("reference_trainer.cli") is None:
        raise FFDebugError("--train needs the reference trainer (reference_trainer.cli is not importable)")
    return "reference_trainer.cli:main", [
        "train",
        config,
        "--max-steps",
        str(steps),
        "--output-dir",
        output_dir,
    ]
