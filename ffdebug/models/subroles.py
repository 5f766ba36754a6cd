"""Role sub-stages inside a block's branches, from what the projections do (README "Role sub-stages").

The capture side (`ffdebug.capture.substages`) records, for one call of a branch (the attention or
the MLP / MoE child of a block), every projection it runs — `nn.Linear`, `F.linear` on any weight,
`Conv1D`'s `addmm` — in call order, with its input and output, plus the `topk` it takes, the
activations it applies and the head reshapes it makes. This module turns that trace into role
sub-stages. Names are never read; the rules use shapes relative to the hidden size, the head
counts and the expert count:

| branch | role | rule |
|---|---|---|
| attention | `attn.q`, `attn.k`, `attn.v` | projections of the branch input, in call order; one fused projection of (H + 2·KV)·D is split [q \\| k \\| v]; two are q and a fused [k \\| v] |
| attention | `attn.context` | the input of the output projection (the last projection back to the hidden size) |
| attention | `attn.o` | that output projection's output |
| MLP | `mlp.gate`, `mlp.up` | projections of the branch input to the intermediate size I (the down projection's input width); the gate is the one an activation is applied to (else the first called); one fused projection of 2·I is split [gate \\| up] the same way |
| MLP | `mlp.act` | the input of the down projection (act(gate) · up for a gated MLP) |
| MLP | `mlp.down` | the last projection back to the hidden size |
| MoE | `moe.router` | the first projection of the branch input to E outputs (E: config, else the stacked expert weights' first dim, else the expert list's length) |
| MoE | `moe.topk_ids`, `moe.topk_weights` | the indices of the first `topk` after the router; the last float tensor of their shape made before the first expert runs (renormalised / cast weights) |
| MoE | `moe.expertNNN` | expert NNN's last projection back to the hidden size, its rows sorted by token (a slice `W[e]` of a stacked `[E, ...]` weight, or a projection of the e-th module of an expert list) |
| MoE | `moe.shared` | the last other projection back to the hidden size (a shared expert) |

q / k / v and the context are stored as `[batch, seq, heads, head_dim]` (k / v before any GQA
repetition: the projection's own heads); head counts from the config (`num_attention_heads`,
`num_key_value_heads`, `head_dim`), else from the first head reshapes the branch makes of its
projections. Token-wise outputs whose leading dims were flattened (`[B·S, F]`) get the branch
input's leading shape back. Every sub-stage records the original shape and, when split, the slice.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Dims:
    """Sizes the rules use; None where neither the config nor the structure said."""

    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    experts: int | None = None

    @classmethod
    def of_config(cls, config, experts: int | None = None) -> Dims:
        if config is None:
            return cls(experts=experts)
        get = (lambda k: config.get(k)) if isinstance(config, dict) else (lambda k: getattr(config, k, None))

        def first_int(*names):
            for n in names:
                v = get(n)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
            return None

        heads = first_int("num_attention_heads", "n_heads", "n_head")
        kv = first_int("num_key_value_heads", "n_kv_heads") or heads
        head_dim = first_int("head_dim")
        hidden = first_int("hidden_size", "dim", "n_embd")
        if head_dim is None and heads and hidden and hidden % heads == 0:
            head_dim = hidden // heads
        n_exp = first_int("num_experts", "num_local_experts", "n_routed_experts") or experts
        return cls(heads, kv, head_dim, n_exp)


@dataclass
class LinearCall:
    """One projection run inside the branch."""

    index: int  # position in the branch's event order
    path: str  # module path of the weight's owner
    expert: int | None  # expert index (a stacked-weight slice or an expert-list member)
    from_input: bool  # its input is the branch input
    in_features: int
    out_features: int
    x: object  # input copy (None when it is the branch input)
    y: object  # output copy
    y_ptr: int  # data_ptr of the live output (to see which one an activation reads)
    elem: int  # element size of the output
    tokens: object = None  # expert rows -> token index in the flattened branch input


@dataclass
class BranchTrace:
    """What one call of a branch did (filled by the capture side)."""

    lead: tuple  # leading shape of the branch input (e.g. (B, S))
    hidden: int
    calls: list[LinearCall] = field(default_factory=list)
    topk: tuple | None = None  # (index after which it ran, values, indices)
    weights: tuple | None = None  # (index, tensor): last float [*, k] before the first expert
    act_ptrs: list[int] = field(default_factory=list)  # data_ptrs of activation inputs
    head_shapes: list[tuple[int, int]] = field(default_factory=list)  # (heads, head_dim) reshapes
    events: int = 0
    stages: list | None = None  # the sub-stages, decided once the branch's role is known


@dataclass
class SubStage:
    """A role sub-stage to write at event `at` of the branch."""

    kind: str  # e.g. "attn.q" (the key is L{NNN}.{kind}.out)
    tensor: object
    at: int
    module_path: str
    extra: dict


def _lead(t, trace: BranchTrace):
    """A token-wise `[B·S, F]` output back to the branch input's leading shape."""
    n = 1
    for d in trace.lead:
        n *= d
    if len(trace.lead) > 1 and t.dim() == 2 and t.shape[0] == n:
        return t.reshape(*trace.lead, t.shape[-1])
    return t


def _stage(kind, t, call: LinearCall, trace, heads=None, head_dim=None, split=None, at=None) -> SubStage:
    orig = list(t.shape) if split is None else list(call.y.shape)
    t = _lead(t, trace)
    extra: dict = {"orig_shape": orig}
    if split is not None:
        extra["split"] = list(split)
    if heads and head_dim and t.shape[-1] == heads * head_dim:
        t = t.reshape(*t.shape[:-1], heads, head_dim)
        extra["heads"] = heads
    return SubStage(kind, t, call.index if at is None else at, call.path, extra)


def _head_counts(trace: BranchTrace, dims: Dims) -> tuple[int | None, int | None, int | None]:
    if dims.heads and dims.head_dim:
        return dims.heads, dims.kv_heads or dims.heads, dims.head_dim
    if trace.head_shapes:
        (h, d), rest = trace.head_shapes[0], trace.head_shapes[1:]
        kv = next((n for n, dd in rest if dd == d), h)
        return h, kv, d
    return None, None, None


def attention_substages(trace: BranchTrace, dims: Dims) -> list[SubStage]:
    """q / k / v, context and o of an attention branch (see the module table)."""
    calls = [c for c in trace.calls if c.expert is None]
    ins = [c for c in calls if c.from_input]
    outs = [c for c in calls if not c.from_input and c.out_features == trace.hidden]
    h, kv, d = _head_counts(trace, dims)
    out: list[SubStage] = []
    sizes = (h * d, kv * d, kv * d) if h and kv and d else None
    if len(ins) == 1 and sizes and ins[0].out_features == sum(sizes):
        c, lo = ins[0], 0
        for kind, size, n in zip(("attn.q", "attn.k", "attn.v"), sizes, (h, kv, kv)):
            out.append(_stage(kind, c.y[..., lo : lo + size], c, trace, n, d, (lo, lo + size)))
            lo += size
    elif len(ins) == 2 and sizes and (ins[0].out_features, ins[1].out_features) == (sizes[0], 2 * sizes[1]):
        out.append(_stage("attn.q", ins[0].y, ins[0], trace, h, d))
        c = ins[1]
        out.append(_stage("attn.k", c.y[..., : sizes[1]], c, trace, kv, d, (0, sizes[1])))
        out.append(_stage("attn.v", c.y[..., sizes[1] :], c, trace, kv, d, (sizes[1], 2 * sizes[1])))
    elif len(ins) == 3:
        for kind, c, n in zip(("attn.q", "attn.k", "attn.v"), ins, (h, kv, kv)):
            out.append(_stage(kind, c.y, c, trace, n, d))
    if outs:
        o = outs[-1]
        if o.x is not None:
            out.append(_stage("attn.context", o.x, o, trace, h, d))
        out.append(_stage("attn.o", o.y, o, trace))
    return out


def _gate_first(pieces: list[tuple[LinearCall, int]], act_ptrs: list[int]) -> bool:
    """Whether the first of two (call, element offset) pieces is the gate: the one an activation
    read (by its data pointer); else the first."""
    for i, (c, offset) in enumerate(pieces):
        if c.y_ptr + offset * c.elem in act_ptrs:
            return i == 0
    return True


def mlp_substages(trace: BranchTrace) -> list[SubStage]:
    """gate / up, act and down of a dense MLP branch (see the module table)."""
    calls = [c for c in trace.calls if c.expert is None]
    downs = [c for c in calls if not c.from_input and c.out_features == trace.hidden]
    if not downs:
        return []
    down = downs[-1]
    inner = down.in_features
    ins = [c for c in calls if c.from_input and c.index < down.index]
    out: list[SubStage] = []
    if len(ins) == 1 and ins[0].out_features == 2 * inner:
        c = ins[0]
        halves = [(c.y[..., :inner], (0, inner)), (c.y[..., inner:], (inner, 2 * inner))]
        if not _gate_first([(c, 0), (c, inner)], trace.act_ptrs):
            halves.reverse()
        out.append(_stage("mlp.gate", halves[0][0], c, trace, split=halves[0][1]))
        out.append(_stage("mlp.up", halves[1][0], c, trace, split=halves[1][1]))
    elif len(ins) == 2 and all(c.out_features == inner for c in ins):
        gate, up = ins if _gate_first([(ins[0], 0), (ins[1], 0)], trace.act_ptrs) else ins[::-1]
        out += [_stage("mlp.gate", gate.y, gate, trace), _stage("mlp.up", up.y, up, trace)]
        out.sort(key=lambda s: s.at)
    elif len(ins) == 1 and ins[0].out_features == inner:
        out.append(_stage("mlp.up", ins[0].y, ins[0], trace))
    if down.x is not None:
        out.append(_stage("mlp.act", down.x, down, trace))
    out.append(_stage("mlp.down", down.y, down, trace))
    return out


def moe_substages(trace: BranchTrace, dims: Dims) -> list[SubStage]:
    """router, top-k, experts and shared expert of a MoE branch (see the module table)."""
    import torch

    experts = [c for c in trace.calls if c.expert is not None]
    plain = [c for c in trace.calls if c.expert is None]
    router = next((c for c in plain if c.from_input and c.out_features == dims.experts), None)
    if router is None or not experts:
        return []
    out = [_stage("moe.router", router.y, router, trace)]
    first_expert = experts[0].index
    if trace.topk is not None:
        at, _values, ids = trace.topk
        out.append(SubStage("moe.topk_ids", _lead(ids, trace), first_expert, router.path, {}))
        w = trace.weights[1] if trace.weights is not None else trace.topk[1]
        out.append(SubStage("moe.topk_weights", _lead(w, trace), first_expert, router.path, {}))
    by_expert: dict[int, list[LinearCall]] = {}
    for c in experts:
        by_expert.setdefault(c.expert, []).append(c)
    for e in sorted(by_expert):
        runs, first = [], None  # each run of the expert: (its down projection, its first projection)
        for c in by_expert[e]:  # a run: projections of the gathered rows, then one back to hidden
            if first is None:
                first = c
            elif c.out_features == trace.hidden and c.tokens is None:
                runs.append((c, first))
                first = None
        if not runs:
            continue
        rows = [c.y.reshape(-1, c.y.shape[-1]) for c, _ in runs]
        tokens = [f.tokens for _, f in runs]
        downs = [c for c, _ in runs]
        y = torch.cat(rows)
        extra: dict = {"orig_shape": list(y.shape)}
        if all(t is not None for t in tokens):
            order = torch.cat(tokens)
            y = y[order.argsort(stable=True)]
            extra["tokens"] = sorted(int(i) for i in order)
        out.append(SubStage(f"moe.expert{e:03d}", y, downs[-1].index, downs[-1].path, extra))
    shared = [c for c in plain if c is not router and not c.from_input and c.out_features == trace.hidden]
    if shared:
        out.append(_stage("moe.shared", shared[-1].y, shared[-1], trace))
    return out


def branch_substages(trace: BranchTrace, stage: str, dims: Dims) -> list[SubStage]:
    """Role sub-stages of a branch placed as `stage` (`attn_out` or `ffn_out`); [] when no rule fits."""
    if stage == "attn_out":
        return attention_substages(trace, dims)
    if stage == "ffn_out":
        if any(c.expert is not None for c in trace.calls):
            return moe_substages(trace, dims)
        return mlp_substages(trace)
    return []
