"""safetensors files read one tensor at a time, as numpy arrays (`ffdebug.arrays`), without torch.

Both kinds of file are read here without the safetensors library (whose numpy reader has no
bfloat16 or float8): the header is parsed and checked, then each tensor's bytes are mapped (zero
copy; the pages are those of the page cache, faulted in as the comparison reads them, and leave
the resident set with the array) — or, when not aligned for their dtype, read once with `preadv`
into the array's own buffer (docs/benchmarks.md "Benchmarks").

`SafetensorsFile` (a checkpoint shard, many tensors) checks the whole header at open: every
tensor's dtype, shape and data offsets inside the file. Store payload files (one tensor each)
are read by `load_payload`.
"""

from __future__ import annotations

import math
import os

from ffdebug.arrays import dtype
from ffdebug.errors import FFDebugError
from ffdebug.io.contained import check_regular, loads_bounded, open_regular

SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "C64": "complex64",
}


class SafetensorsFile:
    """Header read and checked once at open; tensors mapped one at a time on demand."""

    HINT = "it may be truncated or not safetensors — re-save or re-download it"

    def __init__(self, path: str) -> None:
        self.path = path
        self.meta: dict[str, tuple[tuple[int, ...], str]] = {}
        self._where: dict[str, tuple[int, int]] = {}  # name -> (file offset, bytes)
        check_regular(path, "safetensors file")  # a FIFO or device would block the open
        fd = open_regular(path, "safetensors file", self.HINT)
        try:
            size = os.fstat(fd).st_size
            n, header = _read_header(fd, path, size, self.HINT)
        finally:
            os.close(fd)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype, shape = _dtype_and_shape(path, name, info, self.HINT)
            begin, nbytes = _extent(path, name, info, dtype, shape, size - 8 - n, self.HINT)
            self.meta[name] = (shape, str(dtype))
            self._where[name] = (8 + n + begin, nbytes)

    def get(self, name: str):
        """Tensor `name` as a numpy array over a private mapping of the file (or a copy where
        its data is not aligned for its dtype)."""
        shape, code = self.meta[name]
        start, nbytes = self._where[name]
        fd = open_regular(self.path, "safetensors file", self.HINT)
        try:
            return _array_at(fd, os.fstat(fd).st_size, start, nbytes, dtype(code), shape, self.path)
        finally:
            os.close(fd)


_STORE_HINT = "it may be truncated — re-run the dump"
_MISSING = "the store is incomplete — re-run the dump"
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own header limit


def _read_header(fd: int, path: str, size: int, hint: str = _STORE_HINT) -> tuple[int, dict]:
    """(header length, header object) of the safetensors file open on `fd` (`size` bytes)."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise _damaged(path, "shorter than a safetensors header", hint)
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER_BYTES or n > size - 8:
        raise _damaged(path, f"header length {n} exceeds the file", hint)
    header = os.pread(fd, n, 8) if n else b""
    try:
        meta = loads_bounded(header.decode("utf-8"), path, "safetensors header")
    except (UnicodeDecodeError, FFDebugError):
        raise _damaged(path, "header is not JSON", hint) from None
    if not isinstance(meta, dict):
        raise _damaged(path, "header is not a JSON object", hint)
    return n, meta


def _offsets(path: str, name: str, info, hint: str = _STORE_HINT) -> tuple[int, int]:
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise _damaged(path, f"tensor {name[:40]!r} has no valid data_offsets", hint)
    return offsets[0], offsets[1]


def _extent(path: str, name: str, info, dt, shape, data_bytes: int, hint: str) -> tuple[int, int]:
    """(offset in the data section, bytes) of one tensor, checked to fit its shape and the file."""
    begin, end = _offsets(path, name, info, hint)
    if not 0 <= begin <= end <= data_bytes or end - begin != math.prod(shape) * dt.itemsize:
        raise _damaged(path, f"tensor {name[:40]!r} has data_offsets [{begin}, {end}] that do not fit", hint)
    return begin, end - begin


def verify_payload(path: str) -> None:
    """A store payload file is a regular file whose safetensors header covers it exactly."""
    fd = open_regular(path, "payload file", _MISSING)
    try:
        size = os.fstat(fd).st_size
        n, meta = _read_header(fd, path, size)
    finally:
        os.close(fd)
    end = 0
    for name, info in meta.items():
        if name != "__metadata__":
            end = max(end, _offsets(path, name, info)[1])
    if end != size - 8 - n:
        raise _damaged(path, f"data ends at {end} but the file holds {size - 8 - n} bytes")


def _damaged(path: str, reason: str, hint: str = _STORE_HINT) -> FFDebugError:
    return FFDebugError(f"{path}: unreadable safetensors file ({reason}); {hint}")


def load_payload(path: str, name: str):
    """One tensor of a store payload file as a numpy array, through a checked descriptor: the
    header is parsed and checked here, then the data is mapped (`_array_at`)."""
    fd = open_regular(path, "payload file", _MISSING)
    try:
        size = os.fstat(fd).st_size
        n, meta = _read_header(fd, path, size)
        info = meta.get(name) if name != "__metadata__" else None
        if info is None:
            raise FFDebugError(
                f"{path}: payload holds no tensor {name[:80]!r}; the store is damaged — re-run the dump"
            )
        dt, shape = _dtype_and_shape(path, name, info)
        begin, nbytes = _extent(path, name, info, dt, shape, size - 8 - n, _STORE_HINT)
        return _array_at(fd, size, 8 + n + begin, nbytes, dt, shape, path)
    finally:
        os.close(fd)


def _array_at(fd: int, size: int, start: int, nbytes: int, dt, shape: tuple, path: str):
    """`nbytes` bytes of the file open on `fd` at `start`, as an array of `dt` and `shape`:
    mapped (`_mapped`, no copy) where the bytes are aligned for the dtype, else read once with
    `preadv` into the array's own buffer."""
    import numpy as np

    if nbytes and start % dt.itemsize == 0:
        return _mapped(fd, size, start, nbytes).view(dt).reshape(shape)
    buf = np.empty(nbytes, dtype=np.uint8)
    _pread_into(fd, buf, start, path)
    return buf.view(dt).reshape(shape)


def _mapped(fd: int, size: int, start: int, nbytes: int):
    """`nbytes` bytes of the file at `start` as a uint8 array over a private mapping (the array
    holds the mapping; writes to it copy the page and never reach the file).

    Reading a 5 MiB payload this way costs about 1/30 of `preadv` into a fresh buffer (bench/README.md:
    no zero-filled pages, no copy). `MADV_WILLNEED` starts the kernel's read of pages not yet in
    the page cache, so the read-ahead thread still overlaps disk reads with the maths. Payload files
    are replaced, never rewritten, by the writer (`os.replace`), so a mapped file keeps its bytes;
    a file truncated in place by another program while mapped would fault (SIGBUS)."""
    import mmap

    import numpy as np

    mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
        mm.madvise(mmap.MADV_WILLNEED, start - start % mmap.PAGESIZE, nbytes + start % mmap.PAGESIZE)
    return np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=start)


def _dtype_and_shape(path: str, name: str, info: dict, hint: str = _STORE_HINT):
    if not isinstance(info, dict):
        raise _damaged(path, f"tensor {name[:40]!r} has no description", hint)
    code, shape = info.get("dtype"), info.get("shape")
    dt = dtype(SAFETENSORS_DTYPES.get(code, "")) if isinstance(code, str) else None
    if dt is None:
        raise _damaged(path, f"tensor {name[:40]!r} has an unknown dtype {str(code)[:20]!r}", hint)
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise _damaged(path, f"tensor {name[:40]!r} has no valid shape", hint)
    return dt, tuple(shape)


def _pread_into(fd: int, buf, offset: int, path: str) -> None:
    """Fill the uint8 array `buf` from `fd` at `offset` (a short file is a damaged store)."""
    view = memoryview(buf)
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise _damaged(path, "data ends before the tensor does")
        done += got
