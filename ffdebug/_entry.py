"""Python entries `module:function` and `path/to/file.py:function`: the one loader that every
command taking user code uses (weights-diff and load-audit sources, layout transforms, bisect
attribution models, trace functions). Errors are one line naming the entry and the fix."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys

from ffdebug.errors import FFDebugError, short_reason

ENTRY_RE = re.compile(r"^(?P<module>[A-Za-z_][\w.]*|[^:]+\.py):(?P<func>[A-Za-z_][\w.]*)$")


def is_entry_spec(text) -> bool:
    """True for a string shaped like an entry that is not an existing path."""
    return isinstance(text, str) and not os.path.exists(text) and bool(ENTRY_RE.match(text))


def resolve_entry(spec: str):
    """The callable named by `module:function` or `path/to/file.py:function`."""
    m = ENTRY_RE.match(spec)
    if not m:
        raise FFDebugError(f"{spec!r}: not a Python entry; use module:function or path/to/file.py:function")
    mod_name, func = m.group("module"), m.group("func")
    try:
        if mod_name.endswith(".py"):
            if not os.path.exists(mod_name):
                raise FFDebugError(f"{spec}: file {mod_name} does not exist")
            name = "_ffdebug_entry_" + re.sub(r"\W", "_", os.path.abspath(mod_name))
            spec_obj = importlib.util.spec_from_file_location(name, mod_name)
            module = importlib.util.module_from_spec(spec_obj)
            sys.modules[name] = module
            folder = os.path.dirname(os.path.abspath(mod_name))
            if folder not in sys.path:  # sibling imports, also those the function makes when called
                sys.path.insert(0, folder)
            spec_obj.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path and "" not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
    except FFDebugError:
        raise
    except Exception as err:
        raise FFDebugError(
            f"{spec}: cannot import {mod_name} ({type(err).__name__}: {str(err)[:120]}); run from the "
            "folder that holds it or install it"
        ) from err
    obj = module
    for part in func.split("."):
        if not hasattr(obj, part):
            raise FFDebugError(f"{spec}: {mod_name} has no attribute {func}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FFDebugError(f"{spec}: {func} is not callable")
    return obj


def call_entry(spec: str, *args):
    """Call an entry with as many of `args` as it takes positionally (0 or more; a parameter with
    a default takes one too: `build(checkpoint=None)` gets the checkpoint)."""
    fn = resolve_entry(spec)
    try:
        sig = inspect.signature(fn).parameters.values()
        params = [p for p in sig if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        n = len(args) if any(p.kind == p.VAR_POSITIONAL for p in sig) else len(params)
    except (TypeError, ValueError):
        n = 0
    try:
        return fn(*args[:n])
    except FFDebugError:
        raise
    except Exception as err:
        raise FFDebugError(f"{spec}: raised {type(err).__name__}: {short_reason(err)}") from err
