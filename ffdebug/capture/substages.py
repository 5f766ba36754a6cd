"""Record what a block's branch does while it runs, and write its role sub-stages (docs/dumping.md "Role sub-stages").

Installed (when sub-stages are on: `FFDEBUG_FWD_DUMP_SUBSTAGES=1`, `capture(substages=True)`, or
sub-stage classes in `FFDEBUG_FWD_DUMP_BLOCK_CLASS`) on each direct child of a block that holds
parameters and is not a norm. While the child runs, a `TorchFunctionMode` sees every projection
(`F.linear`, which `nn.Linear` calls, `addmm`, which `Conv1D` calls, and `torch._grouped_mm` or a
`bmm` over a stacked `[E, ...]` weight, which stacked experts call: one projection per expert),
`topk`, activation and head reshape; `ffdebug.models.subroles` turns that trace into role sub-stages once the child's role
(attention or MLP) is known. Each sub-stage is written at the point of the call that produced it,
so records keep execution order (q before the rotary taps, the context before the output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ffdebug.capture.branch_calls import Output, activations, casts, grouped_mms, splits, views
from ffdebug.logs import get_logger
from ffdebug.models.pieces import untaken_piece
from ffdebug.models.subroles import (
    BranchTrace,
    Dims,
    LinearCall,
    SubStage,
    branch_substages,
    leading_shape,
    with_inputs,
)

_WARNED: set[tuple[str, str]] = set()  # (block class, child) warned about once per process


def _expert_structure(module, path: str):
    """Expert weights inside a branch: {id(param): (owner path, expert)} for the members of an
    expert list (a ModuleList of two or more modules of one class and one set of parameter shapes,
    each with more than one weight: small MLPs, not single projections), the stacked `[E, ...]` 3-D
    parameters as (param, owner path), and the expert count they imply."""
    import torch.nn as nn

    def signature(m) -> tuple:
        return tuple(tuple(p.shape) for p in m.parameters())

    members: dict[int, tuple[str, int]] = {}
    count = None
    for rel, sub in module.named_modules():
        if not isinstance(sub, nn.ModuleList) or len(sub) < 2 or len({type(m) for m in sub}) != 1:
            continue
        if len({signature(m) for m in sub}) == 1 and len(signature(sub[0])) > 1:
            count = max(count or 0, len(sub))
            for e, member in enumerate(sub):
                for prel, owner in member.named_modules():
                    owner_path = ".".join(p for p in (path, rel, str(e), prel) if p)
                    for p in owner.parameters(recurse=False):
                        members[id(p)] = (owner_path, e)
    stacked = []
    for rel, owner in module.named_modules():
        for p in owner.parameters(recurse=False):
            if p.dim() == 3:
                stacked.append((p, ".".join(x for x in (path, rel) if x)))
    sizes = {p.shape[0] for p, _ in stacked}
    if len(sizes) == 1:
        count = count or sizes.pop()
    return members, stacked, count


def _row_keys(rows, weights):
    """An exact integer key per row: its elements' bits times fixed random weights, summed in int64
    (integer sums do not depend on the reduction order)."""
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[rows.element_size()]
    return (rows.contiguous().view(ints).long() * weights).sum(-1)


@dataclass
class RoleTensors:
    """Per block: the module tensors role sub-stages hold, so sub-stage classes (module-path dumps,
    docs/dumping.md "Role sub-stages") do not write them again — one stage per tensor."""

    module_paths: set[str]  # modules a sub-stage class dumps by module path
    held: dict[str, set[tuple[str, int]]] = field(default_factory=dict)  # path -> {(io, data_ptr)}

    def holds(self, path: str, io: str, ptr: int | None) -> bool:
        """Whether the tensor at `ptr` (of this call) that module `path` read (`in`) or returned
        (`out`) is already a role sub-stage."""
        return ptr is not None and (io, ptr) in self.held.get(path, ())

    def note(self, trace: BranchTrace, stages: list[SubStage]) -> None:
        for c in trace.calls:  # this call's pointers replace the previous call's
            self.held[c.path] = set()
        for s in stages:
            if s.source is not None:
                self.held[s.source.path] |= {("out", s.source.y_ptr), ("in", s.source.x_id[0])}


class BranchRecorder:
    """Hooks of one block child: trace its call, then write the role sub-stages of that trace."""

    def __init__(
        self, session, capture, name: str, module, path: str, prefix: str, base: dict, roles, dims, written
    ):
        self.session, self.capture, self.name, self.module = session, capture, name, module
        self.written = written  # RoleTensors of the block
        self.path, self.prefix, self.base, self.roles = path, prefix, base, roles
        self.classes = {
            f"{path}.{rel}" if rel else path: type(m).__name__ for rel, m in module.named_modules()
        }
        self.owners: dict[int, str] = {}
        for rel, m in module.named_modules():
            for p in m.parameters(recurse=False):
                self.owners[id(p)] = f"{path}.{rel}" if rel else path
        self.members, self.stacked, experts = _expert_structure(module, path)
        self.dims = Dims.of_config(dims, experts) if not isinstance(dims, Dims) else dims
        self.trace: BranchTrace | None = None
        self.mode = None
        self._fingerprint = None

    def install(self, handle) -> None:
        # plain functions, not bound methods: a deep copy of the model shares them (capture/copies.py)
        handle.add(self.module.register_forward_pre_hook(lambda *a: self.pre(*a), with_kwargs=True))
        handle.add(
            self.module.register_forward_hook(lambda *a: self.post(*a), with_kwargs=True, always_call=True)
        )

    @property
    def _branch_name(self) -> str:
        """How run.json names this branch: `<block class>.<child>`."""
        return f"{self.roles.block.class_name}.{self.name}"

    # -- hooks -------------------------------------------------------------------------------
    def _selected(self) -> bool:
        s = self.session
        if not s.enabled_rank or s.closed or (s.call_depth > 0 and not s.call_selected):
            return False
        return s.config.layers.contains(self.base["layer"], s.num_layers)

    def pre(self, module, args, kwargs) -> None:
        import torch
        from torch.overrides import TorchFunctionMode

        from ffdebug.capture.outputs import first_tensor

        x = first_tensor(args, kwargs)
        if x is None or not x.is_floating_point() or not self._selected():
            return
        self.trace = BranchTrace(lead=tuple(x.shape[:-1]), hidden=x.shape[-1])
        self._inputs = {(x.data_ptr(), x.numel())}  # the branch input and its dtype casts
        self._input_casts: list = []  # those casts, kept alive: a freed one's address is reused
        self._cast_weights: dict[int, tuple] = {}  # id -> (a dtype cast of a weight, its owner)
        self._input_copy = x.detach().clone()  # the `.in` of the projections reading the branch input
        self._outputs: dict[int, Output] = {}  # storage -> projection output (fused ones are split)
        self._input_ids: dict[tuple, tuple] = {}  # (ptr, shape, stride) -> (storage weakref, x_id)
        self._rows = None
        if self.members or self.stacked:
            self._rows = self._row_index(x.detach().reshape(-1, x.shape[-1]))
        self._stacked_ptrs = {p.untyped_storage().data_ptr(): (p, o) for p, o in self.stacked}
        recorder = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                with torch._C.DisableTorchFunction():  # no mode sees the recorder's own ops
                    recorder.observe(func, args, kwargs or {}, out)
                return out

        self.session.begin_hold()
        self.mode = _Mode()
        self.mode.__enter__()

    def post(self, module, args, kwargs, output) -> None:
        if self.mode is None:
            return
        mode, self.mode = self.mode, None
        mode.__exit__(None, None, None)
        self._outputs, self._input_copy, self._cast_weights, self._input_casts = {}, None, {}, []
        self._input_ids = {}
        for replay in self.session.end_hold():
            replay()

    # -- the trace -----------------------------------------------------------------------------
    def observe(self, func, args, kwargs, out) -> None:
        import torch
        import torch.nn.functional as F

        trace = self.trace
        if args and func in splits() and isinstance(args[0], torch.Tensor):
            self._pieces(args[0], out)
        if (
            func in casts()
            and args
            and isinstance(args[0], torch.Tensor)
            and isinstance(out, torch.Tensor)
            and out.shape == args[0].shape
            and (args[0].data_ptr(), args[0].numel()) in self._inputs
        ):
            self._inputs.add((out.data_ptr(), out.numel()))
            self._input_casts.append(out)  # else a later tensor at its address reads as the input
        if func in casts() and args and isinstance(out, torch.Tensor) and id(args[0]) in self.owners:
            self._cast_weights[id(out)] = (out, self.owners[id(args[0])])  # kept alive: ids stay unique
        if func is F.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
            self._linear(x, w, out, w.shape[-1], w.shape[0])
        elif func is torch.addmm and len(args) >= 3 and args[2].dim() == 2:
            self._linear(args[1], args[2], out, args[2].shape[0], args[2].shape[1])
        elif func in grouped_mms():
            self._grouped(args, kwargs, out)
        elif func in (torch.bmm, torch.matmul) and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            self._batched(args[0], args[1], out)
        elif func in (torch.topk, torch.Tensor.topk):
            if not any(c.expert is not None for c in trace.calls):  # the last before the experts:
                if trace.topk is not None and trace.topk[3] is not None:  # an earlier level
                    trace.group_topk = trace.topk[3], trace.topk[2]
                scores = args[0].detach().clone() if args[0].dim() == 2 else None
                trace.topk = (trace.events, out[0].detach().clone(), out[1].detach().clone(), scores)
                trace.weights = None  # grouped routing takes a group-level top-k first
        elif func in (F.conv1d, torch.conv1d) and args and isinstance(args[0], torch.Tensor):
            trace.sequence_mixer = True  # a convolution over the sequence (Mamba, gated delta nets)
        elif func in activations():
            if isinstance(args[0], torch.Tensor):
                trace.act_ptrs.append((trace.events, args[0].data_ptr()))
        elif func in views() and isinstance(out, torch.Tensor) and isinstance(args[0], torch.Tensor):
            self._head_shape(args[0], out)
        if (
            trace.topk is not None
            and not any(c.expert is not None for c in trace.calls)
            and isinstance(out, torch.Tensor)
            and out.is_floating_point()
            and out.shape == trace.topk[2].shape
        ):
            trace.weights = (trace.events, out.detach().clone())

    def _head_shape(self, x, out) -> None:
        shapes = self.trace.head_shapes
        if len(shapes) >= 4 or out.dim() < 3 or x.dim() < 2 or out.numel() != x.numel():
            return
        n, d = out.shape[-2], out.shape[-1]
        if n > 1 and d > 1 and n * d == x.shape[-1] and tuple(out.shape[:-2]) == tuple(x.shape[:-1]):
            shapes.append((n, d))

    def _owner(self, w) -> tuple[str, int | None]:
        """The weight's owner path and its expert index (None for a plain projection)."""
        if id(w) in self.members:
            return self.members[id(w)]
        if id(w) in self.owners:
            return self.owners[id(w)], None
        if id(w) in self._cast_weights:
            return self._cast_weights[id(w)][1], None
        hit = self._stacked_ptrs.get(w.untyped_storage().data_ptr()) if w.dim() == 2 else None
        if hit is not None:
            p, owner = hit
            if tuple(w.shape) == tuple(p.shape[1:]):
                return owner, (w.storage_offset() - p.storage_offset()) // p.stride(0)
        return self.path, None

    def _grouped(self, args, kwargs, out) -> None:
        """A grouped matmul over stacked expert weights (`out[rows of e] = x[rows of e] @ w[e]`,
        `w` `[E, K, N]`, the rows of expert e ending at `offs[e]`): one projection per expert that
        got rows, with that expert's index, as a loop over `F.linear(x, W[e])` would record."""
        import torch

        x = args[0] if args else kwargs.get("mat_a", kwargs.get("input"))
        w = args[1] if len(args) > 1 else kwargs.get("mat_b", kwargs.get("weight"))
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        if not all(isinstance(t, torch.Tensor) for t in (x, w, offs, out)) or x.dim() != 2 or w.dim() != 3:
            return
        hit = self._stacked_ptrs.get(w.untyped_storage().data_ptr())
        owner = hit[1] if hit is not None else self.path
        start = 0
        for e, end in enumerate(offs.tolist()):
            if end > start:
                rows = slice(start, end)
                self._linear(x[rows], w[e], out[rows], w.shape[-2], w.shape[-1], (owner, e))
            start = max(start, end)

    def _batched(self, x, w, out) -> None:
        """A batched matmul over stacked expert weights (`out[e] = x[e] @ w[e]`, `w` `[E, K, N]`, a
        stacked parameter or a view of one; Llama 4 runs every expert on every token so): one
        projection per expert."""
        import torch

        if not isinstance(x, torch.Tensor) or x.dim() != 3 or w.dim() != 3 or x.shape[0] != w.shape[0]:
            return
        hit = self._stacked_ptrs.get(w.untyped_storage().data_ptr())
        if hit is None or hit[0].shape[0] != w.shape[0]:
            return
        for e in range(w.shape[0]):
            self._linear(x[e], w[e], out[e], w.shape[-2], w.shape[-1], (hit[1], e))

    def _linear(self, x, w, out, fan_in: int, fan_out: int, placed: tuple | None = None) -> None:
        trace = self.trace
        owner, expert = placed if placed is not None else self._owner(w)
        from_input = (x.data_ptr(), x.numel()) in self._inputs
        x_id = self._input_id(x)
        index = trace.events
        trace.events += 1
        call = LinearCall(
            index=index,
            path=owner,
            expert=expert,
            from_input=from_input,
            in_features=fan_in,
            out_features=fan_out,
            x=self._input_copy if from_input else x.detach().clone(),
            y=out.detach().clone(),
            y_ptr=out.data_ptr(),
            elem=out.element_size(),
            tokens=self._tokens(x) if expert is not None else None,
            x_id=x_id,
        )
        trace.calls.append(call)
        if expert is None:
            self._outputs[out.untyped_storage().data_ptr()] = Output(call, out)
        self.session.hold(lambda t=trace, i=index: self.emit(t, i))

    def _input_id(self, x) -> tuple:
        """(data_ptr, shape, stride, first reader) of a projection's live input: equal for projections
        that read one tensor. The first reader's index tells apart tensors that held one address in
        turn: a branch that makes each projection's input itself and drops it after (RWKV's
        time-mixed k / v / r) hands a freed input's address to the next one, or not, as the
        allocator's state has it."""
        import weakref

        key = (x.data_ptr(), tuple(x.shape), tuple(x.stride()))
        storage = x.untyped_storage()  # one Python object per storage while any view of it lives
        seen = self._input_ids.get(key)
        if seen is None or seen[0]() is not storage:
            seen = (weakref.ref(storage), (*key, self.trace.events))  # the first reader's index
            self._input_ids[key] = seen
        return seen[1]

    def _pieces(self, source, out) -> None:
        """Views a split / chunk / unbind / slice took of a projection's output: its pieces, in the
        order taken, until they cover every column (later views of them, e.g. a partial rotary
        slice of q, are not pieces, except a split of one piece into column runs that tile it:
        `Output.refine`, also before the last piece is taken)."""
        import torch

        target = self._outputs.get(source.untyped_storage().data_ptr())
        if target is None:
            return
        # a split of one piece into runs that tile it refines it, covered or not yet (an engine's
        # fused `q | kv_a | g`: kv_a's split comes before g's slice is taken)
        if isinstance(out, (tuple, list)) and target.refine([v for v in out if isinstance(v, torch.Tensor)]):
            return
        if bool(target.taken.all()):  # covered: only a refinement (above) changes the pieces
            return
        for view in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(view, torch.Tensor) and view.untyped_storage().data_ptr() == target.storage:
                piece = target.piece(view)
                if piece is not None:
                    target.call.pieces.append(piece)

    # -- expert rows -> tokens -------------------------------------------------------------------
    def _row_index(self, rows):
        """The branch input's rows keyed by their bits (an expert's rows are exact copies of them)."""
        import torch

        g = torch.Generator().manual_seed(0)
        self._fingerprint = torch.randint(1, 2**31, (rows.shape[-1],), generator=g, dtype=torch.int64)
        keys = _row_keys(rows, self._fingerprint)
        keys, order = keys.sort()
        return rows.clone(), keys, order

    def _tokens(self, x):
        """Token index in the branch input of each row of `x` (an expert's gathered rows), or None."""
        import torch

        if self._rows is None or x.shape[-1] != self._rows[0].shape[-1] or x.dtype != self._rows[0].dtype:
            return None
        rows, keys, order = self._rows
        flat = x.detach().reshape(-1, x.shape[-1])
        pos = torch.searchsorted(keys, _row_keys(flat, self._fingerprint)).clamp(max=len(keys) - 1)
        tokens = order[pos]
        return tokens if torch.equal(rows[tokens], flat) else None

    # -- writing ---------------------------------------------------------------------------------
    def emit(self, trace: BranchTrace, index: int) -> None:
        """Write the sub-stages produced at event `index` (called in execution order, after the
        block's roles are known)."""
        if trace.stages is None:
            stage = (self.roles.names or {}).get(self.name, "")
            stages = with_inputs(branch_substages(trace, stage, self.dims), trace)
            self.written.note(trace, stages)
            if trace.form is not None:
                self.session.note_form(self._branch_name, trace.form)
            own = f"{self.roles.block.path}.{self.name}"  # a child that is one projection (fc1 / fc2):
            unmatched = [  # its output is the child's own stage (ChildRoles), written once
                s
                for s in with_inputs(self._unmatched(trace, stages), trace, group=False)
                if not (s.io == "out" and s.module_path == own)
            ]
            trace.stages = stages + unmatched
        inv = self.session.invocations.get(self.roles.block.path, 1) - 1
        for s in trace.stages:
            if s.at != index:
                continue
            meta = dict(self.base, module_class=self.classes.get(s.module_path), module_path=s.module_path)
            extra = dict(s.extra)
            if "inputs" in extra:
                extra["inputs"] = [f"{self.prefix}.{k}" for k in extra["inputs"]]
            key = f"{self.prefix}.{s.kind}.{s.io}"
            self.capture(key, s.tensor, invocation=inv, extra=extra, io=s.io, **meta)

    def _unmatched(self, trace: BranchTrace, stages: list[SubStage]) -> list[SubStage]:
        """Projections no role rule took (outside the experts): kept under their module path
        relative to the block, warned about once per block class and listed in run.json. When a
        sub-stage class dumps the projection's owner module, that module's own in / out are its
        keys (the owner may do more than the projection, e.g. a router returning its top-k)."""
        if trace.whole is not None:  # no sub-stage by role and none by module path: said once
            self.session.note_whole(self._branch_name, trace.whole)
            return []
        taken = {s.at for s in stages} | {i for s in stages for i in s.covers}
        experts_placed = any(s.kind.startswith("moe.expert") for s in stages)
        left = [c for c in trace.calls if (c.expert is None or not experts_placed) and c.index not in taken]
        block = self.roles.block
        out = []

        def rel_of(c) -> str:
            return c.path[len(block.path) + 1 :] if c.path.startswith(f"{block.path}.") else c.path

        for c in left:
            out.append(
                SubStage(
                    rel_of(c), leading_shape(c.y, trace), c.index, c.path, {"orig_shape": list(c.y.shape)}, c
                )
            )
        for c in trace.calls:
            if c.index in taken and c.expert is None and (rest := untaken_piece(c, stages)) is not None:
                piece, fields = rest  # a fused projection's columns no role took (a gate fused with q / kv)
                extra = {"orig_shape": list(c.y.shape), **fields}
                out.append(SubStage(rel_of(c), leading_shape(piece, trace), c.index, c.path, extra, c))
        out.sort(key=lambda s: s.at)
        if out:
            names = tuple(dict.fromkeys(s.kind for s in out))
            self.session.note_unplaced(self._branch_name, names)
            if (block.class_name, self.name) not in _WARNED:
                _WARNED.add((block.class_name, self.name))
                get_logger("capture").warning(
                    f"{block.class_name} ({block.path}.{self.name}): no role sub-stage "
                    f"for {', '.join(names)}; dumped as L{{NNN}}.<module path>.in / .out"
                    + "".join(f" ({note})" for note in dict.fromkeys(trace.notes))
                )
        # a module a sub-stage class dumps keeps its own in / out under that path (not its projection's)
        return [s for s in out if s.module_path not in self.written.module_paths]
