"""Materialising the logical tensors of a planned diff: merged, dequantised, then `--transform`ed.

Tensors are numpy arrays (`ffdebug.arrays`). A `TensorLoader` belongs to one diff. Views cut from one stored tensor (a fused tensor's parts, a
stacked tensor's experts, a content-matched composite's blocks) share a one-entry cache, so the
stored tensor is loaded once while its parts are compared one after the other (the comparison
order keeps them together, `WeightsDiff.order`)."""

from __future__ import annotations

from ffdebug.arrays import as_float32
from ffdebug.weights import quant
from ffdebug.weights.tp import Logical, load_logical
from ffdebug.weights.transforms import apply_transforms


def _dequant_piece(x, scale, name):
    return quant.dequantize(x, scale, name)


def _narrow(x, dim: int, offset: int, size: int):
    """`size` entries of array `x` from `offset` along `dim`, contiguous (torch's `narrow`)."""
    import numpy as np

    return np.ascontiguousarray(x[(slice(None),) * (dim % x.ndim) + (slice(offset, offset + size),)])


class TensorLoader:
    """Loads a `Logical` of one side; `cast` holds the (name, side) pairs cast out of fp8."""

    def __init__(self, transforms: tuple = ()) -> None:
        self.transforms = transforms
        self.cast: set[tuple[str, str]] = set()
        self._caches: dict[str, tuple] = {}  # kind -> (key, tensor): one stacked, one composite

    def load(self, t: Logical, side: str):
        """The tensor as compared: merged, dequantised and transformed."""
        return apply_transforms(self.transforms, side, t.name, self.load_raw(t, side))

    def load_raw(self, t: Logical, side: str):
        """Merged and dequantised, before any --transform."""
        wants_cast = (t.name, side) in self.cast
        x = load_logical(t, _dequant_piece if t.scale is not None or wants_cast else None)
        if quant.is_fp8(t.dtype) and wants_cast and t.scale is None:
            x = as_float32(x)
        return x

    def release(self) -> None:
        """Drop the cached stored tensor (at the end of a run)."""
        self._caches.clear()

    def _cached(self, kind: str, key: tuple, make):
        if self._caches.get(kind, (None,))[0] != key:
            self._caches.pop(kind, None)  # the old tensor goes before the new one is read
            self._caches[kind] = (key, make())
        return self._caches[kind][1]

    # -- builders of views (`Logical.build`) --------------------------------------------------------

    def split(self, fused: Logical, dim: int, offset: int, size: int, cache: dict):
        """One part of a target-side fused tensor; the fused tensor is dropped after its last part."""

        def build():
            if "t" not in cache:
                cache.clear()
                cache["t"] = self.load(fused, "target")
            out = _narrow(cache["t"], dim, offset, size)
            if offset + size >= cache["t"].shape[dim]:
                cache.clear()
            return out

        return build

    def cat(self, pieces: list[Logical], dim: int):
        """Target-side parts concatenated into the reference's fused tensor."""

        def build():
            import numpy as np

            return np.concatenate([self.load(p, "target") for p in pieces], axis=dim)

        return build

    def expert(self, lg: Logical, side: str, expert: int, dim: int, offset: int, size: int, cut: bool):
        """One expert's part of a stacked tensor [E, …] (before any --transform)."""

        def build():
            import numpy as np

            x = self._cached("stack", (side, lg.name), lambda: self.load_raw(lg, side))[expert]
            return _narrow(x, dim, offset, size) if cut else np.ascontiguousarray(x)

        return build

    def block(self, comp: Logical, side: str, seg):
        """One block of a content-matched composite."""
        from ffdebug.weights.content import cut

        def build():
            return cut(self._cached("content", (side, comp.name), lambda: self.load(comp, side)), seg)

        return build
