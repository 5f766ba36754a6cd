"""The token-row rules of the routing-flip explanation (`comparison/routing.py`) on rows that
hold NaN: ranked as torch ranks them, and no row called hot against a median that is not a number."""

from __future__ import annotations

import math

import numpy as np

from ffdebug.comparison.routing import HOT, flipped_rows, hot_rows


def test_a_nan_score_ranks_first_so_a_tie_below_the_top_half_flips_nothing():
    # 4 experts, top half 2: torch's descending sort puts the NaN first, then 1.0; the near tie
    # 0.5 / 0.49 sits at ranks 3-4, below the choice, and cannot change it
    r = np.array([[1.0, math.nan, 0.5, 0.49], [1.0, 0.9, 0.5, 0.49]])
    t = r + np.array([[0.0, 0.0, -0.01, 0.01], [0.0, 0.0, -0.01, 0.01]])
    rows, _ = flipped_rows(r, t, set())
    assert rows == []
    t[1, 1] += 0.2  # row 1's top two (1.0, 0.9) now move by more than their gap: it can flip
    rows, _ = flipped_rows(r, t, set())
    assert rows == [1]


def test_hot_rows_against_a_median_and_none_when_a_row_error_is_nan():
    n, width = 5, 4
    r = np.ones((n, width))
    t = r.copy()
    t[:, 0] += 0.01  # every row off by 0.01
    t[3, 0] += 0.01 * (HOT + 5)  # row 3 far above HOT x the median row
    assert hot_rows(r, t, n, set()) == {3}
    t[4, 1] = math.nan
    assert hot_rows(r, t, n, set()) == set()
    assert hot_rows(r, t, n, {4}) == {3}  # a skipped row's NaN does not count
