"""`.pt` / `.pth` / `.bin` files: the one `torch.load` of ffdebug, always `weights_only=True`.

A pickle that needs more than tensors and containers is refused with a one-line error, never
executed. Zip-format files are memory-mapped (`mmap=True`), so a tensor's bytes are read when it
is used; legacy (non-zip) files cannot be mapped and are read whole.
"""

from __future__ import annotations

from ffdebug.errors import FFDebugError, short_reason


def load_weights_only(path: str):
    """The object stored in `path`, loaded with `torch.load(weights_only=True)` on the CPU."""
    import pickle
    import zipfile

    import torch

    from ffdebug.io.contained import check_regular

    check_regular(path, ".pt file")  # a FIFO or device would block torch.load
    try:
        mmap = zipfile.is_zipfile(path)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise FFDebugError(
            f"{path}: refused to load: not a weights-only checkpoint ({short_reason(err)}); "
            "re-save it as a state dict of tensors or as safetensors"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as err:
        raise FFDebugError(f"{path}: unreadable .pt file ({short_reason(err)})") from None


def flatten_tensors(obj, prefix: str = "") -> dict:
    """Every tensor of nested dicts / lists / tuples, by dotted path (`a.b.0`), in order."""
    out: dict = {}
    _flatten(prefix, obj, out)
    return out


def _flatten(prefix: str, obj, out: dict) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(f"{prefix}.{i}" if prefix else str(i), v, out)
