"""Packed `[tokens, ...]` against padded `[batch, seq, ...]` (README "Comparing").

An engine that packs its batch runs `[T, hidden]` where a padded reference runs `[B, S, hidden]`.
The padded side's attention mask, recorded at its first call (`embed.attention_mask`), says which
of its B·S positions are tokens; when it has T of them and the trailing dims agree, the padded
side's tokens (row-major: batch, then position) are compared with the packed side's rows. Any other
shape difference stays a shape mismatch: nothing is reshaped without a mask that explains it.
"""

from __future__ import annotations

MASK_KEY = "embed.attention_mask"


def packed_view(padded, packed, mask):
    """`padded`'s token rows in packed order, or None when `mask` does not explain the shapes."""
    m = mask.bool()
    if m.dim() != 2 or padded.dim() < 2 or tuple(padded.shape[:2]) != tuple(m.shape):
        return None
    if packed.dim() != padded.dim() - 1 or packed.shape[0] != int(m.sum()):
        return None
    if tuple(packed.shape[1:]) != tuple(padded.shape[2:]):
        return None
    return padded[m]


def align(r, t, ref_mask, tgt_mask):
    """(ref, target, note) with the padded side reduced to its tokens, or None."""
    if ref_mask is not None:
        sel = packed_view(r, t, ref_mask.load())
        if sel is not None:
            return (
                sel,
                t,
                f"aligned: reference {list(r.shape)} padded -> {list(sel.shape)} packed by its attention mask",
            )
    if tgt_mask is not None:
        sel = packed_view(t, r, tgt_mask.load())
        if sel is not None:
            return (
                r,
                sel,
                f"aligned: target {list(t.shape)} padded -> {list(sel.shape)} packed by its attention mask",
            )
    return None
