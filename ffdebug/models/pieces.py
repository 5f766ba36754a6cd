"""Columns of a fused projection's output, as role sub-stages name them (`ffdebug.models.subroles`):
the `split` / `split_cols` fields of a piece, and the columns no role took.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ffdebug.models.subroles import LinearCall, SubStage


def split_fields(cols) -> dict:
    """`split: [lo, hi]` for a contiguous block of output columns, else `split_cols`: the runs of
    consecutive columns, in the piece's order (e.g. one [lo, hi] per head of a per-head layout)."""
    runs: list[list[int]] = []
    for c in cols.tolist():
        if runs and runs[-1][1] == c:
            runs[-1][1] = c + 1
        else:
            runs.append([c, c + 1])
    return {"split": runs[0]} if len(runs) == 1 else {"split_cols": runs}


def untaken_piece(call: LinearCall, stages: list[SubStage]) -> tuple[object, dict] | None:
    """The columns of a split projection's output that no stage of it holds, as (tensor, split
    fields), when they are one contiguous run of whole pieces the branch took; else None (every
    column held, a stage holding the whole output, or no split seen)."""
    import torch

    if len(call.pieces) < 2:
        return None
    held: set[int] = set()
    for st in stages:
        if st.at != call.index and call.index not in st.covers:
            continue
        if st.module_path != call.path or st.io != "out":
            continue
        runs = st.extra.get("split_cols") or ([st.extra["split"]] if "split" in st.extra else None)
        if runs is None:
            return None  # the whole output is a stage
        held |= {c for lo, hi in runs for c in range(lo, hi)}
    if not held:
        return None
    free = [p for p in call.pieces if not held & set(p.cols.tolist())]
    cols = sorted(c for p in free for c in p.cols.tolist())
    if not cols or cols != list(range(cols[0], cols[-1] + 1)):
        return None
    flat = call.y.reshape(-1, call.out_features)[:, cols[0] : cols[-1] + 1]
    piece = flat.reshape(*call.y.shape[:-1], len(cols))
    return piece, split_fields(torch.tensor(cols))


def flat_split(call: LinearCall) -> bool:
    """The branch took `call`'s output apart into contiguous runs of columns before any head view
    (a fused projection's members), every column in one of them."""
    if len(call.pieces) < 2 or sum(p.cols.numel() for p in call.pieces) != call.out_features:
        return False
    return all(
        len(p.feat_shape) == 1 and p.cols.numel() == int(p.cols[-1] - p.cols[0]) + 1 for p in call.pieces
    )
