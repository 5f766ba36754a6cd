"""Where inside a tensor the error sits (docs/comparing.md "Comparing"): per head, per token, and the
coordinate of the largest error named by its axes.

Layer stages are laid out by role (docs/dumping.md "Role sub-stages"): block stages `[batch, token,
channel]`, attention sub-stages `[batch, token, head, head_dim]`. For those layouts:

    per_token_rel[s] = ‖t[:, s] − r[:, s]‖ / ‖r[:, s]‖         (over batch, heads, channels)
    per_head_rel[h]  = ‖t[:, :, h] − r[:, :, h]‖ / ‖r[:, :, h]‖  (attention sub-stages only)

and the error "rises from token N" when token N is the first whose rel exceeds `RISE` x every
earlier token's (and earlier tokens exist): a window, a cache or a position offset that goes wrong
past some length. Only for stages that are not bit-equal.

Streamed like the metrics (`ffdebug.comparison.metrics`): the tensor is read as rows of its last
axis (channels, or a head's channels), whole rows at a time in blocks of at most CHUNK elements
copied into the thread's float64 work rows, where each row's ‖t − r‖² and ‖r‖² are summed; the
per-token and per-head sums add those row sums. Memory is the row sums (one float64 per token x
head x batch) whatever the stage's size — it was two whole-tensor float64 copies and two more
for the squares, and took 8-11 x as long as the metrics of the same pair (bench/README.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ffdebug._chunks import CHUNK, copy_in, one_blas_thread, work_rows

RISE = 10.0  # a token whose error is this many times every earlier token's starts a rise
RISE_HEADS = 10.0  # heads within this factor of the worst head are named as the wrong ones


@dataclass(frozen=True)
class Where:
    """The breakdown of one stage's error (None where the layout does not say)."""

    axes: tuple[str, ...]
    per_token_rel: list[float | None]
    per_head_rel: list[float | None] | None
    rise_from: int | None
    token_sums: tuple | None = None  # (Σ(t − r)², Σ r²) per [batch, token], for the token runs


def axes_of(key: str, shape: list[int] | None) -> tuple[str, ...] | None:
    """The axis names of a layer stage's layout, None for other stages or shapes."""
    if shape is None or not key.startswith("L"):
        return None
    if len(shape) == 4 and ".attn." in f".{key.split('.', 1)[-1]}":
        return ("batch", "token", "head", "channel")
    if len(shape) == 3:
        return ("batch", "token", "channel")
    return None


def _rel(diff2, ref2) -> list[float | None]:
    return [
        math.sqrt(float(d) / float(r)) if float(r) > 0 else (0.0 if float(d) == 0 else None)
        for d, r in zip(diff2, ref2)
    ]


def _rise(per_token: list[float | None]) -> int | None:
    worst_before = None
    for s, rel in enumerate(per_token):
        if rel is None:
            return None
        if worst_before is not None and rel > 0 and rel > RISE * worst_before:
            return s
        worst_before = rel if worst_before is None else max(worst_before, rel)
    return None


def breakdown(key: str, ref, target) -> Where | None:
    """Per-token (and per-head) error of a layer stage; None when the layout is not known or the
    tensors hold non-finite values (or squares past float64's range)."""
    shape = tuple(ref.shape)
    axes = axes_of(key, list(shape))
    if axes is None or shape != tuple(target.shape) or 0 in shape:
        return None
    sums = row_sums(ref.reshape(-1), target.reshape(-1), shape[-1])
    if sums is None:
        return None
    d2, r2 = (x.reshape(shape[:-1]) for x in sums)  # [batch, token] or [batch, token, head]
    others = tuple(i for i in range(d2.ndim) if i != 1)
    per_token = _rel(d2.sum(others), r2.sum(others))
    per_head = None
    if "head" in axes:
        per_head = _rel(d2.sum((0, 1)), r2.sum((0, 1)))
    by_token = (d2, r2) if d2.ndim == 2 else (d2.sum(-1), r2.sum(-1))
    return Where(axes, per_token, per_head, _rise(per_token), by_token)


def token_runs(key: str, ref, target, coords=None, where: Where | None = None):
    """(runs, left out) of exact / within / wrong tokens per sequence of a layer stage
    (`comparison/token_runs.py`): from the per-token sums of `where` (the stage's `breakdown`,
    computed when not given) for a `[batch, token, ...]` pair, or, for a packed `[T, ...]` pair
    whose rows `coords` places in the reference's batch, from its rows' sums; None for other
    stages and layouts."""
    from ffdebug.comparison import token_runs as runs

    shape = tuple(ref.shape)
    if coords is not None:
        if not key.startswith("L") or shape != tuple(target.shape) or 0 in shape or len(shape) < 2:
            return None
        if coords.shape[0] != shape[0]:  # the mask's tokens are not this stage's rows
            return None
        sums = row_sums(ref.reshape(-1), target.reshape(-1), ref.size // shape[0])
        return None if sums is None else runs.capped(runs.of_packed(*sums, coords))
    where = where if where is not None else breakdown(key, ref, target)
    if where is None or where.token_sums is None:
        return None
    return runs.capped(runs.of_padded(*where.token_sums))


def row_sums(r, t, width: int):
    """(Σ (t − r)², Σ r²) of each `width`-element row of the flat tensors, in float64 (a vector of
    numel / width each); None when a sum is not finite (NaN / Inf, or squares past float64)."""
    import numpy as np

    rows = r.shape[0] // width
    d2 = np.empty(rows, dtype=np.float64)
    r2 = np.empty(rows, dtype=np.float64)
    with np.errstate(all="ignore"), one_blas_thread():
        if width <= CHUNK:
            _whole_rows(r, t, width, d2, r2)
        else:
            _long_rows(r, t, width, d2, r2)
    if not (bool(np.isfinite(d2).all()) and bool(np.isfinite(r2).all())):
        return None
    return d2, r2


def _whole_rows(r, t, width: int, d2, r2) -> None:
    """Rows of at most CHUNK elements: CHUNK // width whole rows per block."""
    import numpy as np

    x = work_rows()
    per = CHUNK // width
    n_rows = d2.shape[0]
    for row in range(0, n_rows, per):
        k = min(per, n_rows - row)
        m = k * width
        xr, xt = x[0, :m], x[1, :m]
        copy_in(xr, r[row * width : row * width + m])
        copy_in(xt, t[row * width : row * width + m])
        np.subtract(xt, xr, out=xt)
        np.multiply(xt, xt, out=xt)  # (t − r)²
        np.multiply(xr, xr, out=xr)
        np.sum(xt.reshape(k, width), axis=1, out=d2[row : row + k])
        np.sum(xr.reshape(k, width), axis=1, out=r2[row : row + k])


def _long_rows(r, t, width: int, d2, r2) -> None:
    """Rows longer than CHUNK: each row summed in CHUNK-element pieces, in order."""
    import numpy as np

    x = work_rows()
    for row in range(d2.shape[0]):
        sd = sr = 0.0
        for j in range(row * width, (row + 1) * width, CHUNK):
            m = min(CHUNK, (row + 1) * width - j)
            xr, xt = x[0, :m], x[1, :m]
            copy_in(xr, r[j : j + m])
            copy_in(xt, t[j : j + m])
            np.subtract(xt, xr, out=xt)
            sd += float(np.dot(xt, xt))
            sr += float(np.dot(xr, xr))
        d2[row], r2[row] = sd, sr


def named(axes: tuple[str, ...], at: list[int] | None) -> dict | None:
    """The max-error coordinate as `{"batch": b, "token": s, ...}`."""
    if at is None or len(at) != len(axes):
        return None
    return dict(zip(axes, at))


def locate(e, rt, tt, coords=None) -> None:
    """Where inside the tensor the error of stage result `e` sits: per token / head, the named
    max-error coordinate, and the runs of wrong tokens per sequence (`coords`: a packed pair's
    rows in the padded reference's (sequence, position), `comparison/align.py`)."""
    packed = coords is not None and rt.ndim >= 2 and coords.shape[0] == rt.shape[0]
    # a packed pair [T, ...] is read as one row of T tokens: its heads are the stage's heads, its
    # tokens are placed in the reference's (sequence, position) by `coords`
    w = breakdown(e.key, rt[None], tt[None]) if packed else breakdown(e.key, rt, tt)
    runs = token_runs(e.key, rt, tt, coords, None if packed else w)
    if runs is not None:
        e.token_runs, e.token_runs_left_out = runs
    if w is None:
        return
    if packed and e.max_abs_at:
        e.max_abs_at = [*coords[e.max_abs_at[0]].tolist(), *e.max_abs_at[1:]]  # the reference's
    e.max_abs_where = named(w.axes, e.max_abs_at)
    e.per_head_rel = w.per_head_rel
    if not packed:  # a packed pair's per-token errors are its token runs; no rise across sequences
        e.per_token_rel, e.rise_from = w.per_token_rel, w.rise_from
    if e.rise_from is not None:
        e.notes.append(f"error rises from token {e.rise_from}")
    if w.per_head_rel:
        worst_rel = max((x for x in w.per_head_rel if x is not None), default=0.0)
        bad = [
            h
            for h, x in enumerate(w.per_head_rel)
            if x is None or (worst_rel > 0 and x >= worst_rel / RISE_HEADS)
        ]
        if worst_rel > 0 and len(bad) < len(w.per_head_rel):
            e.notes.append(f"error in head(s) {', '.join(map(str, bad))} (rel per head: see per_head_rel)")
