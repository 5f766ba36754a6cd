"""Packed `[tokens, ...]` against padded `[batch, seq, ...]` (docs/comparing.md "Comparing").

An engine that packs its batch runs `[T, hidden]` where a padded reference runs `[B, S, hidden]`.
Which of the padded side's B·S positions are tokens comes from what was recorded at the first
call: the padded side's attention mask (`embed.attention_mask`, recorded from the root's
`attention_mask`), else the packed side's sequence lengths (`ffdebug.tap("embed.seq_lens", lens)`;
then each sequence fills the first `lens[b]` positions of its row). When the mask has T tokens and
the trailing dims agree, the padded side's tokens (row-major: batch, then position) are compared
with the packed side's rows (a packed side run as one batch row, `[1, T, ...]`, is read as
`[T, ...]`), and a token-by-token stage (attention probabilities `[B, H, S, S]`) is compared on
each sequence's diagonal block of the packed `[H, T, T]` (`diagonal_blocks`). Any other shape difference stays a shape mismatch: nothing is
reshaped without a mask that explains it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MASK_KEY = "embed.attention_mask"
LENS_KEY = "embed.seq_lens"


@dataclass(frozen=True)
class TokenLayout:
    """What says which positions of one side's padded batch are tokens."""

    mask: object = None  # Record: this side's attention mask
    peer_lens: object = None  # Record: the other (packed) side's sequence lengths

    def mask_for(self, batch: int, seq: int):
        """A [batch, seq] bool mask, or None when nothing recorded gives one."""
        import numpy as np

        if self.mask is not None and self.mask.has_payload:
            return self.mask.load().astype(bool)
        if self.peer_lens is not None and self.peer_lens.has_payload:
            lens = self.peer_lens.load().reshape(-1).astype(np.int64)
            if lens.size == batch and int(lens.max()) <= seq and int(lens.min()) >= 0:
                return np.arange(seq)[None, :] < lens[:, None]
        return None

    def __bool__(self) -> bool:
        return self.mask is not None or self.peer_lens is not None


def layouts(ref_group, tgt_group) -> tuple[TokenLayout, TokenLayout]:
    """The token layouts of a paired call's two sides."""
    return (
        TokenLayout(ref_group.token_mask, tgt_group.seq_lens),
        TokenLayout(tgt_group.token_mask, ref_group.seq_lens),
    )


def one_row(packed, padded):
    """A packed side run as one batch row, `[1, T, ...]` (HF's padding-free form), as `[T, ...]`
    against a padded `[B, S, ...]` of several rows; else `packed` as it is."""
    if packed.ndim >= 2 and padded.ndim >= 3 and packed.shape[0] == 1 and padded.shape[0] > 1:
        return packed[0]
    return packed


def packed_view(padded, packed, mask):
    """`padded`'s token rows in packed order, or None when `mask` does not explain the shapes."""
    if mask is None or mask.ndim != 2 or padded.ndim < 2 or tuple(padded.shape[:2]) != tuple(mask.shape):
        return None
    if packed.ndim < 1 or packed.shape[0] != int(mask.sum()):
        return None
    if tuple(packed.shape[1:]) != tuple(padded.shape[2:]):
        if math.prod(packed.shape[1:]) != math.prod(padded.shape[2:]):
            return None
        # one token's features in another grouping ([T, H·D] against [B, S, H, D]): the same
        # row-major elements, compared in the padded side's (its heads stay heads: `_align`
        # reads the packed side in that grouping)
    return padded[mask.astype(bool)]


def diagonal_blocks(padded, packed, mask):
    """(padded, packed) as each sequence's `[…, l, l]` block, flattened and laid end to end, for a
    token-by-token stage (attention probabilities `[B, H, S, S]` against a packed `[H, T, T]`, a
    `[1, H, T, T]` read through `one_row`): sequence b's block of the packed side is rows and
    columns `o_b … o_b + l_b` of its diagonal; None when the shapes are not that."""
    import numpy as np

    if mask is None or mask.ndim != 2 or padded.ndim < 3 or tuple(padded.shape[:1]) != (mask.shape[0],):
        return None
    b, s = mask.shape
    if tuple(padded.shape[-2:]) != (s, s):
        return None
    mid = tuple(padded.shape[1:-2])
    total = int(mask.sum())
    if tuple(packed.shape) != (*mid, total, total):
        return None
    ref_blocks, tgt_blocks, offset = [], [], 0
    for row in range(b):
        idx = np.flatnonzero(mask[row])
        n = idx.size
        block = np.take(np.take(padded[row], idx, axis=-2), idx, axis=-1)
        ref_blocks.append(block.reshape(*mid, n * n))
        tgt_blocks.append(packed[..., offset : offset + n, offset : offset + n].reshape(*mid, n * n))
        offset += n
    return np.concatenate(ref_blocks, -1), np.concatenate(tgt_blocks, -1)


def align(r, t, ref_layout: TokenLayout, tgt_layout: TokenLayout):
    """(ref, target, note, coords) with the padded side reduced to its tokens, or None; `coords`
    `[T, 2]` is each packed row's (sequence, position) in the padded side's batch.

    Heads before tokens on either side (`[B, H, S, D]`, a packed `[1, H, T, D]`: the layout an
    attention kernel reads) are read token first (`_heads_second`) when the shapes say so."""
    found = _align(r, t, ref_layout, tgt_layout)
    if found is not None or r.ndim != 4 or t.ndim != 4:
        return found
    for rr, tt, how in _heads_second(r, t):
        found = _align(rr, tt, ref_layout, tgt_layout)
        if found is not None:
            return (*found[:2], f"{found[2]} ({how})", found[3])
    return None


def _heads_second(r, t):
    """(ref, target, note) with one or both sides' dims 1 and 2 swapped, the head-first side read
    as `[B, S, H, D]` / `[1, T, H, D]`: only where the swapped side's dim 1 is the other's head count
    (dim 2 of a token-first side, dim 1 of a head-first one)."""
    swapped = r.swapaxes(1, 2), t.swapaxes(1, 2)
    if r.shape[1] == t.shape[2]:  # the reference head-first, the target token-first
        yield swapped[0], t, "reference heads first"
    if t.shape[1] == r.shape[2]:
        yield r, swapped[1], "target heads first"
    if r.shape[1] == t.shape[1]:
        yield swapped[0], swapped[1], "both heads first"


def _align(r, t, ref_layout: TokenLayout, tgt_layout: TokenLayout):
    import numpy as np

    for side, padded, packed, layout in (("reference", r, t, ref_layout), ("target", t, r, tgt_layout)):
        if not layout or padded.ndim < 2:
            continue
        mask = layout.mask_for(padded.shape[0], padded.shape[1])
        packed = one_row(packed, padded)
        sel = packed_view(padded, packed, mask)
        if sel is not None:
            packed = packed.reshape(sel.shape)
            note = f"aligned: {side} {list(padded.shape)} padded -> {list(sel.shape)} packed"
            coords = np.argwhere(mask.astype(bool))
            return (sel, packed, note, coords) if side == "reference" else (packed, sel, note, coords)
        blocks = diagonal_blocks(padded, packed, layout.mask_for(padded.shape[0], padded.shape[-1]))
        if blocks is not None:
            note = (
                f"aligned: {side} {list(padded.shape)} padded -> each sequence's diagonal block of the "
                f"packed {list(packed.shape)}"
            )
            return (*blocks, note, None) if side == "reference" else (blocks[1], blocks[0], note, None)
    return None


ROUTED_KEY = "tokens"  # a record's extra: the token row (of the branch input) each of its rows holds


def by_routed_tokens(r, t, tokens_ref, tokens_target):
    """(ref, target, note) with an expert's rows compared token by token, or None.

    An expert's stages hold the rows of the tokens routed to it, in the order its side gathered
    them (`ffdebug.capture.substages` records which token each row is). When the two sides routed
    other tokens there (a routing flip, another capacity rule) or gathered them in another order,
    the rows of the tokens both sides routed to the expert are compared, in token order; the
    tokens only one side routed there are named in the note (their routing is judged at the
    router's stages, not here). None when the lists agree or do not describe the rows."""
    import numpy as np

    tr, tt_ = [int(x) for x in tokens_ref], [int(x) for x in tokens_target]
    if tr == tt_ or r.ndim < 1 or t.ndim < 1 or r.shape[0] != len(tr) or t.shape[0] != len(tt_):
        return None
    if tuple(r.shape[1:]) != tuple(t.shape[1:]) or len(set(tr)) != len(tr) or len(set(tt_)) != len(tt_):
        return None
    common = sorted(set(tr) & set(tt_))
    if not common:
        return None
    at_r, at_t = {tok: i for i, tok in enumerate(tr)}, {tok: i for i, tok in enumerate(tt_)}
    ir = np.array([at_r[x] for x in common], dtype=np.int64)
    it = np.array([at_t[x] for x in common], dtype=np.int64)
    only_r, only_t = sorted(set(tr) - set(tt_)), sorted(set(tt_) - set(tr))
    parts = [f"rows compared by routed token: the {len(common)} token(s) both sides routed here"]
    if only_r:
        parts.append(f"reference only: {_few(only_r)}")
    if only_t:
        parts.append(f"target only: {_few(only_t)}")
    if not (only_r or only_t):
        parts.append("gathered in another order")
    return r[ir], t[it], "; ".join(parts)


def packed_tokens(tokens: list, layout: TokenLayout) -> list | None:
    """Token ids of one side's padded batch (row-major positions of its `[B, S]` mask) as their
    index among the batch's tokens, pads dropped: the numbering a packed side uses. The ids as
    given when the side records no mask; None when the ids do not fit the mask."""
    import numpy as np

    if layout.mask is None or not layout.mask.has_payload:
        return list(tokens)
    mask = layout.mask.load().astype(bool).reshape(-1)
    if any(int(x) >= mask.size or int(x) < 0 for x in tokens):
        return None
    index = mask.astype(np.int64).cumsum() - 1
    return [int(index[int(x)]) for x in tokens if bool(mask[int(x)])]


def _few(tokens: list[int], cap: int = 8) -> str:
    head = ", ".join(map(str, tokens[:cap]))
    return head + (f" (+{len(tokens) - cap} more)" if len(tokens) > cap else "")


def routed_rows(rt, tt, routed: tuple[list, list], masks: tuple[TokenLayout, TokenLayout]):
    """An expert's rows on both sides by the token each holds (`by_routed_tokens`), the
    token ids of a padded side first numbered as a packed side numbers them (`packed_tokens`:
    through its own mask, when it recorded one); None when nothing needs aligning."""
    ids = [packed_tokens(tokens, layout) for tokens, layout in zip(routed, masks)]
    if any(x is None for x in ids) or any(len(x) != n for x, n in zip(ids, (rt.shape[0], tt.shape[0]))):
        ids = list(routed)  # pads among the rows, or ids beyond the mask: compared as recorded
    return by_routed_tokens(rt, tt, *ids) if ids[0] != ids[1] else None
