"""The torch calls a branch trace watches (`ffdebug.capture.substages`), and the projection output
whose views a branch may take apart (a fused qkv / gate-up split into its pieces)."""

from __future__ import annotations

import math

from ffdebug.models.subroles import LinearCall, Piece

_ACTIVATIONS: tuple = ()


def activations() -> tuple:
    """Elementwise activations whose input marks an MLP's gate."""
    global _ACTIVATIONS
    if not _ACTIVATIONS:
        import torch
        import torch.nn.functional as F

        _ACTIVATIONS = (
            F.silu,
            F.gelu,
            F.relu,
            F.mish,
            F.elu,
            F.leaky_relu,
            torch.sigmoid,
            torch.Tensor.sigmoid,
            torch.tanh,
            torch.Tensor.tanh,
            torch.relu,
            torch.Tensor.relu,
        )
    return _ACTIVATIONS


def views() -> tuple:
    import torch

    return (torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.unflatten)


_CASTS: tuple = ()


def casts() -> tuple:
    """Calls that copy a tensor into another dtype (a router reading the branch input in fp32)."""
    global _CASTS
    if not _CASTS:
        import torch

        T = torch.Tensor
        _CASTS = (T.to, T.float, T.double, T.half, T.bfloat16, T.type, T.type_as)
    return _CASTS


def grouped_mms() -> tuple:
    """Grouped matmuls (one GEMM over every expert's rows; `F.grouped_mm` dispatches to it)."""
    import torch

    return tuple(f for f in (getattr(torch, "_grouped_mm", None),) if f is not None)


_SPLITS: tuple = ()


def splits() -> tuple:
    """Calls whose outputs are views of parts of their input (how a fused output is taken apart)."""
    global _SPLITS
    if _SPLITS:
        return _SPLITS
    import torch

    T = torch.Tensor
    _SPLITS = (
        T.split, torch.split, T.split_with_sizes, T.chunk, torch.chunk, T.unbind, torch.unbind,
        T.tensor_split, torch.tensor_split, T.narrow, torch.narrow, T.__getitem__,
    )  # fmt: skip
    return _SPLITS


class Output:
    """A projection output whose views the branch may take apart (see `piece`)."""

    def __init__(self, call: LinearCall, live) -> None:
        import torch

        self.call, self.live = call, live  # the live tensor: its storage is not reused meanwhile
        self.storage = live.untyped_storage().data_ptr()
        self.width = live.shape[-1]
        self.taken = torch.zeros(self.width, dtype=torch.bool)
        self._index = None

    def index(self):
        """Storage position -> flat index into the output (-1 where the storage holds no element)."""
        import torch

        if self._index is None:
            t = self.live
            self._index = torch.full(
                (t.untyped_storage().nbytes() // t.element_size(),), -1, dtype=torch.long
            )
            view = self._index.as_strided(t.shape, t.stride(), t.storage_offset())
            view.copy_(torch.arange(t.numel()).view(t.shape))
        return self._index

    def refine(self, views) -> bool:
        """A split of one piece into contiguous column runs that tile it exactly (an engine's fused
        `q_a | kv_a` read as two slices, the second then split into the kv latent and the rotary
        key): the piece is replaced by them, in place (True)."""
        found = [self._columns(v) for v in views]
        if len(found) < 2 or any(f is None for f in found):
            return False
        runs = [f[0] for f in found]
        if any(bool((r.diff() != 1).any()) for r in runs):
            return False  # a per-head split (a rotary part of every head) is no refinement
        import torch

        joined = torch.cat(runs)
        pieces = self.call.pieces
        for i, p in enumerate(pieces):
            if p.cols.numel() == joined.numel() and torch.equal(p.cols, joined):
                subs = [Piece(c, shape or (1,), v.data_ptr()) for (c, shape), v in zip(found, views)]
                pieces[i : i + 1] = subs
                return True
        return False

    def _columns(self, view) -> tuple | None:
        """(output columns, feature shape) a view holds when it keeps every token in order."""
        import torch

        if view.dtype != self.live.dtype or view.numel() == 0:
            return None
        flat = self.index().as_strided(view.shape, view.stride(), view.storage_offset()).squeeze()
        if flat.dim() == 0 or bool((flat < 0).any()):
            return None
        tok, col = flat // self.width, flat % self.width
        tok_dims, feat_dims = [], []
        for i in range(flat.dim()):
            if bool((col.diff(dim=i) == 0).all()):
                tok_dims.append(i)
            elif bool((tok.diff(dim=i) == 0).all()):
                feat_dims.append(i)
            else:
                return None
        feat_shape = tuple(flat.shape[i] for i in feat_dims)
        rows = flat.permute(*tok_dims, *feat_dims).reshape(-1, max(1, math.prod(feat_shape)))
        tokens = self.live.numel() // self.width
        if rows.shape[0] != tokens or not torch.equal(rows[:, 0] // self.width, torch.arange(tokens)):
            return None
        return rows[0] % self.width, feat_shape

    def piece(self, view) -> Piece | None:
        """The output columns a view of the output holds, when it keeps every token in order and
        takes columns no earlier piece took; else None. Token dims are those along which the
        column stays the same, feature dims those along which the token does."""
        found = self._columns(view)
        if found is None:
            return None
        cols, feat_shape = found
        if cols.numel() == self.width or bool(self.taken[cols].any()):  # the whole output is no piece
            return None
        self.taken[cols] = True
        return Piece(cols, feat_shape or (1,), view.data_ptr())
