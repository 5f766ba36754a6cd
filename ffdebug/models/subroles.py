"""Role sub-stages inside a block's branches, from what the projections do (docs/dumping.md "Role sub-stages").

The capture side (`ffdebug.capture.substages`) records, for one call of a branch (the attention or
the MLP / MoE child of a block), every projection it runs — `nn.Linear`, `F.linear` on any weight,
`Conv1D`'s `addmm` — in call order, with its input and output, plus the `topk` it takes, the
activations it applies, the head reshapes it makes and the views (split / chunk / unbind /
slice) that take a fused output apart, as the output columns each holds (`Piece`). This module turns that trace into role
sub-stages. Names are never read; the rules use shapes relative to the hidden size, the head
counts and the expert count:

| branch | role | rule |
|---|---|---|
| attention | `attn.q`, `attn.k`, `attn.v` | projections of the branch input (none: of the tensor the first projection reads, several or one split), in call order; one fused projection is split into the first three views the branch takes of it that cover every column (contiguous, per-head or per-group layouts alike); two are q and a fused [k \\| v] split the same way; no such views: not split (noted) |
| attention | `attn.context` | the input of the output projection (the last projection back to the hidden size) |
| attention | `attn.o` | that output projection's output |
| MLP | `mlp.gate`, `mlp.up` | projections of the branch input to the intermediate size I (the down projection's input width); the gate is the one an activation is applied to (else the first called); one fused projection of 2·I is split into the two views the branch takes of it, the same way |
| MLP | `mlp.act` | the input of the down projection (act(gate) · up for a gated MLP) |
| MLP | `mlp.down` | the last projection back to the hidden size |
| MoE | `moe.router` | the first projection of the branch input to E outputs (E: config, else the stacked expert weights' first dim, else the expert list's length) |
| MoE | `moe.topk_ids`, `moe.topk_weights` | the indices of the last `topk` before the first expert runs: the level that selects experts; the last float tensor of their shape made before the first expert runs (renormalised / cast weights) |
| MoE | `moe.group_scores`, `moe.group_topk_ids` | grouped routing's first level: the `[tokens, G]` group strengths a top-k before the expert-selecting one ranks (G a proper divisor of E) and the groups it keeps, ascending |
| MoE | `moe.expertNNN` | expert NNN's last projection back to the hidden size, its rows sorted by token (a slice `W[e]` of a stacked `[E, ...]` weight, a projection of the e-th module of an expert list, or expert e's block of rows in a grouped matmul); an expert no token reached has no rows |
| MoE | `moe.shared`, `moe.shared.gate` / `.up` / `.act` | a shared expert: the MLP rules on the projections that are neither the router's nor an expert's |

q / k / v and the context are stored as `[batch, seq, heads, head_dim]` (k / v before any GQA
repetition: the projection's own heads); head counts from the config (`num_attention_heads`,
`num_key_value_heads`, `head_dim`), else from the first head reshapes the branch makes of its
projections. Token-wise outputs whose leading dims were flattened (`[B·S, F]`) get the branch
input's leading shape back. Every sub-stage records the original shape and, when split, the
columns (`split` for one block, `split_cols` for several runs). `with_inputs` adds the `.in`
records of what the projections read (sibling projections of one tensor share one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ffdebug.models.config_fields import config_field
from ffdebug.models.pieces import flat_split, split_fields


@dataclass(frozen=True)
class Dims:
    """Sizes the rules use; None where neither the config nor the structure said."""

    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    experts: int | None = None
    kv_rank: int | None = None  # a low-rank attention's kv latent width (`kv_lora_rank`)
    rope_dim: int | None = None  # its rotary key width (`qk_rope_head_dim`)

    @classmethod
    def of_config(cls, config, experts: int | None = None) -> Dims:
        if config is None:
            return cls(experts=experts)

        def get(k):
            return config_field(config, k)

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
        return cls(heads, kv, head_dim, n_exp, first_int("kv_lora_rank"), first_int("qk_rope_head_dim"))


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
    x_id: tuple = ()  # (data_ptr, shape, stride, first reader) of the live input: equal for one tensor
    pieces: list = field(default_factory=list)  # Piece views the branch took of the output


@dataclass(frozen=True)
class Piece:
    """A view the branch took of a projection's output (a split, chunk, unbind or slice of it):
    the output columns it holds, in its own order, and the shape of its feature dims."""

    cols: object  # LongTensor of output columns
    feat_shape: tuple  # e.g. (heads, head_dim) after a head reshape, or (width,)
    ptr: int  # data_ptr of the view (to see which one an activation reads)


@dataclass
class BranchTrace:
    """What one call of a branch did (filled by the capture side)."""

    lead: tuple  # leading shape of the branch input (e.g. (B, S))
    hidden: int
    calls: list[LinearCall] = field(default_factory=list)
    topk: tuple | None = None  # (index after which it ran, values, indices)
    group_topk: tuple | None = None  # (scores it ranked, indices) of a top-k over expert groups
    weights: tuple | None = None  # (index, tensor): last float [*, k] before the first expert
    act_ptrs: list[tuple[int, int]] = field(
        default_factory=list
    )  # (events before, data_ptr) of activation inputs
    head_shapes: list[tuple[int, int]] = field(default_factory=list)  # (heads, head_dim) reshapes
    events: int = 0
    stages: list | None = None  # the sub-stages, decided once the branch's role is known
    notes: list[str] = field(default_factory=list)  # why a projection got no role (warned once)
    form: dict | None = None  # a form that holds other stages than the usual one (`mla_roles.ABSORBED`)
    sequence_mixer: bool = False  # the branch convolved over the sequence (state-space, linear attention)
    whole: str | None = None  # why the branch has no sub-stages and is compared as a whole


@dataclass
class SubStage:
    """A role sub-stage to write at event `at` of the branch."""

    kind: str  # e.g. "attn.q" (the key is L{NNN}.{kind}.out)
    tensor: object
    at: int
    module_path: str
    extra: dict
    source: LinearCall | None = None  # the projection whose input is this stage's `.in`
    io: str = "out"  # the key is L{NNN}.{kind}.{io}
    covers: tuple[int, ...] = ()  # other branch events (projections) this stage holds


def leading_shape(t, trace: BranchTrace):
    """A token-wise output with the branch input's leading shape: `[B·S, F]` flattened, or leading
    dims that differ from it by size-1 dims only (a packed `[T, hidden]` branch that runs on
    `[1, T, ...]`, HF's `[B, 1, S, F]` single-head view of a latent)."""
    import math

    lead = tuple(t.shape[:-1])
    if t.dim() < 2 or lead == tuple(trace.lead) or math.prod(lead) != math.prod(trace.lead):
        return t
    if t.dim() == 2 or [d for d in lead if d != 1] == [d for d in trace.lead if d != 1]:
        return t.reshape(*trace.lead, t.shape[-1])
    return t


def _stage(
    kind, t, call: LinearCall, trace, heads=None, head_dim=None, split=None, at=None, reads=True
) -> SubStage:
    """A sub-stage of `call`'s output `t` (a piece of it when `split`, the fields saying which);
    `reads`: its `.in` is the projection's input (False: it is no projection's output)."""
    orig = list(t.shape) if split is None else list(call.y.shape)
    t = leading_shape(t, trace)
    extra: dict = {"orig_shape": orig, **(split or {})}
    if heads and head_dim and t.shape[-1] == heads * head_dim:
        t = t.reshape(*t.shape[:-1], heads, head_dim)
        extra["heads"] = heads
    return SubStage(kind, t, call.index if at is None else at, call.path, extra, call if reads else None)


def _parts(call: LinearCall, n: int) -> list[tuple[object, dict, Piece]] | None:
    """The `n` pieces the branch split a fused projection's output into, in the order it took them,
    as (tensor `[..., width]`, split fields, piece); None unless it took exactly `n` disjoint views
    covering every output column (then its layout is unknown: never guessed)."""
    if len(call.pieces) != n or sum(p.cols.numel() for p in call.pieces) != call.out_features:
        return None
    flat = call.y.reshape(-1, call.out_features)
    lead = tuple(call.y.shape[:-1])
    return [(flat[:, p.cols].reshape(*lead, p.cols.numel()), split_fields(p.cols), p) for p in call.pieces]


def _heads_of(piece: Piece, heads, head_dim) -> tuple:
    """(heads, head_dim) of a piece: the counts when they fit its width; else, with a known head
    dim, as many heads as fit; else the branch's own 2-D view of it (a per-group view such as
    [KV groups, r·D] is not [heads, D], so it comes last)."""
    n = piece.cols.numel()
    if heads and head_dim and n == heads * head_dim:
        return heads, head_dim
    if head_dim and n % head_dim == 0 and piece.feat_shape[-1] % head_dim == 0:
        return n // head_dim, head_dim
    if len(piece.feat_shape) == 2:
        return piece.feat_shape
    return None, None


def _undetermined(trace: BranchTrace, call: LinearCall, what: str) -> None:
    trace.notes.append(
        f"{call.path} is a fused {what} projection ({call.out_features} outputs) whose layout the branch "
        "did not show (no split / chunk / unbind / slice of its output was seen), so it is not split"
    )


def _head_counts(trace: BranchTrace, dims: Dims) -> tuple[int | None, int | None, int | None]:
    """(heads, kv heads, head dim): the config's, unless the branch's first head reshape splits the
    same width otherwise (Whisper's decoder: the config's count is the encoder's); else its own."""
    seen = trace.head_shapes[0] if trace.head_shapes else (0, 0)
    if dims.heads and dims.head_dim and seen[0] * seen[1] != dims.heads * dims.head_dim:
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
    if not ins and calls and calls[0].x_id:
        # the branch built its projections' input itself (a single-stream block's attention
        # concatenating [image | text] tokens first): q / k / v read the first projection's input,
        # several projections or one taken apart (one alone, not split, tells nothing: RWKV makes
        # each of its k / v / r inputs itself)
        shared = [c for c in calls if c.x_id == calls[0].x_id]
        if len(shared) > 1 or _parts(shared[0], 3) is not None:
            ins = shared
    taken = {id(c) for c in ins}
    outs = [c for c in calls if id(c) not in taken and c.out_features == trace.hidden]
    h, kv, d = _head_counts(trace, dims)
    inner = [c for c in calls if id(c) not in taken and (not outs or c is not outs[-1])]
    from ffdebug.models.mla_roles import low_rank, mla_substages

    if low_rank(ins, inner, trace.hidden):  # MLA: latents projected up before the heads
        return mla_substages(trace, ins, inner, outs[-1] if outs else None, h, dims)
    out: list[SubStage] = []
    roles = ("attn.q", "attn.k", "attn.v")
    if len(ins) == 3:
        for kind, c, n in zip(roles, ins, (h, kv, kv)):
            out.append(_stage(kind, c.y, c, trace, n, d))
    elif len(ins) == 2 and flat_split(ins[0]):  # "q" is itself fused: more than three projections
        trace.notes.append(f"{ins[0].path}: its output is taken apart into projections; no q / k / v read")
    elif len(ins) in (1, 2):  # one fused [q | k | v], or q and a fused [k | v]: split as the branch does
        fused = ins[-1]
        parts = _parts(fused, 4 - len(ins))
        if len(ins) == 2:
            out.append(_stage("attn.q", ins[0].y, ins[0], trace, h, d))
        if parts is not None:
            for kind, (t, split, piece), n in zip(roles[len(ins) - 1 :], parts, (h, kv, kv)[len(ins) - 1 :]):
                out.append(_stage(kind, t, fused, trace, *_heads_of(piece, n, d), split=split))
        else:
            _undetermined(trace, fused, "k / v" if len(ins) == 2 else "q / k / v")
    if outs:
        o = outs[-1]
        q = next((x for x in out if x.kind == "attn.q"), None)
        if (h is None or d is None) and q is not None and "heads" in q.extra:  # the heads q was split into
            h, d = q.tensor.shape[-2], q.tensor.shape[-1]
        out.append(_stage("attn.context", o.x, o, trace, h, d, reads=False))
        out.append(_stage("attn.o", o.y, o, trace))
    return out


def _gate_first(outputs: list[tuple[int, int]], act_ptrs: list[tuple[int, int]]) -> bool:
    """Whether the first of two outputs ((event index, data pointer) each) is the gate: the one an
    activation read after it was made; else the first. An activation before it read another tensor
    at that address (a routed expert's, freed before the shared expert ran)."""
    for i, (at, ptr) in enumerate(outputs):
        if any(ptr == p and seen > at for seen, p in act_ptrs):
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
        parts = _parts(c, 2)
        if parts is None:
            _undetermined(trace, c, "gate / up")
        else:
            if not _gate_first([(c.index, p.ptr) for _, _, p in parts], trace.act_ptrs):
                parts.reverse()
            out.append(_stage("mlp.gate", parts[0][0], c, trace, split=parts[0][1]))
            out.append(_stage("mlp.up", parts[1][0], c, trace, split=parts[1][1]))
    elif len(ins) == 2 and all(c.out_features == inner for c in ins):
        first = _gate_first([(c.index, c.y_ptr) for c in ins], trace.act_ptrs)
        gate, up = ins if first else ins[::-1]
        out += [_stage("mlp.gate", gate.y, gate, trace), _stage("mlp.up", up.y, up, trace)]
        out.sort(key=lambda s: s.at)
    elif len(ins) == 1 and ins[0].out_features == inner:
        out.append(_stage("mlp.up", ins[0].y, ins[0], trace))
    out.append(_stage("mlp.act", down.x, down, trace, reads=False))
    out.append(_stage("mlp.down", down.y, down, trace))
    return out


def moe_substages(trace: BranchTrace, dims: Dims) -> list[SubStage]:
    """router, top-k, experts and shared expert of a MoE branch (see the module table)."""
    experts = [c for c in trace.calls if c.expert is not None]
    plain = [c for c in trace.calls if c.expert is None]
    router = next((c for c in plain if c.from_input and c.out_features == dims.experts), None)
    if not experts:
        return []
    # no router projection found (a router that is an MLP of its own): the experts still are
    out = [_stage("moe.router", router.y, router, trace)] if router is not None else []
    first_expert = experts[0].index
    if trace.topk is not None and router is not None:
        at, _values, ids, _scores = trace.topk
        out += _group_levels(trace, dims, first_expert, router.path)  # the level before, first
        out.append(SubStage("moe.topk_ids", leading_shape(ids, trace), first_expert, router.path, {}))
        w = trace.weights[1] if trace.weights is not None else trace.topk[1]
        out.append(SubStage("moe.topk_weights", leading_shape(w, trace), first_expert, router.path, {}))
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
        out += _expert_stages(f"moe.expert{e:03d}", runs)
    out += _idle_experts(by_expert, dims.experts, out)
    if router is None:
        return out
    shared = BranchTrace(
        trace.lead,
        trace.hidden,
        [c for c in plain if c is not router],
        act_ptrs=trace.act_ptrs,
        notes=trace.notes,
    )
    for s in mlp_substages(shared):  # a shared expert: the MLP rules on the other projections
        s.kind = "moe.shared" if s.kind == "mlp.down" else s.kind.replace("mlp.", "moe.shared.")
        out.append(s)
    return out


def _group_levels(trace: BranchTrace, dims: Dims, at: int, path: str) -> list[SubStage]:
    """Grouped (node-limited) routing's first level: `moe.group_scores` (each expert group's
    strength) and `moe.group_topk_ids` (the groups kept, ascending: a set), from the last top-k
    before the expert-selecting one over a `[tokens, G]` tensor with G a proper divisor of E."""
    if trace.group_topk is None:
        return []
    scores, ids = trace.group_topk
    groups = scores.shape[-1]
    if not dims.experts or groups >= dims.experts or dims.experts % groups:
        return []
    extra = {"groups": groups}
    return [
        SubStage("moe.group_scores", leading_shape(scores, trace), at, path, dict(extra)),
        SubStage("moe.group_topk_ids", leading_shape(ids.sort(-1).values, trace), at, path, dict(extra)),
    ]


def _idle_experts(by_expert: dict, count: int | None, placed: list[SubStage]) -> list[SubStage]:
    """`moe.expertNNN` with no rows for each of the `count` experts no token was routed to in this
    call (where the placed experts say what their rows are like): an expert idle on one side only
    is a routing difference the rows of the other side show, not a stage one side lacks."""
    import torch

    ins = {s.kind: s for s in placed if s.kind.startswith("moe.expert") and s.io == "in"}
    outs = {s.kind: s for s in placed if s.kind.startswith("moe.expert") and s.io == "out"}
    if not count or not ins or not outs:
        return []
    x0, y0 = next(iter(ins.values())), next(iter(outs.values()))
    idle = []
    for e in range(count):
        kind = f"moe.expert{e:03d}"
        if e in by_expert or kind in ins:
            continue
        x = torch.empty((0, x0.tensor.shape[-1]), dtype=x0.tensor.dtype)
        y = torch.empty((0, y0.tensor.shape[-1]), dtype=y0.tensor.dtype)
        extra_y = {"orig_shape": [0, y.shape[-1]], "inputs": [f"{kind}.in"], "tokens": []}
        idle.append(
            SubStage(kind, x, x0.at, x0.module_path, {"orig_shape": [0, x.shape[-1]], "tokens": []}, io="in")
        )
        idle.append(SubStage(kind, y, y0.at, y0.module_path, extra_y))
    return idle


def _expert_stages(kind: str, runs: list[tuple[LinearCall, LinearCall]]) -> list[SubStage]:
    """`kind.in` (the rows the expert read) and `kind.out` (its output rows) of the expert's runs
    ((down projection, first projection) pairs), both sorted by token when every row was matched."""
    import torch

    x = torch.cat([f.x.reshape(-1, f.x.shape[-1]) for _, f in runs])
    y = torch.cat([c.y.reshape(-1, c.y.shape[-1]) for c, _ in runs])
    tokens = [f.tokens for _, f in runs]
    extra_in: dict = {"orig_shape": list(x.shape)}
    extra: dict = {"orig_shape": list(y.shape), "inputs": [f"{kind}.in"]}
    if all(t is not None for t in tokens):
        order = torch.cat(tokens)
        sort = order.argsort(stable=True)
        x, y = x[sort], y[sort]
        extra["tokens"] = extra_in["tokens"] = sorted(int(i) for i in order)
    first, down = runs[0][1], runs[-1][0]
    return [
        SubStage(kind, x, first.index, first.path, extra_in, io="in"),
        SubStage(kind, y, down.index, down.path, extra),
    ]


_ROLE_ORDER = ("q", "k", "v", "gate", "up")


def _group_name(kinds: list[str]) -> str:
    """One name for roles reading one tensor: attn.q + attn.k + attn.v -> attn.qkv, mlp.gate +
    mlp.up -> mlp.gate_up (leaves in role order, joined without a separator when all are letters)."""
    parent = kinds[0].rsplit(".", 1)[0]
    leaves = sorted((k.rsplit(".", 1)[1] for k in kinds), key=_ROLE_ORDER.index)
    return f"{parent}.{('' if all(len(x) == 1 for x in leaves) else '_').join(leaves)}"


def with_inputs(stages: list[SubStage], trace: BranchTrace, group: bool = True) -> list[SubStage]:
    """The stages with the `.in` records of what they read, each placed just before its first
    reader (docs/dumping.md "Role sub-stages", inputs): a projection's input activation (not its weight).
    With `group`, sibling input projections (q / k / v, gate / up) that read one tensor — a fused
    projection, or separate ones of the same input — share one record named for the group
    (`attn.qkv.in`, `mlp.gate_up.in`), so a fused side and an unfused one write the same key.
    Every reader names its inputs, in argument order, in `extra["inputs"]` (keys without the
    layer prefix); `mlp.act` reads the `gate` and `up` outputs."""
    groups: dict[tuple, list[SubStage]] = {}
    for s in stages:
        c = s.source
        if c is None or s.io != "out":
            continue
        parent, leaf = s.kind.rsplit(".", 1) if "." in s.kind else ("", s.kind)
        named = s.extra.pop("in_name", None)  # one record for readers of one tensor, so named
        sibling = group and c.from_input and leaf in _ROLE_ORDER
        key = (named, c.x_id) if named else (parent, c.x_id) if sibling else (id(s),)
        groups.setdefault(key, []).append(s)
        if named:
            s.extra["in_name"] = named
    before: dict[int, SubStage] = {}  # id(first reader) -> the `.in` stage written just before it
    for members in groups.values():
        c = members[0].source
        name = members[0].extra.pop("in_name", None)
        for m in members[1:]:
            m.extra.pop("in_name", None)
        if name is None:
            name = _group_name([m.kind for m in members]) if len(members) > 1 else members[0].kind
        extra: dict = {"orig_shape": list(c.x.shape)}
        if len(members) > 1:
            extra["read_by"] = [m.kind for m in members]
        before[id(members[0])] = SubStage(
            name, leading_shape(c.x, trace), members[0].at, c.path, extra, io="in"
        )
        for m in members:
            m.extra["inputs"] = [f"{name}.in"]
    kinds = {s.kind for s in stages}
    out: list[SubStage] = []
    for s in stages:
        if s.kind.endswith(".act"):
            parent = s.kind[: -len("act")]
            s.extra["inputs"] = [f"{parent}{r}.out" for r in ("gate", "up") if f"{parent}{r}" in kinds]
        if id(s) in before:
            out.append(before[id(s)])
        out.append(s)
    return out


def branch_substages(trace: BranchTrace, stage: str, dims: Dims) -> list[SubStage]:
    """Role sub-stages of a branch placed as `stage` (`attn_out`, `ffn_out`, or a one-branch block's
    `branch_out`, whose trace decides: reshapes into heads and no activation read an attention, an
    activation or experts an MLP / MoE; a branch no role placed still gets its experts when it
    takes a top-k); [] when no rule fits. A sequence mixer (it convolves over the sequence: Mamba,
    Mamba-2, gated delta nets, hybrids' short convolutions) has no role sub-stages: it is compared
    as a whole at its output (`trace.whole`, said in run.json's `compared_whole`)."""
    if trace.sequence_mixer:
        trace.whole = (
            "a sequence mixer (it convolves over the sequence: state-space or linear attention) has no "
            "role sub-stages; it is compared as a whole at its output"
        )
        return []
    if stage == "branch_out":
        mlp_like = bool(trace.act_ptrs) or any(c.expert is not None for c in trace.calls)
        stage = "ffn_out" if mlp_like else "attn_out" if trace.head_shapes else ""
    if stage == "attn_out":
        return attention_substages(trace, dims)
    routed = stage == "ffn_out" or trace.topk is not None  # a list of blocks is no experts unrouted
    if routed and any(c.expert is not None for c in trace.calls):  # a MoE branch, placed or not
        return moe_substages(trace, dims)
    if stage == "ffn_out":
        return mlp_substages(trace)
    return []
