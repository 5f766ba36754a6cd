"""Rows of one matrix found, one by one, among the rows of others: the fingerprint, the match and
the compact description of where they lie (docs/weights-diff.md, "Content matching", gathered rows).

Engine converters write fused and per-head tensors whose parts are not contiguous blocks: q / k / v
interleaved per head group (`[q_0, k_0, v_0, q_1, …]`, GPT-NeoX and Falcon style), q / k rows
permuted per head for another rotary convention (halves ↔ interleaved pairs, as Meta's and HF's
Llama checkpoints differ), an MLA `kv_b` whose per-head `[k_nope | v]` blocks are reordered. Such a
tensor is still every row of its parts, each once: a *gather*.

A matrix `x` [N, C] is fingerprinted by `K` fixed random probes, `F = x @ G` with G [C, K]
(float64 sums of float32 products, chunked: one tensor in memory). A row of a composite is matched
to a part's row when all K fingerprints agree within `content.TOL` of the parts' rms; identical
rows (zeros, copies) are told apart by preferring the continuation of the previous row's match.
A match is a candidate only: every gather is verified on the tensors in full before it is used.
"""

from __future__ import annotations

from dataclasses import dataclass

PROBES = 3  # fingerprints per row: one random coincidence within TOL per probe is ~4e-3
AMBIGUOUS = 8  # more candidates than this per row on average: the rows are not told apart
CHUNK_ELEMS = 1 << 20


def fingerprints(x, probes: int = PROBES):
    """[N, probes] float64: each row of `x` (all dims but the last flattened) times fixed random
    vectors of length C (float32 products; numpy's default generator seeded by C, independent of
    the sketches' probe)."""
    import numpy as np

    from ffdebug.arrays import as_array, float32_of

    x = as_array(x)
    m = x.reshape(-1, 1) if x.ndim <= 1 else x.reshape(-1, x.shape[-1])
    n, c = m.shape
    g = np.random.default_rng((7_919 * c + 17) % (1 << 31)).standard_normal((c, probes)).astype(np.float32)
    out = np.empty((n, probes), dtype=np.float64)
    step = max(1, CHUNK_ELEMS // max(c, 1))
    for i in range(0, n, step):
        out[i : i + step] = float32_of(m[i : i + step]) @ g
    return out


@dataclass(frozen=True)
class RowMatch:
    """Composite row r holds row `rows[r]` of part `parts[r]` (indices into the parts given)."""

    parts: tuple[int, ...]
    rows: tuple[int, ...]

    def rows_of(self, part: int) -> list[int]:
        """The composite rows holding `part`'s rows, in the part's row order."""
        held = sorted((row, r) for r, (p, row) in enumerate(zip(self.parts, self.rows)) if p == part)
        return [r for _, r in held]


def match_rows(comp, parts: list, tol_scale: float) -> RowMatch | None:
    """Each row of the composite's fingerprints `comp` [N, K] found among the parts' fingerprints
    (`parts[i]` [n_i, K]); None unless every composite row is matched and every part used is used
    whole, each row once. `tol_scale` is `content.TOL`."""
    import numpy as np

    if not parts or comp.shape[0] == 0:
        return None
    owner = np.concatenate([np.full(p.shape[0], i, dtype=np.int64) for i, p in enumerate(parts)])
    local = np.concatenate([np.arange(p.shape[0]) for p in parts])
    pool = np.concatenate(parts)
    tol = tol_scale * float(np.sqrt(np.mean(np.square(pool[:, 0])))) + 1e-300
    order = np.argsort(pool[:, 0], kind="stable")
    first = pool[order, 0]
    lo, hi = _windows(first, comp[:, 0], tol)
    if bool((hi == lo).any()):
        return None
    if int((hi - lo).sum()) > AMBIGUOUS * comp.shape[0]:
        return None  # the fingerprints do not tell rows apart (rows of one or two elements)
    if bool((hi - lo == 1).all()):  # one candidate a row: matched in one step
        return _unique_match(comp, pool, order[lo], owner, local, parts, tol)
    used: set[int] = set()
    got_parts, got_rows = [], []
    prev: tuple[int, int] | None = None
    for r in range(comp.shape[0]):
        cands = order[int(lo[r]) : int(hi[r])]
        close = cands[np.abs(pool[cands] - comp[r]).max(axis=1) <= tol].tolist()
        free = [c for c in close if c not in used]
        if not free:
            return None
        pick = free[0]
        if prev is not None and len(free) > 1:  # identical rows: continue the previous match
            pick = next((c for c in free if int(owner[c]) == prev[0] and int(local[c]) == prev[1] + 1), pick)
        used.add(pick)
        prev = (int(owner[pick]), int(local[pick]))
        got_parts.append(prev[0])
        got_rows.append(prev[1])
    return _whole_parts(parts, got_parts, got_rows, comp.shape[0])


def _windows(first, keys, tol: float):
    """(lo, hi): the range of sorted `first` within `tol` of each key. The keys are searched in
    sorted order (each search starts near the last: a million random searches of a million values
    missed the cache on every step, 2 s against 0.1)."""
    import numpy as np

    korder = np.argsort(keys, kind="stable")
    ks = keys[korder]
    lo, hi = np.empty_like(korder), np.empty_like(korder)
    lo[korder] = np.searchsorted(first, ks - tol, side="left")
    hi[korder] = np.searchsorted(first, ks + tol, side="right")
    return lo, hi


def _unique_match(comp, pool, cands, owner, local, parts, tol) -> RowMatch | None:
    """`match_rows` where every composite row has one candidate `cands[r]`: each must be close
    and used once."""
    import numpy as np

    if not bool((np.abs(pool[cands] - comp).max(axis=1) <= tol).all()):
        return None
    if np.unique(cands).shape[0] != cands.shape[0]:
        return None
    return _whole_parts(parts, owner[cands].tolist(), local[cands].tolist(), comp.shape[0])


def _whole_parts(parts: list, got_parts: list, got_rows: list, n: int) -> RowMatch | None:
    """The match, unless a part is used only in part (not a gather of whole tensors)."""
    if sum(parts[i].shape[0] for i in set(got_parts)) != n:
        return None
    return RowMatch(tuple(got_parts), tuple(got_rows))


def permutation(ref, tgt) -> list[int] | None:
    """`rows` with `tgt[rows[i]] == ref[i]` for every reference row i (the target's rows holding the
    reference's, in order) when the target's rows are the reference's reordered, not the identity;
    else None. Verified in full."""
    from ffdebug import verdict as V
    from ffdebug.arrays import as_array, is_floating
    from ffdebug.comparison.metrics import compare_tensors
    from ffdebug.weights.content import TOL

    ref, tgt = as_array(ref), as_array(tgt)
    if tuple(ref.shape) != tuple(tgt.shape) or ref.ndim < 2 or ref.shape[0] < 2:
        return None
    if not (is_floating(ref.dtype) and is_floating(tgt.dtype)):
        return None
    r2, t2 = ref.reshape(ref.shape[0], -1), tgt.reshape(tgt.shape[0], -1)
    found = match_rows(fingerprints(t2), [fingerprints(r2)], TOL)
    rows = found.rows_of(0) if found is not None else None
    if rows is None or rows == list(range(len(rows))):
        return None
    m = compare_tensors(r2, t2[rows])
    return rows if V.is_ok(V.classify(m.cos, m.rel)) else None


# ------------------------------------------------------------------------------------------------
# the description of a row list


def _slices(rows: list[int]) -> list[tuple[int, int, int]]:
    """Maximal arithmetic runs (start, count, step), step-1 runs preferred."""
    out, i = [], 0
    while i < len(rows):
        step = rows[i + 1] - rows[i] if i + 1 < len(rows) else 1
        if step <= 0:
            step = 1
        j = i + 1
        while j < len(rows) and rows[j] - rows[j - 1] == step:
            j += 1
        if j == i + 1:
            step = 1
        out.append((rows[i], j - i, step))
        i = j
    return out


def _show(s: tuple[int, int, int], shift: int = 0) -> str:
    start, count, step = s
    start -= shift
    if count == 1:
        return str(start)
    stop = start + (count - 1) * step + 1
    return f"{start}:{stop}" + (f":{step}" if step != 1 else "")


def _period(runs: list[tuple[int, int, int]]) -> tuple[int, int] | None:
    """(runs per period p, row offset Δ) when runs[j + p] is runs[j] moved by Δ for every j, with
    at least two periods; the smallest p."""
    n = len(runs)
    for p in range(1, n // 2 + 1):
        if n % p:
            continue
        delta = runs[p][0] - runs[0][0]
        if delta <= 0:
            continue
        if all(runs[j + p][1:] == runs[j][1:] and runs[j + p][0] - runs[j][0] == delta for j in range(n - p)):
            return p, delta
    return None


def _rope_kind(block: list[int]) -> str | None:
    """'halves → pairs' / 'pairs → halves' when one period is the rotary re-ordering of a head."""
    d = len(block)
    if d < 4 or d % 2 or sorted(block) != list(range(d)):
        return None
    to_pairs = [2 * i for i in range(d // 2)] + [2 * i + 1 for i in range(d // 2)]
    to_halves = [x for i in range(d // 2) for x in (i, i + d // 2)]
    if block == to_pairs:
        return "rotary halves stored as interleaved pairs"
    if block == to_halves:
        return "rotary interleaved pairs stored as halves"
    return None


def describe(rows: list[int]) -> str:
    """Composite rows in a compact form: `8:16`, `0:8 +24k (k<4)`, `0:8:2, 1:8:2 +8k (k<4)`."""
    runs = _slices(list(rows))
    per = _period(runs)
    if per is None:
        return ", ".join(_show(s) for s in runs)
    p, delta = per
    first = ", ".join(_show(s) for s in runs[:p])
    return f"{first} +{delta}k (k<{len(runs) // p})"


def rotary_note(rows: list[int]) -> str | None:
    """The rotary re-ordering the rows show per head, when they are one (else None)."""
    runs = _slices(list(rows))
    per = _period(runs)
    if per is None:
        return _rope_kind(list(rows))
    p, _ = per
    lowest = min(s[0] for s in runs[:p])
    block = [x - lowest for s in runs[:p] for x in range(s[0], s[0] + s[1] * s[2], s[2])]
    kind = _rope_kind(block)
    return f"{kind}, per head of {len(block)} rows" if kind else None
