"""Logits metrics over the vocabulary (last) dim, in float64 row blocks: argmax agreement,
top-k overlap and KL(ref ‖ target); compare reports them for stages tapped as logits.

Notation (rows i of ref logits r and target logits t, vocabulary V):
    p = softmax(rᵢ), q = softmax(tᵢ);  KLᵢ = Σᵥ p log(p / q), with 0·log(0/q) = 0
    argmax_agree = mean over rows of [argmax rᵢ = argmax tᵢ]
    topk_overlap = |topk(rᵢ) ∩ topk(tᵢ)| / k, averaged over rows
"""

from __future__ import annotations

import math

from ffdebug.arrays import as_array, as_float64
from ffdebug.comparison.metrics import _finite

LOGITS_CHUNK_BYTES = 8 << 20  # one float64 block of logits rows; the loop holds about six


def logits_metrics(ref, target, topk: int = 5, rows_per_chunk: int | None = None) -> dict:
    """Argmax agreement, top-k overlap and KL(ref ‖ target) over the last dim, in float64.

    Rows are taken `rows_per_chunk` at a time (default: as many as fit `LOGITS_CHUNK_BYTES` in
    float64, at least one: 13 rows of a 152k vocabulary; a fixed 256 rows held about 2 GiB of
    float64 blocks for such a vocabulary). `kl_mean` / `kl_max` are null when a row's KL is
    infinite (`kl_inf_rows` counts them). The top-k sets break ties by column (`_top_k`)."""
    import numpy as np

    ref, target = as_array(ref), as_array(target)
    if tuple(ref.shape) != tuple(target.shape) or ref.ndim == 0:
        return {}
    vocab = ref.shape[-1]
    r = ref.reshape(-1, vocab)
    t = target.reshape(-1, vocab)
    k = min(topk, vocab)
    rows = r.shape[0]
    if rows_per_chunk is None:
        rows_per_chunk = max(1, LOGITS_CHUNK_BYTES // (8 * max(vocab, 1)))
    agree = overlap = 0
    kl_sum = 0.0
    kl_max = 0.0
    kl_inf = 0
    with np.errstate(all="ignore"):
        for i in range(0, rows, rows_per_chunk):
            rc = as_float64(r[i : i + rows_per_chunk])
            tc = as_float64(t[i : i + rows_per_chunk])
            agree += int(np.count_nonzero(rc.argmax(-1) == tc.argmax(-1)))
            overlap += int(np.count_nonzero(_top_k(rc, k) & _top_k(tc, k)))
            lp, lq = _log_softmax(rc), _log_softmax(tc)
            p = np.exp(lp)
            # 0·log(0/q) = 0: entries the reference masks (-inf logits) add nothing; a NaN row counts
            # as infinitely far, like a target that gives zero probability where the reference does not
            kl = np.where(p > 0, p * (lp - lq), 0.0).sum(-1)
            kl = np.nan_to_num(kl, nan=math.inf, posinf=math.inf)
            kl[_no_distribution(rc) | _no_distribution(tc)] = math.inf  # a reference NaN row too
            kl_inf += int(np.count_nonzero(np.isinf(kl)))
            kl_sum += float(kl.sum())
            kl_max = max(kl_max, float(kl.max()))
    return {
        "argmax_agree": agree / rows if rows else 1.0,
        f"top{k}_overlap": overlap / (rows * k) if rows else 1.0,
        "kl_mean": _finite(kl_sum / rows) if rows else 0.0,
        "kl_max": _finite(kl_max),  # null when some row is infinitely far
        "kl_inf_rows": kl_inf,
    }


def _no_distribution(x):
    """[rows] bool: rows whose softmax is not a distribution (a NaN or a +inf logit)."""
    import numpy as np

    return (np.isnan(x) | (x == math.inf)).any(-1)


def _top_k(x, k: int):
    """[rows, vocab] bool: each row's k largest values, ties at the k-th value taken lowest column
    first (what a stable descending sort keeps) so the set does not depend on a selection
    algorithm's order; a NaN ranks above every number. Linear in the vocabulary (`partition`
    finds the k-th value)."""
    import numpy as np

    nan = np.isnan(x)
    if nan.any():  # rare: rank NaN above +inf, as torch.topk does, by a stable sort of those rows
        out = np.zeros(x.shape, dtype=bool)
        rows = np.flatnonzero(nan.any(-1))
        for i in rows:
            order = np.lexsort((-np.where(nan[i], 0.0, x[i]), ~nan[i]))[:k]
            out[i, order] = True
        rest = np.setdiff1d(np.arange(x.shape[0]), rows)
        if rest.size:
            out[rest] = _top_k(x[rest], k)
        return out
    kth = -np.partition(-x, k - 1, axis=-1)[:, k - 1 : k]  # the k-th largest value of each row
    above = x > kth
    tied = x == kth
    need = k - above.sum(-1, keepdims=True)
    return above | (tied & (np.cumsum(tied, -1) <= need))


def _log_softmax(x):
    """log softmax over the last dim of a float64 [rows, vocab] block (max subtracted first)."""
    import numpy as np

    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
