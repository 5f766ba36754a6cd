"""Stand-ins for two `rich` modules until something uses them (CLI start-up; docs/cli.md "CLI conventions").

typer's help formatter (`typer.rich_utils`) imports `rich.markdown` (and with it `markdown_it`) and
`rich.traceback` (and with it `rich.syntax` and `pygments`) at module level: about 95 ms of every
`ffdebug --help` (bench/bench_cli_startup.py). It builds a `Markdown` only in
`rich_markup_mode="markdown"` and a `Traceback` only for pretty exceptions; ffdebug's apps use
`"rich"` and turn pretty exceptions off, so neither is built on the way to a help page or a one-line
error. `install()` puts a stand-in module in each place: its class loads the real module when
instantiated, and any other attribute loads it too (the real module then replaces the stand-in in
`sys.modules` and on `rich`).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

DEFERRED = {"rich.markdown": "Markdown", "rich.traceback": "Traceback"}  # module: the class typer imports


def _real(name: str) -> types.ModuleType:
    """The real module `name`, imported now if only its stand-in was there."""
    if isinstance(sys.modules.get(name), _StandIn):
        del sys.modules[name]
    module = importlib.import_module(name)
    setattr(sys.modules["rich"], name.rsplit(".", 1)[1], module)
    return module


class _StandIn(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):  # the import system's own probes (`__path__` for a from-import)
            raise AttributeError(attr)
        return getattr(_real(self.__name__), attr)


def _deferred_class(module: str, name: str) -> type:
    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return getattr(_real(module), name)(*args, **kwargs)

    return type(
        name, (), {"__new__": __new__, "__doc__": f"`{module}.{name}(...)`, built by the real module."}
    )


def install() -> None:
    """Put the stand-ins in place, each unless its module is already loaded."""
    import rich

    for module, name in DEFERRED.items():
        if module in sys.modules:
            continue
        stand_in = _StandIn(module, __doc__)
        setattr(stand_in, name, _deferred_class(module, name))
        sys.modules[module] = stand_in
        setattr(rich, module.rsplit(".", 1)[1], stand_in)
