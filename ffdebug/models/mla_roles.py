"""Role sub-stages of a low-rank (multi-head latent, MLA) attention branch (docs/dumping.md "Role sub-stages").

DeepSeek-V2 / V3-style attention projects its input down to latents before the heads:

    q_latent          = W_qa · x                      [B, S, r_q]      (absent without a q latent: q = W_q · x)
    kv_latent, k_rope = split(W_kva · x)              [B, S, r_kv], [B, S, d_rope]
    q                 = W_qb · norm(q_latent)         [B, S, H, d_nope + d_rope]
    k_nope, v         = split(W_kvb · norm(kv_latent)) [B, S, H, d_nope], [B, S, H, d_v]

`attention_substages` hands a branch here when it runs projections of something other than its
input before the output projection (the up-projections `W_qb`, `W_kvb`). Which is which is read
from the structure, never from names: the projection of the input whose output the branch splits
into two or more pieces carries the kv latent and, as its last piece, the rotary part of the key
(HF's `kv_a_proj_with_mqa` → [kv_latent | k_rope]; an engine's fused `q_a | kv_a` → [q_latent |
kv_latent | k_rope]); `W_kvb` is the up-projection that reads the kv latent's width (the later one
when both latents have it), `W_qb` the other, and the q latent the input piece of `W_qb`'s width.

| key | what it is |
|---|---|
| `attn.latent.in` | what the input projections read (one record for `q_a` and `kv_a`, fused or not) |
| `attn.q_latent`, `attn.kv_latent`, `attn.k_rope` | the down-projections' outputs (pieces of a fused one) |
| `attn.q_latent_norm`, `attn.kv_latent_norm` | the normalised latents the up-projections read |
| `attn.q` | the up-projected q, `[B, S, H, d_nope + d_rope]` |
| `attn.k_nope`, `attn.v` | the pieces of the kv up-projection, split the way the branch splits it |
| `attn.context`, `attn.o` | as for any attention |

An absorbed port (the kv up-projection folded into q and the output: no projection reads the kv
latent; per-head `W_kc` / `W_vc` batched matmuls map q_nope into the latent space and the latent
attention back to values) never makes the normalised kv latent's up-projection, k_nope or v. That
side holds `attn.q_absorbed` and `attn.context_latent` instead and declares the difference in
run.json (`form_stages`: `ABSORBED`'s `lacks` / `adds`); coverage excuses exactly those kinds, and
says so. `attn.q_rot` / `attn.k_rot` are the rope parts (`capture.kernel_taps`), which both forms
hold alike.
"""

from __future__ import annotations

from ffdebug.models.subroles import (
    BranchTrace,
    Dims,
    LinearCall,
    SubStage,
    _heads_of,
    _parts,
    _stage,
    leading_shape,
)

LATENT_INPUT = "attn.latent"  # the `.in` name the down-projections share


def _segments(ins: list[LinearCall]) -> list[tuple[object, dict, LinearCall, int]]:
    """Each input projection's output, or its pieces when the branch split it: (tensor, split
    fields, call, number of pieces of that call)."""
    out = []
    for c in ins:
        parts = _parts(c, len(c.pieces)) if len(c.pieces) >= 2 else None
        if parts is None:
            out.append((c.y, {}, c, 1))
        else:
            out += [(t, split, c, len(parts)) for t, split, _ in parts]
    return out


def _normalised_from(piece, x) -> bool:
    """`x` is `piece` normalised row by row with a per-channel weight (`w ⊙ piece / rms(row)`):
    x / piece has rank one, every row the same profile across channels (to 1e-3, or to four
    roundings of the coarser of the two dtypes: a bf16 latent and its bf16 norm differ by those)."""
    import torch

    if piece.numel() != x.numel() or piece.shape[-1] != x.shape[-1] or piece.shape[-1] < 2:
        return False  # the same rows, whatever the leading dims (a `[B, 1, S, r]` latent)
    eps = max(torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0 for t in (piece, x))
    rtol = max(1e-3, 4 * eps)
    p = piece.detach().double().reshape(-1, piece.shape[-1])
    q = x.detach().double().reshape(-1, x.shape[-1])
    if not bool((p.abs() > 1e-12).all()) or not bool((q[:, :1].abs() > 1e-300).all()):
        return False
    ratio = q / p
    profile = ratio / ratio[:, :1]
    return bool(torch.allclose(profile, profile[:1].expand_as(profile), rtol=rtol, atol=1e-6))


def low_rank(ins: list[LinearCall], inner: list[LinearCall], hidden: int) -> bool:
    """A low-rank (MLA) attention: an input projection the branch splits into pieces, one of which
    is as wide as the input of a projection up from a latent narrower than the hidden size
    (`ffdebug.models.mla_roles`), and which leaves a kv latent and its rotary key: two pieces after
    it (it is the q latent of `[q_latent | kv_latent | k_rope]`), or one when a single projection
    reads it up normalised and is split again (`W_kvb` into k_nope | v, from `[kv_latent |
    k_rope]`; a latent two projections read up is a q latent, as q's and a sparse indexer's). A q
    latent fused with one plain key projection (`[q_latent | kv]`, no kv latent) is not one:
    unfused, the same branch is a low-rank q beside a plain kv, never split, and both readings
    must agree. Cross-attention's k / v read the encoder's states, not a piece."""
    for c in ins:
        parts = _parts(c, len(c.pieces)) if len(c.pieces) >= 2 else None
        for j, (t, _, _) in enumerate(parts or []):
            w, after = t.shape[-1], len(parts) - j - 1
            ups = [u for u in inner if u.in_features == w < hidden]
            if ups and after >= 2:
                return True
            read = [u for u in ups if _normalised_from(t, u.x)]
            if after == 1 and len(read) == 1 and len(read[0].pieces) >= 2:
                return True
    return False


def _carrier(
    split_calls: list[LinearCall], segs: list, inner: list[LinearCall], dims: Dims | None
) -> tuple[LinearCall, int]:
    """The split input projection that carries the kv latent, and the kv latent's place among its
    pieces (the rotary key is the piece after it): the last projection whose next-to-last piece an
    up-projection reads normalised (another split projection of the input, such as a sparse
    attention's fused indexer keys | weights, is not it); else, where the config gives the latent
    and rotary widths, the piece of the latent's width followed by one of the rotary width (a gate
    fused after them: `[q | kv_latent | k_rope | g]`); else the last split one, its next-to-last."""
    owned = [(call, [s for s in segs if s[2] is call]) for call in reversed(split_calls)]
    for call, own in owned:
        if len(own) >= 2 and any(_normalised_from(own[-2][0], c.x) for c in inner):
            return call, len(own) - 2
    if dims is not None and dims.kv_rank and dims.rope_dim:
        for call, own in owned:
            widths = [s[0].shape[-1] for s in own]
            for j in range(len(own) - 1):
                if (widths[j], widths[j + 1]) == (dims.kv_rank, dims.rope_dim):
                    return call, j
    call, own = owned[0]
    return call, len(own) - 2


def _whole_q(ins: list[LinearCall], carrier: LinearCall, before: list) -> tuple | None:
    """Without a q latent, q's segment: the piece before the kv latent when one projection makes
    `[q | kv_latent | k_rope …]` (an engine's fused one; `before`: the carrier's pieces before the
    kv latent), else the first other input projection's whole output — never a piece the branch
    cut it into afterwards (its per-head nope / rope split)."""
    if before:
        return before[-1]
    other = next((c for c in ins if c is not carrier), None)
    return None if other is None else (other.y, {}, other, 1)


def mla_substages(
    trace: BranchTrace,
    ins: list[LinearCall],
    inner: list[LinearCall],
    o: LinearCall | None,
    heads: int | None,
    dims: Dims | None = None,
) -> list[SubStage]:
    """The module table's stages for one call of a low-rank attention branch."""
    segs = _segments(ins)
    split_calls = [c for c in ins if any(s[2] is c and s[3] >= 2 for s in segs)]
    if not split_calls:
        trace.notes.append("a low-rank attention whose kv latent and rotary key part were not split apart")
        return []
    carrier, at = _carrier(split_calls, segs, inner, dims)
    own = [s for s in segs if s[2] is carrier]
    kv_seg, rope_seg = own[at], own[at + 1]
    kv_width = kv_seg[0].shape[-1]
    kv_b = next((c for c in reversed(inner) if c.in_features == kv_width), None)  # None: absorbed
    q_b = next((c for c in inner if c is not kv_b), None)
    out: list[SubStage] = []

    def down(kind, seg):
        t, split, call, _ = seg
        s = _stage(kind, t, call, trace, split=split or None)
        s.extra["in_name"] = LATENT_INPUT
        out.append(s)

    q_seg = None
    if q_b is not None:
        q_seg = next((s for s in segs if s is not kv_seg and s[0].shape[-1] == q_b.in_features), None)
    elif len(segs) > 2:  # no q latent: q is a projection of the input itself, whole
        q_seg = _whole_q(ins, carrier, own[:at])
    if q_seg is not None:
        down("attn.q_latent" if q_b is not None else "attn.q", q_seg)
    down("attn.kv_latent", kv_seg)
    down("attn.k_rope", rope_seg)
    if q_b is not None:
        out.append(SubStage("attn.q_latent_norm", leading_shape(q_b.x, trace), q_b.index, q_b.path, {}))
        out.append(
            _stage("attn.q", q_b.y, q_b, trace, heads, _per_head(q_b.out_features, heads), reads=False)
        )
    if kv_b is None:
        out += _absorbed(trace, o)
    else:
        out += _kv_up(trace, kv_b, heads)
    if o is not None:
        out.append(_stage("attn.context", o.x, o, trace, heads, _per_head(o.in_features, heads), reads=False))
        out.append(_stage("attn.o", o.y, o, trace))
    return out


def _kv_up(trace: BranchTrace, kv_b: LinearCall, heads: int | None) -> list[SubStage]:
    """The unabsorbed form: the normalised kv latent and the k_nope / v pieces of its up-projection."""
    out = [SubStage("attn.kv_latent_norm", leading_shape(kv_b.x, trace), kv_b.index, kv_b.path, {})]
    parts = _parts(kv_b, 2)
    if parts is None:
        trace.notes.append(
            f"{kv_b.path}: its k_nope / v pieces were not taken apart by a split the branch made"
        )
    else:
        for kind, (t, split, piece) in zip(("attn.k_nope", "attn.v"), parts):
            out.append(_stage(kind, t, kv_b, trace, *_heads_of(piece, heads, None), split=split, reads=False))
    return out


ABSORBED = {
    "form": "absorbed low-rank attention (the kv up-projection folded into q and the output)",
    "lacks": ["attn.kv_latent_norm.out", "attn.k_nope.out", "attn.v.out"],
    "adds": ["attn.q_absorbed.out", "attn.context_latent.out"],
}


def _absorbed(trace: BranchTrace, o: LinearCall | None) -> list[SubStage]:
    """The absorbed form: no projection reads the kv latent; per-head projections (a batched
    matmul over a `[H, ...]` weight, one call per head) map q_nope into the latent space before
    the kernel (`attn.q_absorbed`, `[B, S, H, r_kv]`) and the attention over latents back to
    values after it (`attn.context_latent`: what that second run reads). The stages the form
    cannot hold are declared (`ABSORBED`, in run.json's `form_stages`), so coverage excuses them."""
    import torch

    runs: list[list[LinearCall]] = []
    for c in trace.calls:
        if c.expert is None or (o is not None and c.index > o.index):
            continue
        if not runs or c.expert <= runs[-1][-1].expert:
            runs.append([])
        runs[-1].append(c)
    trace.form = ABSORBED
    out = []
    for kind, run, side in zip(("attn.q_absorbed", "attn.context_latent"), runs, ("y", "x")):
        heads = torch.stack([getattr(c, side) for c in run], dim=-2)  # [T, H, width]
        t = heads.reshape(*trace.lead, *heads.shape[-2:]) if heads.dim() == 3 else heads
        covers = tuple(c.index for c in run)
        extra = {"heads": len(run), "orig_shape": list(heads.shape)}
        out.append(
            SubStage(
                kind, t, run[-1].index if side == "y" else run[0].index, run[0].path, extra, covers=covers
            )
        )
    return out


def _per_head(width: int, heads: int | None) -> int | None:
    return width // heads if heads and width % heads == 0 else None
