"""Stage roles from what modules do, not what they are called (docs/dumping.md "Stage names by role").

Two codebases of one model (HF against an engine's re-implementation) name their modules
differently; ffdebug names the stages by role so that they pair:

1. **Norms** by type (`nn.LayerNorm`, `nn.RMSNorm`, `nn.GroupNorm` and subclasses) or by
   behaviour on the first call: a module whose parameters are 1-D of the hidden size (a scale,
   maybe a bias) and whose output rows, divided by the scale (or by 1 + scale, Gemma's
   convention) after the bias is taken away, have unit RMS, or zero mean and unit variance.
2. **Branches**: the other direct children of a block that hold parameters (modules without
   parameters — dropout, activations, rotary tables — carry no role).
3. **Order around the residual adds**, read from the block's first call:

   | children in call order (n norm, c branch) | roles |
   |---|---|
   | n c n c (pre-norm)                       | attn_norm_out attn_out ffn_norm_out ffn_out |
   | n c n n c n (sandwich)                   | attn_norm_out attn_out attn_post_norm_out ffn_norm_out ffn_out ffn_post_norm_out |
   | c n c n (post-norm)                      | attn_out attn_norm_out ffn_out ffn_norm_out |
   | n c c (parallel residual, one norm)      | attn_norm_out attn_out ffn_out |
   | n c, c, c n, n c n (one branch)           | branch_norm_out branch_out (branch_post_norm_out) |

   The first branch is the attention, the second the MLP (or MoE). A block with one branch is
   `branch_out`: order cannot tell an attention from an MLP there, and the name is the same on
   both sides. A block with more than two
   branches (diffusers' joint blocks: adaptive norms, context streams) has no unambiguous order:
   its children keep the attribute-name hints (`CANONICAL_CHILDREN`), else `{child}.out`, and a
   warning names what could not be placed. Where the hints place nothing (a renamed port) or
   only part of what the children's behaviour places (and agree with it), the behaviour reads:
   the pre-norm pairs around the attending child, or one attention (and, in a joint block, the
   MLP on the hidden stream) with the rest by path (`place_children`).

Model level: `embed.out` is the input embedding (`get_input_embeddings()`, else the
`nn.Embedding` fed the root's token ids); `final.norm_out` is the last norm that runs after the
last block; the root output is `final.logits` when it is `.logits` or a tensor whose last dim is
the vocabulary size (config `vocab_size` or the embedding's `num_embeddings`), else `final.out`.
"""

from __future__ import annotations

from dataclasses import dataclass

NORM = "norm"
BRANCH = "branch"
CROSS = "cross"  # a branch fed the encoder's states (cross-attention): `cross_attn_out`
ATTENTION = "attention"  # a branch in which a softmax attention kernel ran (`capture/kernel_taps.py`)
NORM_SHAPED = "norm_shaped"  # a branch with a norm's parameters whose rows did not read as one
NORM_LED = "norm_led"  # a branch whose own norm reads its input first (a gated norm `norm(x) · σ(g(·))`)
CROSS_INPUTS = ("encoder_hidden_states", "key_value_states", "encoder_outputs", "context")
UNIT_TOL = 0.05  # |rms - 1| (or |std - 1|, |mean|) averaged over rows
RESCALE_TOL = 0.02  # ‖z − c·x‖ / ‖z‖ averaged over rows (bf16 outputs round at ~4e-3)
EPS_FIT = 0.05  # the spread of a norm's implied eps, against the spread of its rows' mean squares


def _params(module) -> list:
    return list(module.parameters(recurse=True))


def is_norm_type(module) -> bool:
    """A torch norm layer (or a subclass)."""
    import torch.nn as nn

    types = [nn.LayerNorm, nn.GroupNorm]
    if hasattr(nn, "RMSNorm"):
        types.append(nn.RMSNorm)
    return isinstance(module, tuple(types))


def norm_shaped(module) -> bool:
    """Parameters that a norm has: one or two 1-D tensors of one size, none in a child module."""
    own = list(module.parameters(recurse=False))
    if not own or len(own) > 2 or len(own) != len(_params(module)):
        return False
    return all(p.dim() == 1 for p in own) and len({p.numel() for p in own}) == 1


def _unit_rows(y) -> bool:
    """Rows with unit RMS (RMSNorm) or zero mean and unit variance (LayerNorm)."""
    rms = y.pow(2).mean(-1).sqrt()
    if float((rms - 1).abs().mean()) < UNIT_TOL:
        return True
    mean, std = y.mean(-1), y.std(-1, unbiased=False)
    return float(mean.abs().mean()) < UNIT_TOL and float((std - 1).abs().mean()) < UNIT_TOL


def _affine_undone(module, y):
    """`y` (float64) with `module`'s own affine parameters undone, once per reading of the weight
    (`w` or Gemma's `1 + w`; a weight with a zero is no divisor); `y` itself without parameters."""
    own = list(module.parameters(recurse=False))
    if not own:
        yield y
        return
    weight = own[0].detach().double()
    centred = y - own[1].detach().double() if len(own) > 1 else y
    for scale in (weight, 1.0 + weight):
        if bool((scale.abs() > 1e-6).all()):
            yield centred / scale


def behaves_like_norm(module, output) -> bool:
    """`module`'s output rows, with its affine parameters undone, are normalised (see module doc)."""
    import torch

    if not isinstance(output, torch.Tensor) or not output.is_floating_point() or output.dim() < 1:
        return False
    y = output.detach().double()
    if any(p.numel() != y.shape[-1] for p in module.parameters(recurse=False)):
        return False
    return any(_unit_rows(z) for z in _affine_undone(module, y))


def rescales_rows(module, x, output) -> bool:
    """`module`'s output rows, its affine parameters undone, are its input's rows (or the rows less
    their mean) each times `1 / sqrt(ms + eps)` of that row, for one eps ≥ 0: a norm whatever its
    eps (a large eps on small activations leaves rows far from unit RMS), not a fixed scale."""
    import torch

    if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (x, output)):
        return False
    if tuple(x.shape) != tuple(output.shape) or output.dim() < 1 or output.shape[-1] < 2:
        return False
    if any(p.numel() != output.shape[-1] for p in module.parameters(recurse=False)):
        return False  # per-channel parameters of a channels-first layout (BatchNorm2d): not row-wise
    y = output.detach().double().reshape(-1, output.shape[-1])
    xs = x.detach().double().reshape(-1, x.shape[-1])
    for z in _affine_undone(module, y):
        for base in (xs, xs - xs.mean(-1, keepdim=True)):
            bb = (base * base).sum(-1)
            if not bool((bb > 0).all()):
                continue
            ratio = (z * base).sum(-1) / bb
            resid = (z - ratio[:, None] * base).norm(dim=-1) / z.norm(dim=-1).clamp_min(1e-300)
            if not (bool((ratio > 0).all()) and float(resid.mean()) < RESCALE_TOL):
                continue
            # a norm's factor is 1 / sqrt(ms + eps) of its row: 1 / factor² - ms is one eps ≥ 0
            # for every row, while a fixed scale leaves it following ms
            ms = (base * base).mean(-1)
            eps = ratio.pow(-2) - ms
            if (
                ms.numel() > 1
                and float(eps.std()) <= EPS_FIT * float(ms.std())
                and float(eps.mean()) >= -1e-12
            ):
                return True
    return False


def is_norm(module, output, x=None) -> bool:
    """A norm by type, or norm-shaped and behaving like one on this output (with its input `x`
    when known: rows rescaled, `rescales_rows`)."""
    if is_norm_type(module):
        return True
    if not norm_shaped(module):
        return False
    return behaves_like_norm(module, output) or (x is not None and rescales_rows(module, x, output))


def role_children(module):
    """(name, child, by_path) of a block's direct children; members of a child ModuleList stand
    as children of their own (`layer.1` in T5's block, `resnets.0` in a UNet block).

    `by_path`: a list of one class is a stack of like parts (a UNet block's `resnets`,
    `attentions`, `downsamplers`): its members are named by path (`resnets.1.out`), never by
    role. A list of different classes (T5's self-attention, cross-attention, feed-forward
    sublayers) is a sequence of sublayers, placed by role like direct children."""
    import torch.nn as nn

    for name, child in module.named_children():
        if isinstance(child, nn.ModuleList):
            like = len({type(m) for m in child}) == 1
            yield from ((f"{name}.{i}", m, like) for i, m in enumerate(child))
        else:
            yield name, child, False


def fed_encoder_states(args, kwargs) -> bool:
    """A call that passes the encoder's states (a cross-attention branch)."""
    import torch

    return any(isinstance(kwargs.get(n), torch.Tensor) for n in CROSS_INPUTS)


def has_role(module) -> bool:
    """Modules without parameters (dropout, activations, rotary tables) carry no role."""
    return is_norm_type(module) or bool(_params(module))


@dataclass(frozen=True)
class Placement:
    """The stage name of each called child of one block, and what could not be placed."""

    names: dict[str, str]  # child attribute name -> stage name (without the layer prefix)
    unplaced: tuple[str, ...]
    by_order: bool  # decided by the order around the residual adds (else by name hints)


def _sequence_roles(kinds: list[str]) -> list[str] | None:
    """Stage names for a sequence of `norm` / `branch` kinds, or None when it is not a known form."""
    branches = [i for i, k in enumerate(kinds) if k == BRANCH]
    if len(branches) == 1:
        return _single_branch_roles(kinds)
    if len(branches) != 2:
        return None
    names: list[str] = []
    first = branches[0]
    second = branches[1] if len(branches) == 2 else None
    pre_post = {0: ("attn_norm_out", "attn_post_norm_out"), 1: ("ffn_norm_out", "ffn_post_norm_out")}
    pre_norm = kinds[0] == NORM
    for i, kind in enumerate(kinds):
        if kind == BRANCH:
            names.append("attn_out" if i == first else "ffn_out")
            continue
        if i < first:
            names.append(pre_post[0][0])
        elif second is None or i > second:
            slot = 1 if second is not None else 0
            names.append(pre_post[slot][1] if pre_norm else pre_post[slot][0])
        else:  # between the branches
            if not pre_norm:
                names.append(pre_post[0][0])  # post-norm: the norm after the attention
            elif kinds[i + 1] == BRANCH:
                names.append(pre_post[1][0])  # right before the MLP: its pre-norm
            else:
                names.append(pre_post[0][1])  # sandwich: the attention's post-norm
    return names if len(set(names)) == len(names) else None


def _single_branch_roles(kinds: list[str]) -> list[str] | None:
    """One branch (a block that is `x + mlp(norm(x))`, or a mixer-only block): order cannot say
    whether it attends or not, so it is `branch_out`, its norm before it `branch_norm_out`, after it
    `branch_post_norm_out` — the same names on both sides, never a guessed `attn_out`."""
    at = kinds.index(BRANCH)
    if kinds.count(NORM) != len(kinds) - 1 or at > 1 or len(kinds) - at > 2:
        return None
    names = ["branch_norm_out"] * at + ["branch_out"]
    return names + ["branch_post_norm_out" if at else "branch_norm_out"] * (len(kinds) - at - 1)


def place_children(
    called: list[tuple[str, str]],
    hints: dict[str, str],
    around: bool = True,
    hidden_stream: frozenset[str] = frozenset(),
    attended: frozenset[str] = frozenset(),
    unattended: frozenset[str] = frozenset(),
) -> Placement:
    """Roles of a block's children from `called`: (attribute name, kind) in first-call order.

    A cross-attention branch (`CROSS`) is `cross_attn_out` and the others are placed without it.
    Order decides when it is one of the known forms, or pre-norm segments (each norm followed by
    its branches: ViT's `intermediate`, `output` after `layernorm_after`); otherwise the
    attribute-name hints name what they can; when they cannot name every child and no child is a
    norm by its parameters only (low precision can hide a norm's rows), an attending first branch
    and the MLP in parts after it (`_attention_first`) decide; where no hint placed anything, the
    pre-norm pairs around the attending child (`_around_attention`); else the rest is unplaced (it
    keeps `{child}.out`). `around`: False for the children without the cross-attention, whose
    branches read around no attention (the cross-attention was the block's only one: a joint
    block's two MLPs are not its attention and MLP). `hidden_stream`: the children whose input
    has the block's hidden-state token count and not the encoder states' (which stream a joint
    block's branch reads); `attended`: the children in which an attention kernel ran;
    `unattended`: children watched for one in which none ran. A name hint makes no such child the
    attention (SwiftFormer's additive `attn`: its port, renamed, cannot read as that, so neither
    does the original, and both keep their paths)."""
    cross = [n for n, k in called if k == CROSS]
    if len(cross) == 1:  # a joint block (SD3: one attention over both streams) does not place by order
        rest = place_children([(n, k) for n, k in called if k != CROSS], hints, around=False)
        if rest.by_order:
            return Placement({**rest.names, cross[0]: "cross_attn_out"}, rest.unplaced, True)
        own = _own_norm(called, cross[0])
        if own is not None:  # a decoder's cross-attention with its own norm (post-norm ProphetNet)
            rest = place_children(
                [(n, k) for n, k in called if n not in (cross[0], own)], hints, around=False
            )
            if rest.by_order:
                names = {**rest.names, cross[0]: "cross_attn_out", own: f"{own}.out"}
                return Placement(names, (*rest.unplaced, own), True)
    attends = [n for n, k in called if k == ATTENTION]
    shaped = {n for n, k in called if k == NORM_SHAPED}
    if shaped:  # a norm's parameters whose rows low precision or a large eps hid: a norm first
        as_norms = _plain_kinds(called, NORM)
        roles = _sequence_roles([k for _, k in as_norms]) or _segment_roles(as_norms)
        if roles is not None:
            return Placement(dict(zip((n for n, _ in as_norms), roles)), (), True)
    plain = _plain_kinds(called, BRANCH)
    roles = _sequence_roles([k for _, k in plain]) or _segment_roles(plain)
    if roles is not None:
        return Placement(dict(zip((n for n, _ in plain), roles)), (), True)
    names: dict[str, str] = {}
    unplaced = []
    kinds = dict(called)
    for child, _kind in plain:
        stage = hints.get(child)
        if stage == "attn_out" and child in unattended and kinds[child] == BRANCH:
            stage = None  # a name no kernel confirms
        if stage is None or stage in names.values():
            names[child] = f"{child}.out"
            unplaced.append(child)
        else:
            names[child] = stage
    if unplaced and not shaped:  # names that do not place every child: what the children did
        roles = _attention_first(plain, attends, unseen=len(unplaced) == len(plain))
        if roles is not None:
            return Placement(dict(zip((n for n, _ in plain), roles)), (), True)
    if around and unplaced and len(unplaced) < len(called) and hints:
        # names that place some children only: what the children did, read without the names,
        # where it places more and agrees with every name placed (a DiT block's `ff` alone: its
        # adaptive norm, `attn1` and `norm3` by order; Mochi's `attn1` as its one attention), so
        # that a renamed port reads as its original
        blind = place_children(called, {}, around, hidden_stream, attended)
        agrees = all(blind.names[c] == names[c] for c, _ in plain if c not in unplaced)
        if agrees and len(blind.unplaced) < len(unplaced):
            return blind
    if around and unplaced and len(unplaced) == len(called):  # hints placed nothing
        found = _around_attention(called) or _one_attention(called, hidden_stream, attended)
        if found is not None:
            return found
    return Placement(names, tuple(unplaced), False)


def _own_norm(called: list[tuple[str, str]], child: str) -> str | None:
    """The norm that belongs to branch `child`: right before it in a pre-norm block (one that
    starts with a norm), right after it in a post-norm one; None when that child is no norm."""
    at = [n for n, _ in called].index(child)
    near = at - 1 if called[0][1] in (NORM, NORM_LED) else at + 1
    if 0 <= near < len(called) and called[near][1] == NORM:
        return called[near][0]
    return None


def _plain_kinds(called: list[tuple[str, str]], shaped_as: str) -> list[tuple[str, str]]:
    """`called` in the two kinds the order forms read: a cross-attention, attending or norm-led
    child is a branch; a norm-shaped one is `shaped_as` (a norm when tried as one first)."""
    return [
        (n, shaped_as if k == NORM_SHAPED else BRANCH if k in (CROSS, ATTENTION, NORM_LED) else k)
        for n, k in called
    ]


def _around_attention(kinds: list[tuple[str, str]]) -> Placement | None:
    """The attending child (its kernel was seen) right after a norm, with that norm, and the first
    norm-then-branch pair after it (the MLP and its norm), a norm-led child (a gated norm) standing
    as a norm: the four pre-norm roles. Children outside those pairs (hyper-connection mixers,
    short convolutions, extra gates) keep `{child}.out` and are listed as unplaced. Where no child
    attended (a linear-attention mixer), the first branch after a norm stands for it, and only
    norms may be left over (an embedding norm of the first block). Only for a block no name hint
    placed anything in. A self-attention beside a cross-attention (a decoder's, fed the encoder's
    states) is the block's attention and every other child keeps its path: what the names place in
    such a block (`self_attn` alone), so a renamed port reads as its original. Of several children
    that attend without encoder states, the one right after a norm is the attention (an input
    mixer that attends before it keeps its path)."""
    norms = (NORM, NORM_LED)
    selfs = [n for n, k in kinds if k == ATTENTION]
    if len(selfs) == 1 and any(k == CROSS for _, k in kinds):
        rest = [n for n, _ in kinds if n != selfs[0]]
        return Placement(
            {n: "attn_out" if n == selfs[0] else f"{n}.out" for n, _ in kinds}, tuple(rest), False
        )
    attends = bool(selfs)
    mixer = ATTENTION if attends else BRANCH
    led = [i for i, (_, k) in enumerate(kinds) if k == mixer and i > 0 and kinds[i - 1][1] in norms]
    if attends and len(led) > 1:
        return _pre_norm_pairs(kinds)
    if not led or (attends and len(led) != 1):
        return None
    at = led[0]
    after = next(
        (
            i
            for i in range(at + 1, len(kinds) - 1)
            if kinds[i][1] in norms and kinds[i + 1][1] in (BRANCH, NORM_LED)
        ),
        None,
    )
    if after is None:
        return None
    placed = {
        kinds[at - 1][0]: "attn_norm_out",
        kinds[at][0]: "attn_out",
        kinds[after][0]: "ffn_norm_out",
        kinds[after + 1][0]: "ffn_out",
    }
    rest = [n for n, _ in kinds if n not in placed]
    if not attends and any(k != NORM for n, k in kinds if n in rest):
        return None
    return Placement({**placed, **{n: f"{n}.out" for n in rest}}, tuple(rest), True)


def _pre_norm_pairs(kinds: list[tuple[str, str]]) -> Placement | None:
    """A block of pre-norm pairs only (norm, branch; norm, branch; ...) with several attending
    branches and a last branch that does not attend (diffusers' BasicTransformerBlock with two
    self-attentions, `norm1 attn1 norm2 attn2 norm3 ff`): the first pair is the attention and its
    norm, the last the MLP and its norm; the pairs between keep their paths."""
    norms = (NORM, NORM_LED)
    pairs = [kinds[i : i + 2] for i in range(0, len(kinds), 2)]
    if len(kinds) % 2 or len(pairs) < 3 or any(p[0][1] not in norms for p in pairs):
        return None
    if pairs[0][1][1] != ATTENTION or pairs[-1][1][1] not in (BRANCH, NORM_LED):
        return None
    placed = {
        pairs[0][0][0]: "attn_norm_out",
        pairs[0][1][0]: "attn_out",
        pairs[-1][0][0]: "ffn_norm_out",
        pairs[-1][1][0]: "ffn_out",
    }
    rest = tuple(n for n, _ in kinds if n not in placed)
    return Placement({**placed, **{n: f"{n}.out" for n in rest}}, rest, True)


def _one_attention(
    called: list[tuple[str, str]], hidden_stream: frozenset[str], attended: frozenset[str]
) -> Placement | None:
    """A block no order form reads and no name placed, with one attention: it is `attn_out`, what
    the attribute names (`attn`) place in diffusers' blocks, and the other children keep their
    paths (a single-stream block's adaptive norm and parallel projections around it). In a joint
    block (SD3, Flux: the one attention over both streams is fed the encoder's states) the branch
    after it that reads the block's hidden stream (its token count) is the image stream's MLP,
    `ffn_out` (`ff` there); the context stream's MLP keeps its path. None unless exactly one child
    attends."""
    attending = [i for i, (n, k) in enumerate(called) if k == ATTENTION or (k == CROSS and n in attended)]
    if len(attending) != 1:
        return None
    at = attending[0]
    placed = {called[at][0]: "attn_out"}
    if called[at][1] == CROSS:
        mlps = [n for n, k in called[at + 1 :] if k in (BRANCH, NORM_LED) and n in hidden_stream]
        if len(mlps) == 1:
            placed[mlps[0]] = "ffn_out"
    rest = tuple(n for n, _ in called if n not in placed)
    return Placement({**placed, **{n: f"{n}.out" for n in rest}}, rest, False)


def _attention_first(
    called: list[tuple[str, str]], attends: list[str], unseen: bool = False
) -> list[str] | None:
    """One branch attends (its kernel was seen; or, with `unseen`, none was and a norm sits between
    the branches: longformer's chunked products, read by order as the two-branch forms are, only
    where no name hint placed anything) and is the first branch; the branches after it,
    with no norm between them, are the MLP in parts (BERT's `intermediate` / `output`, BART's
    `fc1` / `fc2`, whatever their names). Named as the two-branch forms of `_sequence_roles` name
    the block with the parts taken as one branch: its last part is `ffn_out`, the others keep
    `{child}.out` as parts of it."""
    branches = [i for i, (_, k) in enumerate(called) if k == BRANCH]
    if len(attends) > 1 or len(branches) < 3 or (attends and called[branches[0]][0] != attends[0]):
        return None
    if not attends and not (unseen and any(k == NORM for _, k in called[branches[0] : branches[1]])):
        return None
    parts = branches[1:]
    if parts != list(range(parts[0], parts[-1] + 1)):
        return None  # a norm among the MLP's parts: not this form
    merged = [k for i, (_, k) in enumerate(called) if i not in parts[:-1]]
    roles = _sequence_roles(merged)
    if roles is None:
        return None
    it = iter(roles)
    return [f"{child}.out" if i in parts[:-1] else next(it) for i, (child, _) in enumerate(called)]


def _segment_roles(called: list[tuple[str, str]]) -> list[str] | None:
    """Two pre-norm segments (norm, then one or more branches): the last branch of each is the
    attention's / MLP's output, earlier ones keep `{child}.out` as parts of it."""
    kinds = [k for _, k in called]
    starts = [i for i, k in enumerate(kinds) if k == NORM]
    if len(starts) != 2 or starts[0] != 0 or kinds.count(BRANCH) != len(kinds) - 2:
        return None
    segments = [range(starts[0], starts[1]), range(starts[1], len(kinds))]
    if any(len(seg) < 2 for seg in segments):
        return None
    names: list[str] = []
    for seg, (norm, out) in zip(segments, (("attn_norm_out", "attn_out"), ("ffn_norm_out", "ffn_out"))):
        for i in seg:
            names.append(norm if i == seg[0] else out if i == seg[-1] else f"{called[i][0]}.out")
    return names
