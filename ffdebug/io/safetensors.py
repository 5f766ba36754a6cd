"""safetensors files read one tensor at a time.

`SafetensorsFile` reads the header once at open (which validates the file) and each tensor on
demand through `safe_open`. The handle is dropped after every `RECYCLE_BYTES` read so the pages of
its memory map leave the resident set (a handle kept open for a whole 2 GiB file would keep all
2 GiB resident).
"""

from __future__ import annotations

import os

from ffdebug.errors import FFDebugError, short_reason
from ffdebug.io.contained import check_regular, loads_bounded, open_regular, read_bounded

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


def _payload_bytes(path: str) -> bytes:
    """The payload file's bytes, read through a checked descriptor (`ffdebug.io.contained`):
    never by name through the library, so a FIFO, device or symlink is refused first."""
    return read_bounded(path, None, "payload file", _MISSING)


def verify_payload(path: str) -> None:
    """A store payload file is a regular file whose safetensors header covers it exactly."""
    fd = open_regular(path, "payload file", _MISSING)
    try:
        size = os.fstat(fd).st_size
        head = os.read(fd, 8)
        if len(head) < 8:
            raise _damaged(path, "shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or n > size - 8:
            raise _damaged(path, f"header length {n} exceeds the file")
        header = os.read(fd, n) if n else b""
    finally:
        os.close(fd)
    try:
        meta = loads_bounded(header.decode("utf-8"), path, "safetensors header")
    except (UnicodeDecodeError, FFDebugError):
        raise _damaged(path, "header is not JSON") from None
    if not isinstance(meta, dict):
        raise _damaged(path, "header is not a JSON object")
    end = 0
    for name, info in meta.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise _damaged(path, f"tensor {name[:40]!r} has no valid data_offsets")
        end = max(end, offsets[1])
    if end != size - 8 - n:
        raise _damaged(path, f"data ends at {end} but the file holds {size - 8 - n} bytes")


def _damaged(path: str, reason: str) -> FFDebugError:
    return FFDebugError(f"{path}: unreadable safetensors file ({reason}); {_STORE_HINT}")


def load_payload(path: str, name: str):
    """One tensor of a store payload file (read whole through a checked descriptor)."""
    from safetensors.torch import load

    data = _payload_bytes(path)
    try:
        tensors = load(data)
    except Exception as err:  # SafetensorError, ValueError, ...
        raise unreadable(path, err, _STORE_HINT) from None
    if name not in tensors:
        raise FFDebugError(
            f"{path}: payload holds no tensor {name[:80]!r}; the store is damaged — re-run the dump"
        )
    return tensors[name]
