"""safetensors files read one tensor at a time.

`SafetensorsFile` reads the header once at open (which validates the file) and each tensor on
demand through `safe_open`. The handle is dropped after every `RECYCLE_BYTES` read so the pages of
its memory map leave the resident set (a handle kept open for a whole 2 GiB file would keep all
2 GiB resident).
"""

from __future__ import annotations

import os

from ffdebug.errors import FFDebugError, short_reason

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


def _check_exists(path: str) -> None:
    if not os.path.exists(path):
        raise FFDebugError(f"{path}: payload file is missing; the store is incomplete — re-run the dump")


def verify_payload(path: str) -> None:
    """A store payload file exists and its safetensors header covers the file."""
    from safetensors import SafetensorError

    _check_exists(path)
    try:
        with _safe_open(path) as f:
            list(f.keys())
    except (SafetensorError, OSError, ValueError) as err:
        raise unreadable(path, err, _STORE_HINT) from None


def load_payload(path: str, name: str):
    """One tensor of a store payload file (opened for this read only)."""
    from safetensors import SafetensorError

    _check_exists(path)
    try:
        with _safe_open(path) as f:
            return f.get_tensor(name)
    except (SafetensorError, OSError, ValueError) as err:
        raise unreadable(path, err, _STORE_HINT) from None
