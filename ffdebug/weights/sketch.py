"""Row and column sketches of one tensor: the fingerprint content matching searches
(docs/weights-diff.md, "Content matching").

A tensor is viewed as a matrix of rows [N, C] (all dims but the last flattened; a 1-D tensor is
[n, 1]); a 3-D tensor [E, A, C] keeps its slots (expert e is rows e·A … (e+1)·A). Its row sketch
is `rows @ g(C)`, and for a 2-D tensor its column sketch is `g(N) @ M`, with `g(n)` a fixed random
vector of length n (taken in float32, kept in float64). Sketches are linear in the tensor, so a block of rows (or columns) of
one tensor that equals another tensor has the other's sketch at that offset, a transposed copy
swaps rows and columns, and a scaled copy scales the sketch. One tensor is read at a time; a
sketch holds N + C numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

ROWS, COLS = 0, 1
CHUNK_ELEMS = 1 << 20  # elements converted at a time (4 MiB of float32)


@lru_cache(maxsize=64)
def probe(n: int):
    """g(n): the fixed random vector the sketches of length-n rows (or columns) are taken with
    (float64 standard normal, numpy's default generator seeded by n)."""
    import numpy as np

    return np.random.default_rng(1_000_003 * n % (1 << 31)).standard_normal(n)


@dataclass(frozen=True)
class Line:
    """One sketch of a tensor: `values[i]` is row (or column) i taken with `probe(width)`;
    segments must not cross a multiple of `slot` (one expert of a stacked tensor)."""

    axis: int  # ROWS | COLS
    width: int  # the length of the probe
    values: object  # float64 array
    slot: int

    @property
    def rms(self) -> float:
        import numpy as np

        return float(np.sqrt(np.mean(np.square(self.values)))) if self.values.size else 0.0


@dataclass(frozen=True)
class Sketch:
    name: str
    shape: tuple[int, ...]
    lines: tuple[Line, ...]
    constant: bool  # every element equal (zeros, ones): matched whole only, never as a block
    norm: float

    def line(self, axis: int) -> Line | None:
        return next((ln for ln in self.lines if ln.axis == axis), None)


def sketch(name: str, x) -> Sketch | None:
    """The sketch of array `x` (None for arrays without real float values or elements)."""
    import numpy as np

    from ffdebug.arrays import as_array, float32_of, is_floating

    x = as_array(x)
    if x.size == 0 or not is_floating(x.dtype):
        return None
    shape = tuple(x.shape)
    m = x.reshape(-1, 1) if x.ndim <= 1 else x.reshape(-1, shape[-1])
    n, c = m.shape
    g = probe(c).astype(np.float32)
    rows = np.empty(n, dtype=np.float64)
    cols = np.zeros(c, dtype=np.float64) if x.ndim == 2 else None
    gn = probe(n).astype(np.float32) if cols is not None else None
    lo, hi, sq = None, None, 0.0
    step = max(1, CHUNK_ELEMS // c)
    for i in range(0, n, step):
        block = float32_of(m[i : i + step])  # exact for bf16 / fp16; sums well within TOL of content
        raw = m[i : i + step] if x.dtype.itemsize >= 4 else block  # min / max exact on either
        bmin, bmax = float(raw.min()), float(raw.max())
        rows[i : i + block.shape[0]] = block @ g
        if cols is not None:
            cols += gn[i : i + block.shape[0]] @ block
        lo = bmin if lo is None else min(lo, bmin)
        hi = bmax if hi is None else max(hi, bmax)
        sq += float(np.linalg.norm(block.astype(np.float64).reshape(-1))) ** 2
    slot = shape[1] if x.ndim == 3 else n
    lines = [Line(ROWS, c, rows, slot)]
    if cols is not None:
        lines.append(Line(COLS, n, cols, c))
    return Sketch(name, shape, tuple(lines), lo == hi, sq**0.5)
