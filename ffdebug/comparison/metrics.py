"""Float64 comparison metrics, streamed in cache-sized chunks.

Notation (ref r, target t, flattened, n elements, all sums in float64):
    ‖r‖² = Σ r²,  ‖t‖² = Σ t²,  ‖t−r‖² = Σ (t−r)²,  dot = Σ r·t = (‖r‖² + ‖t‖² − ‖t−r‖²) / 2
    cos      = dot / (‖r‖ ‖t‖)                  clamped to [−1, 1]
    rel      = ‖t − r‖ / ‖r‖
    rel_diff = 1 − 2·dot / (‖t‖² + ‖r‖²) = ‖t−r‖² / (‖t‖² + ‖r‖²)
    norm_ratio = ‖t‖ / ‖r‖
    max_abs  = max |t − r| (with its coordinate),  mean_abs = Σ |t − r| / n
    elem     = maxᵢ |tᵢ − rᵢ| / max(|rᵢ|, rms(r)),  rms(r) = ‖r‖ / √n   (element-wise error)

Why chunks: a float64 copy of a 1 GiB fp32 tensor is 2 GiB; 256 Ki-element chunks copied into
float64 work rows stay in cache (docs/benchmarks.md "Benchmarks"). Per chunk, each a single pass: two copies
(r, t; one-byte floats through a table of their 256 values); one count of equal raw bits on
integer views of the inputs (where the first HEAD positions agree it comes first and also tells
a bit-identical chunk, which needs only ‖r‖²; otherwise after t is copied, both inputs then in
cache); two BLAS dot products (t·t, r·r); t − r in place over t and a dot d·d; |d| in place;
its max per piece of PIECE elements (one reduction over the chunk viewed as rows); and Σ|d| as
one BLAS matrix-vector product of those rows with ones. r·t is not summed: it follows from the
three norms, which also gives 1 − cos and rel_diff without the cancellation of a direct dot near
‖r‖‖t‖. The position of max |t − r| is looked up once, after the loop, in the first piece that
holds it, and `elem`, which needs rms(r) known only after the first pass, revisits only the
pieces that can hold its maximum, largest error first (none when the tensors are equal): a piece
of 4 Ki elements where a whole chunk was recomputed before (bench/README.md, 2026-12-06). The
work rows are kept per thread (a fresh buffer per tensor was page-faulted on every call).
Non-finite values take a slow path only in the chunks that hold them. `bit_equal` counts
positions with identical bits (same dtype), or equal values (different dtypes).

Arrays are numpy (`ffdebug.arrays`); a torch tensor given here is taken as a view first.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, field

from ffdebug._chunks import CHUNK, copy_in, iter_chunks, one_blas_thread, work_rows
from ffdebug.arrays import as_array, int_view, is_complex, is_floating

PIECE = 1 << 12  # elements whose max |t − r| is kept (CHUNK is a multiple): 64 per chunk
HEAD = 64  # positions whose bits tell a differing chunk before its equal bits are counted

_work = threading.local()  # per thread: views of the work rows, the bool row


def _work_rows():
    """The thread's two float64 work rows (`ffdebug._chunks.work_rows`: r, and t then t − r in
    place), with their full-chunk views and a bool row for the equal-bits test kept beside them."""
    import numpy as np

    rows = work_rows()
    if getattr(_work, "rows", None) is not rows:
        _work.rows = rows
        _work.same = np.empty(CHUNK, dtype=bool)
        _work.full = (rows[0], rows[1])  # made once: a dozen views per chunk cost ~5% of it
        _work.piece = np.empty((2, PIECE))  # r, |t − r| of one piece recomputed after the loop
        _work.ones = np.ones(PIECE)  # Σ|t − r| of a chunk's pieces as a matrix-vector product
    return rows


@dataclass
class TensorMetrics:
    """Result of comparing one reference tensor with one target tensor."""

    cos: float | None = None
    rel: float | None = None
    rel_diff: float | None = None
    max_abs: float | None = None
    max_abs_at: list[int] | None = None
    elem: float | None = None
    mean_abs: float | None = None
    norm_ratio: float | None = None
    bit_equal: float | None = None
    numel: int = 0
    ref_norm: float = 0.0
    target_norm: float = 0.0
    nan_mismatch: int = 0
    inf_mismatch: int = 0
    nan_both: int = 0
    shape_mismatch: bool = False
    notes: list[str] = field(default_factory=list)
    logits: dict | None = None

    def to_json(self) -> dict:
        return asdict(self)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def compare_tensors(ref, target) -> TensorMetrics:
    """Compare two arrays of equal shape in float64 (any dtypes); shape mismatch is reported."""
    import numpy as np

    ref, target = as_array(ref), as_array(target)
    if tuple(ref.shape) != tuple(target.shape):
        return TensorMetrics(
            shape_mismatch=True,
            numel=ref.size,
            notes=[f"shape mismatch: ref {list(ref.shape)} vs target {list(target.shape)}"],
        )
    with np.errstate(all="ignore"), one_blas_thread():  # NaN / Inf are counted, never warned about
        metrics = _compare_tensors(ref, target)
        if metrics is None:  # float64 sums overflowed (|values| past ~1e154): redo on scaled values
            metrics = _compare_tensors(ref, target, scale=_pow2_scale(ref, target))
        return metrics


def _pow2_scale(ref, target) -> float:
    """A power of two that brings the largest finite |value| of either side to at most 1 (exact)."""
    import numpy as np

    absmax = 0.0
    for x in (ref, target):
        flat = _real_flat(x)
        for c in iter_chunks(flat):
            c = c[np.isfinite(c)]
            if c.size:
                absmax = max(absmax, float(np.abs(c).max()))
    return 2.0 ** -math.ceil(math.log2(absmax))


def _real_flat(x):
    """A flat view of an array; complex as its interleaved real and imaginary parts."""
    import numpy as np

    flat = x.reshape(-1)
    if is_complex(x.dtype):
        flat = np.ascontiguousarray(flat).view(flat.real.dtype)
    return flat


@dataclass(slots=True)
class _Sums:
    """The float64 sums of the chunk loop (scaled units), in the order the chunks add them."""

    nr2: float = 0.0  # ‖r‖²
    nt2: float = 0.0  # ‖t‖²
    diff2: float = 0.0  # ‖t − r‖²
    sum_abs: float = 0.0  # Σ |t − r|
    max_abs: float = -1.0
    max_at: int = 0
    max_chunk: int = -1  # start of the finite chunk that set max_abs, its position not yet found
    max_pieces: object = None  # that chunk's piece maxima
    equal: int = 0  # positions with equal bits (same dtype) or values
    counted: int = 0  # positions where both sides are finite
    nan_mismatch: int = 0
    inf_mismatch: int = 0
    nan_both: int = 0
    # (max |t − r|, start, its pieces' max |t − r| or None for a chunk holding NaN / Inf), per
    # chunk that is not bit-identical
    chunk_bounds: list[tuple] = field(default_factory=list)
    held: int = -1  # start of the chunk whose r and |t − r| the work rows still hold, else -1

    def finite(self) -> bool:
        return math.isfinite(self.nr2 + self.nt2 + self.diff2)


def _compare_tensors(ref, target, scale: float = 1.0) -> TensorMetrics | None:
    """The chunk loop; None when unscaled float64 sums overflow. Values are multiplied by `scale`
    (a power of two) and norms / absolute errors divided back."""
    r, t = _real_flat(ref), _real_flat(target)
    raw_view = None
    if ref.dtype == target.dtype and is_floating(ref.dtype):
        raw_view = int_view(ref.dtype)
    sums = _chunk_sums(r, t, raw_view, scale)
    if not sums.finite():
        return None
    return _metrics(sums, r, t, tuple(ref.shape), scale)


def _row_views(x, m: int) -> tuple:
    """(r row, t row) of the first `m` columns of the work rows."""
    return _work.full if m == CHUNK else (x[0, :m], x[1, :m])


def _chunk_sums(r, t, raw_view, scale: float) -> _Sums:
    """One pass over flat `r`, `t` in CHUNK-element pieces copied into float64 work rows."""
    import numpy as np

    n = r.shape[0]
    x = _work_rows()  # float64 work rows r, t (then t − r in place) (stay in cache)
    r_bits, t_bits = (r.view(raw_view), t.view(raw_view)) if raw_view is not None else (None, None)
    s = _Sums()
    for i in range(0, n, CHUNK):
        m = min(CHUNK, n - i)
        s.held = -1  # the rows are about to be overwritten
        rows = _row_views(x, m)
        xr = rows[0]
        copy_in(xr, r[i : i + m])
        if scale != 1.0:
            xr *= scale
        ints, equal = None, None
        if raw_view is not None:
            ints = (r_bits[i : i + m], t_bits[i : i + m])
            if _head_equal(ints):  # it may be bit-identical: counted now, and t not copied if it is
                equal = _equal_count(ints)
            if equal == m:
                # bit-identical chunk (the common case before the first divergence): one norm suffices
                sq = float(np.dot(xr, xr))
                if math.isfinite(sq):
                    s.nr2 += sq
                    s.nt2 += sq
                    s.equal += m
                    s.counted += m
                    s.max_abs = max(s.max_abs, 0.0)
                    continue
        _differing_chunk(s, i, t[i : i + m], rows, ints, equal, scale)
    if s.max_chunk >= 0:
        s.max_at = _argmax_piece(r, t, s, scale)
    return s


def _head_equal(ints) -> bool:
    """Whether the first HEAD positions of a chunk have equal bits: where they do not, the chunk
    differs and its equal bits are counted after t is copied, both inputs then in cache (the count
    as the first read of t cost 1.5x more, bench/README.md)."""
    return ints[0][:HEAD].tobytes() == ints[1][:HEAD].tobytes()


def _equal_count(ints) -> int:
    """Positions whose raw bits are equal: (r ints, t ints), into a bool row kept per thread."""
    import numpy as np

    same = _work.same[: ints[0].shape[0]]
    return int(np.count_nonzero(np.equal(ints[0], ints[1], out=same)))


def _differing_chunk(s: _Sums, i: int, tc, rows: tuple, ints, equal: int | None, scale: float) -> None:
    """The sums of one chunk that is not bit-identical (r already in its row). `ints`: the chunk's
    raw bits (r, t) where both sides have one dtype, else None; `equal`: its positions with equal
    bits where already counted, else None."""
    import numpy as np

    xr, xt = rows
    m = tc.shape[0]
    copy_in(xt, tc)
    if ints is not None and equal is None:
        equal = _equal_count(ints)
    if scale != 1.0:
        xt *= scale
    tt_ = float(np.dot(xt, xt))
    rr_ = float(np.dot(xr, xr))
    dd_ = math.inf
    if math.isfinite(rr_ + tt_):
        xd = np.subtract(xt, xr, out=xt)  # t − r in place: t is not read again on this path
        dd_ = float(np.dot(xd, xd))
        if not math.isfinite(dd_):  # |t − r| past float64's range: the slow path needs t again
            copy_in(xt, tc)
            if scale != 1.0:
                xt *= scale
    if not math.isfinite(dd_):
        _nonfinite_chunk(s, i, xr, xt, equal)  # NaN/Inf on at least one side
        return
    s.equal += equal if equal is not None else m - int(np.count_nonzero(xd))
    np.abs(xd, out=xd)  # |t - r| from here on (+0.0 where equal, so max_abs is never -0.0)
    whole, rest = _pieces(xd)
    pieces = _piece_maxima(whole, rest)
    chunk_max = float(pieces.max())
    s.chunk_bounds.append((chunk_max, i, pieces))
    if chunk_max > s.max_abs:  # its position is found once, after the loop (`_argmax_piece`)
        s.max_abs, s.max_chunk, s.max_pieces = chunk_max, i, pieces
    s.sum_abs += _abs_sum(whole, rest)
    s.nr2 += rr_
    s.nt2 += tt_
    s.diff2 += dd_
    s.counted += m
    s.held = i


def _pieces(xd) -> tuple:
    """A chunk's |t − r| (`xd`, m elements) as views: its whole pieces as rows [m // PIECE, PIECE],
    and the shorter rest (empty when PIECE divides m, as it does every chunk but a tensor's last)."""
    whole = xd.shape[0] // PIECE * PIECE
    return xd[:whole].reshape(-1, PIECE), xd[whole:]


def _abs_sum(whole, rest) -> float:
    """Σ|t − r| of a chunk (`_pieces`): its whole pieces as one matrix-vector product with ones
    (BLAS gemv, a quarter faster than numpy's pairwise sum and as accurate on these non-negative
    terms; bench/README.md), the rest summed."""
    import numpy as np

    total = float(np.dot(whole, _work.ones).sum()) if whole.shape[0] else 0.0
    return total + float(rest.sum()) if rest.shape[0] else total


def _piece_maxima(whole, rest):
    """[ceil(m / PIECE)] max of each piece of a chunk's |t − r| (`_pieces`; the last piece is the
    rest where there is one)."""
    import numpy as np

    maxima = np.maximum.reduce(whole, axis=1)
    return np.append(maxima, rest.max()) if rest.shape[0] else maxima


def _span(r, t, s: _Sums, i: int, m: int, scale: float) -> tuple:
    """(r, |t − r|, writable) of the `m` elements at `i` (scaled units), after the chunk loop:
    views of the work rows where they still hold them (writable only when the span is that whole
    chunk, which is then given up), else recomputed into the piece rows (m ≤ PIECE, leaving the
    work rows as they are) or the work rows."""
    import numpy as np

    x = _work_rows()
    h = s.held
    if h >= 0 and h <= i and i + m <= h + min(CHUNK, r.shape[0] - h):
        whole = i == h and m == min(CHUNK, r.shape[0] - h)
        if whole:
            s.held = -1
        return x[0, i - h : i - h + m], x[1, i - h : i - h + m], whole
    rows = _work.piece if m <= PIECE else x
    if rows is x:
        s.held = -1
    xr, xt = rows[0, :m], rows[1, :m]
    copy_in(xr, r[i : i + m])
    copy_in(xt, t[i : i + m])
    if scale != 1.0:
        xr *= scale
        xt *= scale
    np.subtract(xt, xr, out=xt)
    return xr, np.abs(xt, out=xt), True


def _argmax_piece(r, t, s: _Sums, scale: float) -> int:
    """The flat index of max |t − r|: the first chunk to raise the running maximum holds its first
    position, in the first of its pieces that reaches it (`argmax` returns the first maximum);
    that piece alone is looked at (recomputed unless the work rows still hold it), instead of an
    `argmax` in every chunk that raised the maximum."""
    import numpy as np

    p = s.max_chunk + int(np.argmax(s.max_pieces)) * PIECE
    _, xd, _ = _span(r, t, s, p, min(PIECE, r.shape[0] - p), scale)
    return p + int(np.argmax(xd))


def _nonfinite_chunk(s: _Sums, i: int, xr, xt, equal: int | None) -> None:
    """The slow path of a chunk holding NaN/Inf: counted apart, the finite positions summed.
    `equal`: the positions with equal bits (same dtype), else equal values are counted here."""
    import numpy as np

    s.equal += equal if equal is not None else int(np.count_nonzero(xr == xt))
    rn, tn = np.isnan(xr), np.isnan(xt)
    ri, ti = np.isinf(xr), np.isinf(xt)
    s.nan_mismatch += int(np.count_nonzero(rn != tn))
    s.nan_both += int(np.count_nonzero(rn & tn))
    s.inf_mismatch += int(np.count_nonzero((ri | ti) & ~((ri & ti) & (xr == xt))))
    ok = ~(rn | tn | ri | ti)
    rr, tt = xr[ok], xt[ok]
    if rr.size == 0:
        return
    s.nr2 += float(np.dot(rr, rr))
    s.nt2 += float(np.dot(tt, tt))
    d = np.abs(tt - rr)
    s.diff2 += float(np.dot(d, d))
    s.sum_abs += float(d.sum())
    mi = int(np.argmax(d))
    mv = float(d[mi])
    s.chunk_bounds.append((mv, i, None))
    if mv > s.max_abs:
        s.max_abs, s.max_chunk = mv, -1
        s.max_at = i + int(np.flatnonzero(ok)[mi])
    s.counted += rr.size


def _metrics(s: _Sums, r, t, shape: tuple, scale: float) -> TensorMetrics:
    """The metrics of the module docstring from the sums (norms and errors back in true units)."""
    n = r.shape[0]
    nr2, nt2 = s.nr2, s.nt2
    # r·t = (‖r‖² + ‖t‖² − ‖t − r‖²) / 2: no pass of its own, and more accurate than a direct
    # dot where it matters (t close to r: 1 − cos and rel_diff come from ‖t − r‖², not from a
    # difference of two sums near each other; its error is a few ulp of ‖r‖² + ‖t‖² either way)
    dot = (nr2 + nt2 - s.diff2) / 2
    res = TensorMetrics(
        numel=n, nan_mismatch=s.nan_mismatch, inf_mismatch=s.inf_mismatch, nan_both=s.nan_both
    )
    res.bit_equal = s.equal / n if n else 1.0
    res.ref_norm = math.sqrt(nr2) / scale
    res.target_norm = math.sqrt(nt2) / scale
    if s.counted == 0:
        res.notes.append("no finite positions to compare" if n else "empty tensors")
        if n == 0:
            res.cos, res.rel, res.rel_diff, res.max_abs, res.mean_abs = 1.0, 0.0, 0.0, 0.0, 0.0
        return res
    res.max_abs = s.max_abs / scale
    res.max_abs_at = _unravel(s.max_at, shape)
    res.mean_abs = s.sum_abs / s.counted / scale
    if nr2 == 0.0 and nt2 == 0.0:
        res.cos, res.rel, res.rel_diff, res.norm_ratio = 1.0, 0.0, 0.0, 1.0
        res.notes.append("both sides are all zeros")
    elif nr2 == 0.0:
        res.cos, res.rel, res.rel_diff, res.norm_ratio = 0.0, None, 1.0, None  # elem undefined
        res.notes.append("reference is all zeros but target is not (rel undefined)")
    elif nt2 == 0.0:
        res.cos, res.rel, res.rel_diff, res.norm_ratio = 0.0, 1.0, 1.0, 0.0
        res.notes.append("target is all zeros but reference is not")
    else:
        res.cos = max(-1.0, min(1.0, dot / (math.sqrt(nr2) * math.sqrt(nt2))))
        res.rel = _finite(math.sqrt(s.diff2) / math.sqrt(nr2))
        res.rel_diff = s.diff2 / (nr2 + nt2)  # = 1 − 2 r·t / (‖r‖² + ‖t‖²)
        res.norm_ratio = math.sqrt(nt2) / math.sqrt(nr2)
    if nr2 == 0.0 and nt2 == 0.0:
        res.elem = 0.0
    elif nr2 > 0.0:
        rms = math.sqrt(nr2 / s.counted)
        res.elem = 0.0 if s.max_abs <= 0.0 else _elem_pass(r, t, s, rms, scale)
    if s.nan_mismatch:
        res.notes.append(f"NaN at {s.nan_mismatch} positions on one side only")
    if s.inf_mismatch:
        res.notes.append(f"Inf differs at {s.inf_mismatch} positions")
    return res


def _elem_pass(r, t, s: _Sums, rms: float, scale: float) -> float:
    """maxᵢ |tᵢ − rᵢ| / max(|rᵢ|, rms) over the finite positions (rms in scaled units).

    Every denominator is at least rms, so a piece whose max |t − r| / rms is no more than the best
    found so far cannot hold the maximum. Chunks are visited largest error first, and the pass
    stops at the first that cannot beat the best. In a chunk, its largest-error piece is visited
    first (on noise-like differences it usually holds the maximum), then the other pieces that can
    still beat the best, largest first; or the whole chunk, where visiting those pieces one by one
    would cost more (`_whole_chunk_pays`), as it does on relative errors (the largest |t − r| sit
    at the largest |r|): once a chunk went whole, the next ones go whole at once. A chunk holding
    NaN / Inf is visited whole."""
    import numpy as np

    n = r.shape[0]
    best = 0.0
    went_whole = False
    for bound, i, pieces in sorted(s.chunk_bounds, key=lambda b: b[0], reverse=True):
        if bound / rms <= best:
            break
        m = min(CHUNK, n - i)
        whole = pieces is None or went_whole or _whole_chunk_pays(1, m)
        if not whole:
            order = np.argsort(-pieces, kind="stable")
            for j, k in enumerate(order):
                if pieces[k] / rms <= best:
                    break
                if j == 1 and _whole_chunk_pays(np.count_nonzero(pieces[order[1:]] / rms > best), m):
                    whole = True
                    break
                p = i + int(k) * PIECE
                best = max(best, _span_elem(r, t, s, p, min(PIECE, n - p), scale, rms))
        if whole:
            best = max(best, _span_elem(r, t, s, i, m, scale, rms))
        went_whole = whole
    return best


def _whole_chunk_pays(pieces: int, m: int) -> bool:
    """Whether `pieces` more visits of a piece cost more than one of the whole chunk of `m`
    elements: a piece visit costs about what 4 PIECE elements of a chunk visit do (its dozen numpy
    calls; measured on 2-core x86, bench/README.md)."""
    return pieces * 4 * PIECE > m


def _span_elem(r, t, s: _Sums, i: int, m: int, scale: float, rms: float) -> float:
    """max |t − r| / max(|r|, rms) over the finite quotients of the `m` elements at `i`."""
    import numpy as np

    xr, xd, writable = _span(r, t, s, i, m, scale)
    if writable:
        np.abs(xr, out=xr)
        np.maximum(xr, rms, out=xr)
        q = np.divide(xd, xr, out=xd)
    else:  # a piece of the chunk the work rows hold: left as it is for the other pieces
        q = xd / np.maximum(np.abs(xr), rms)
    top = float(q.max())
    if not math.isfinite(top):  # NaN / Inf in the span, or a quotient past float64's range
        finite = q[np.isfinite(q)]
        top = float(finite.max()) if finite.size else 0.0
    return top


def _unravel(index: int, shape: tuple[int, ...]) -> list[int]:
    coords = []
    for dim in reversed(shape):
        coords.append(index % dim if dim else 0)
        index = index // dim if dim else 0
    return list(reversed(coords))
