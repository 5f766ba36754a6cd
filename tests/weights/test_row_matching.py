"""Rows found by their fingerprints (`ffdebug/weights/rows.py`): a reordering of distinct rows is
recovered exactly; rows the fingerprints cannot tell apart are no evidence of a reordering."""

from __future__ import annotations

import numpy as np

from ffdebug.weights.content import TOL
from ffdebug.weights.rows import fingerprints, match_rows, permutation


def _rows(n: int, width: int, seed: int = 0):
    return np.random.default_rng(seed).standard_normal((n, width)).astype(np.float32)


def test_a_reordering_of_distinct_rows_is_recovered_row_for_row():
    ref = _rows(64, 16)
    order = np.random.default_rng(1).permutation(64)
    tgt = ref[order]  # target row i holds reference row order[i]
    rows = permutation(ref, tgt)
    assert rows is not None and rows == [int(i) for i in np.argsort(order)]
    assert all(np.array_equal(tgt[rows[i]], ref[i]) for i in range(64))
    assert permutation(ref, ref) is None  # the identity is no reordering


def test_every_row_with_one_candidate_and_rows_that_need_the_walk_agree():
    """Distinct rows (one candidate each: matched in one step) and two identical rows (two
    candidates: matched row by row, continuing the previous match) give the same kind of answer."""
    ref = _rows(32, 8)
    found = match_rows(fingerprints(ref[::-1]), [fingerprints(ref)], TOL)
    assert found is not None and list(found.rows) == list(range(31, -1, -1))
    twin = ref.copy()
    twin[5] = twin[4]
    found = match_rows(fingerprints(twin), [fingerprints(twin)], TOL)
    assert found is not None and list(found.rows) == list(range(32))


def test_rows_the_fingerprints_cannot_tell_apart_are_not_called_reordered():
    """[N, 1]: each row is one number; with N large the tolerance window of a row holds hundreds
    of others, so no reordering is claimed (a row of one value carries no identity)."""
    ref = _rows(200_000, 1)
    tgt = ref[::-1] + np.float32(1e-4) * _rows(200_000, 1, seed=2)
    assert permutation(ref, tgt) is None
    assert match_rows(fingerprints(tgt), [fingerprints(ref)], TOL) is None
