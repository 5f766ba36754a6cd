"""safetensors files read one tensor at a time.

`SafetensorsFile` reads the header once at open (which validates the file) and each tensor on
demand through `safe_open`. The handle is dropped after every `RECYCLE_BYTES` read so the pages of
its memory map leave the resident set (a handle kept open for a whole 2 GiB file would keep all
2 GiB resident).

Store payload files (one tensor each) are read by `load_payload` without the library: the header
is parsed and checked here, then the data bytes are mapped (zero copy) — or, when not aligned for
their dtype, read once with `preadv` into the tensor's own buffer (README "Benchmarks").
"""

from __future__ import annotations

import math
import os

from ffdebug.errors import FFDebugError, short_reason
from ffdebug.io.contained import check_regular, loads_bounded, open_regular

RECYCLE_BYTES = 64 << 20

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


def _safe_open(path: str):
    from safetensors import safe_open

    return safe_open(path, framework="pt")


def unreadable(path: str, err: Exception, hint: str) -> FFDebugError:
    return FFDebugError(f"{path}: unreadable safetensors file ({short_reason(err)}); {hint}")


class SafetensorsFile:
    """Header read once at open (validates the file); tensors read one at a time on demand."""

    HINT = "it may be truncated or not safetensors — re-save or re-download it"

    def __init__(self, path: str) -> None:
        self.path = path
        self._handle = None
        self._read = 0
        self.meta: dict[str, tuple[tuple[int, ...], str]] = {}
        check_regular(path, "safetensors file")  # a FIFO or device would block the library's open
        try:
            f = _safe_open(path)
            for name in f.keys():
                sl = f.get_slice(name)
                code = sl.get_dtype()
                self.meta[name] = (tuple(sl.get_shape()), SAFETENSORS_DTYPES.get(code, code.lower()))
            del f
        except Exception as err:  # SafetensorError, OSError, ValueError, ...
            raise unreadable(path, err, self.HINT) from None

    def get(self, name: str):
        try:
            if self._handle is None:
                self._handle = _safe_open(self.path)
            t = self._handle.get_tensor(name)
        except Exception as err:
            self._handle = None
            raise unreadable(self.path, err, self.HINT) from None
        self._read += t.numel() * t.element_size()
        if self._read >= RECYCLE_BYTES:
            self._handle, self._read = None, 0
        return t


_STORE_HINT = "it may be truncated — re-run the dump"
_MISSING = "the store is incomplete — re-run the dump"
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own header limit


def _read_header(fd: int, path: str, size: int) -> tuple[int, dict]:
    """(header length, header object) of the safetensors file open on `fd` (`size` bytes)."""
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise _damaged(path, "shorter than a safetensors header")
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER_BYTES or n > size - 8:
        raise _damaged(path, f"header length {n} exceeds the file")
    header = os.pread(fd, n, 8) if n else b""
    try:
        meta = loads_bounded(header.decode("utf-8"), path, "safetensors header")
    except (UnicodeDecodeError, FFDebugError):
        raise _damaged(path, "header is not JSON") from None
    if not isinstance(meta, dict):
        raise _damaged(path, "header is not a JSON object")
    return n, meta


def _offsets(path: str, name: str, info) -> tuple[int, int]:
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise _damaged(path, f"tensor {name[:40]!r} has no valid data_offsets")
    return offsets[0], offsets[1]


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


def _damaged(path: str, reason: str) -> FFDebugError:
    return FFDebugError(f"{path}: unreadable safetensors file ({reason}); {_STORE_HINT}")


def load_payload(path: str, name: str):
    """One tensor of a store payload file, through a checked descriptor: the header is parsed and
    checked here, then the data is mapped (`_mapped`) — no copy; the pages are those of the page
    cache, faulted in as the comparison reads them — or, where the data is not aligned for its
    dtype, read once with `preadv` into the tensor's own buffer."""
    import torch

    fd = open_regular(path, "payload file", _MISSING)
    try:
        size = os.fstat(fd).st_size
        n, meta = _read_header(fd, path, size)
        info = meta.get(name) if name != "__metadata__" else None
        if info is None:
            raise FFDebugError(
                f"{path}: payload holds no tensor {name[:80]!r}; the store is damaged — re-run the dump"
            )
        dtype, shape = _dtype_and_shape(path, name, info)
        begin, end = _offsets(path, name, info)
        numel = math.prod(shape)
        if not 0 <= begin <= end <= size - 8 - n or end - begin != numel * dtype.itemsize:
            raise _damaged(path, f"tensor {name[:40]!r} has data_offsets [{begin}, {end}] that do not fit")
        start = 8 + n + begin
        if end > begin and start % dtype.itemsize == 0:
            return _mapped(fd, size, start, end - begin).view(dtype).reshape(shape)
        buf = torch.empty(end - begin, dtype=torch.uint8)
        _pread_into(fd, buf, start, path)
    finally:
        os.close(fd)
    return buf.view(dtype).reshape(shape)


def _mapped(fd: int, size: int, start: int, nbytes: int):
    """`nbytes` bytes of the file at `start` as a uint8 tensor over a private mapping (the tensor
    holds the mapping; writes to it copy the page and never reach the file).

    Reading a 5 MiB payload this way costs about 1/30 of `preadv` into a fresh buffer (bench/README.md:
    no zero-filled pages, no copy). `MADV_WILLNEED` starts the kernel's read of pages not yet in
    the page cache, so the read-ahead thread still overlaps disk reads with the maths. Payload files
    are replaced, never rewritten, by the writer (`os.replace`), so a mapped file keeps its bytes;
    a file truncated in place by another program while mapped would fault (SIGBUS)."""
    import mmap

    import torch

    mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
        mm.madvise(mmap.MADV_WILLNEED, start - start % mmap.PAGESIZE, nbytes + start % mmap.PAGESIZE)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=start)


def _dtype_and_shape(path: str, name: str, info: dict):
    import torch

    if not isinstance(info, dict):
        raise _damaged(path, f"tensor {name[:40]!r} has no description")
    code, shape = info.get("dtype"), info.get("shape")
    dtype = getattr(torch, SAFETENSORS_DTYPES.get(code, ""), None) if isinstance(code, str) else None
    if not isinstance(dtype, torch.dtype):
        raise _damaged(path, f"tensor {name[:40]!r} has an unknown dtype {str(code)[:20]!r}")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise _damaged(path, f"tensor {name[:40]!r} has no valid shape")
    return dtype, tuple(shape)


def _pread_into(fd: int, buf, offset: int, path: str) -> None:
    """Fill the uint8 tensor `buf` from `fd` at `offset` (a short file is a damaged store)."""
    view = memoryview(buf.numpy()) if buf.numel() else memoryview(b"")
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise _damaged(path, "data ends before the tensor does")
        done += got
