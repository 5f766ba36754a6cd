"""Every environment variable ffdebug reads, parsed and validated once per process (docs/dumping.md "Dumping your own runs").

`dump_config()` returns `None` when forward dumps are disabled (no `FFDEBUG_FWD_DUMP_DIR` and no
`ATOM_FWD_DUMP_DIR`), so the disabled path costs one cached lookup. An invalid value raises
`FFDebugError` naming the variable. ATOM spellings map onto ours; when both are set ours wins and a
warning says so.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field

from ffdebug.errors import FFDebugError
from ffdebug.logs import get_logger

# ATOM name -> (our name, value translation)
_ATOM_ALIASES: dict[str, tuple[str, dict[str, str] | None]] = {
    "ATOM_FWD_DUMP_DIR": ("FFDEBUG_FWD_DUMP_DIR", None),
    "ATOM_FWD_DUMP_LAYERS": ("FFDEBUG_FWD_DUMP_LAYERS", None),
    "ATOM_FWD_DUMP_BLOCK_CLASS": ("FFDEBUG_FWD_DUMP_BLOCK_CLASS", None),
    "ATOM_FWD_DUMP_LAYER_ATTR": ("FFDEBUG_FWD_DUMP_LAYER_ATTR", None),
    "ATOM_FWD_DUMP_ONE_SHOT": ("FFDEBUG_FWD_DUMP_CALLS", {"1": "0", "0": "all"}),
    "ATOM_FWD_DUMP_STATS_ONLY": ("FFDEBUG_FWD_DUMP_MODE", {"1": "stats", "0": "full"}),
    "ATOM_WEIGHT_DUMP_DIR": ("FFDEBUG_WEIGHT_DUMP_DIR", None),
    "ATOM_WEIGHT_DUMP_LAYERS": ("FFDEBUG_WEIGHT_DUMP_LAYERS", None),
    "ATOM_WEIGHT_DUMP_EXIT": ("FFDEBUG_WEIGHT_DUMP_EXIT", None),
    "ATOM_DEBUG_TOPK": ("FFDEBUG_DEBUG_TOPK", None),
}

_SIDE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _get(name: str, environ: dict[str, str]) -> str | None:
    """Value of an FFDEBUG variable, falling back to its ATOM alias."""
    value = environ.get(name)
    for atom_name, (ours, translate) in _ATOM_ALIASES.items():
        if ours != name or atom_name not in environ:
            continue
        atom_value = environ[atom_name]
        if translate is not None:
            if atom_value not in translate:
                raise FFDebugError(
                    f"{atom_name}={atom_value!r} is invalid: use one of {', '.join(sorted(translate))}"
                )
            atom_value = translate[atom_value]
        if value is not None:
            if value != atom_value:
                get_logger("env").warning("both %s and %s are set; using %s=%r", name, atom_name, name, value)
            return value
        return atom_value
    return value


@dataclass(frozen=True)
class LayerSelection:
    """Parsed `0,2,5-7,-1` (ranges; negatives count from the end; `5-` means 5 to the end)."""

    spec: str = "all"
    items: tuple[tuple[int, int | None], ...] = ()  # inclusive (start, end); end None = open

    @property
    def all(self) -> bool:
        return self.spec == "all"

    def contains(self, layer: int, num_layers: int | None) -> bool:
        if self.all:
            return True
        for start, end in self.items:
            if num_layers is not None:
                start = start + num_layers if start < 0 else start
                if end is not None:
                    end = end + num_layers if end < 0 else end
            if end is None:
                if layer >= start:
                    return True
            elif start <= layer <= end:
                return True
        return False


def parse_layers(spec: str | None, variable: str = "--layers") -> LayerSelection:
    """Parse a layer selection; raises FFDebugError naming `variable` on bad syntax."""
    if spec is None or spec.strip() in ("", "all"):
        return LayerSelection()
    items: list[tuple[int, int | None]] = []
    for part in spec.split(","):
        part = part.strip()
        m = re.fullmatch(r"(-?\d+)(?:-(-?\d+)?)?", part)
        if not m:
            raise FFDebugError(
                f"{variable}={spec!r} is invalid: use comma-separated layers and ranges like '0,2,5-7,-1'"
            )
        start = int(m.group(1))
        if m.group(2) is not None:
            end = int(m.group(2))
            if (start < 0) == (end < 0) and start > end:
                raise FFDebugError(
                    f"{variable}={spec!r} is invalid: range {part!r} is reversed; write it low-high"
                )
            items.append((start, end))
        elif part.endswith("-") and not part.startswith("-"):
            items.append((start, None))
        else:
            items.append((start, start))
    return LayerSelection(spec=spec, items=tuple(items))


@dataclass(frozen=True)
class CallSelection:
    """`all`, `first-real`, `N` or `A-B` (forward calls of the root module, from 0)."""

    spec: str = "all"
    lo: int = 0
    hi: int | None = None

    @property
    def first_real(self) -> bool:
        return self.spec == "first-real"

    def contains(self, call: int) -> bool:
        if self.spec in ("all", "first-real"):
            return True
        return self.lo <= call and (self.hi is None or call <= self.hi)


def parse_calls(spec: str | None, variable: str = "FFDEBUG_FWD_DUMP_CALLS") -> CallSelection:
    if spec is None or spec in ("all", ""):
        return CallSelection()
    if spec == "first-real":
        return CallSelection(spec=spec)
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", spec.strip())
    if not m:
        raise FFDebugError(f"{variable}={spec!r} is invalid: use 'all', 'first-real', 'N' or 'A-B'")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    return CallSelection(spec=spec, lo=lo, hi=hi)


@dataclass(frozen=True)
class DumpConfig:
    """Validated forward-dump settings for this process."""

    dir: str
    side: str = "target"
    layers: LayerSelection = field(default_factory=LayerSelection)
    block_classes: tuple[str, ...] = ()  # empty = auto
    layer_attrs: tuple[str, ...] = ("layer_id", "layer_idx", "layer_number")
    stages: tuple[str, ...] = ()  # globs; empty = all
    calls: CallSelection = field(default_factory=CallSelection)
    mode: str = "full"  # full | stats | sketch
    sketch_seed: int = 0  # FFDEBUG_FWD_DUMP_SKETCH_SEED: the same on both sides
    grads: bool = False
    max_bytes: int | None = None
    queue_bytes: int = 256 << 20  # background writer bound (ffdebug.store.background); 0: write inline
    ranks: LayerSelection = field(default_factory=LayerSelection)
    overwrite: bool = False
    topk: int = 0
    tap_functions: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (module:function, stage names)
    substages: bool = False  # role sub-stages inside every block (docs/dumping.md "Role sub-stages")
    grad_sample: int = 0  # gradient elements sampled per parameter tensor by `ffdebug.tap_grads` (0: off)
    feed_dir: str | None = (
        None  # FFDEBUG_FWD_FEED_DIR: blocks fed the reference's hidden_in (capture/feed.py)
    )

    def keep_stage(self, key: str) -> bool:
        return not self.stages or any(fnmatch.fnmatchcase(key, g) for g in self.stages)


@dataclass(frozen=True)
class WeightDumpConfig:
    dir: str
    layers: LayerSelection = field(default_factory=LayerSelection)
    exit: bool = True


def _bool(name: str, value: str | None, default: bool) -> bool:
    if value is None or value == "":
        return default
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise FFDebugError(f"{name}={value!r} is invalid: use 1 or 0")


def _int(name: str, value: str | None, minimum: int = 0) -> int | None:
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        raise FFDebugError(f"{name}={value!r} is invalid: use a whole number") from None
    if number < minimum:
        raise FFDebugError(f"{name}={value!r} is invalid: use a number >= {minimum}")
    return number


def check_side(side: str, variable: str) -> str:
    if not _SIDE_RE.match(side):
        raise FFDebugError(
            f"{variable}={side!r} is invalid: use a short label such as ref or target "
            "(letters, digits, '_', '-', '.')"
        )
    return side


def check_mode(mode: str, variable: str) -> str:
    if mode not in ("full", "stats", "sketch"):
        raise FFDebugError(f"{variable}={mode!r} is invalid: use 'full', 'stats' or 'sketch'")
    return mode


def split_list(value: str | None) -> tuple[str, ...]:
    if not value:
        return ()
    return tuple(v.strip() for v in value.split(",") if v.strip())


def read_dump_config(environ: dict[str, str] | None = None) -> DumpConfig | None:
    """Parse the forward-dump variables; None when dumps are disabled."""
    env = dict(os.environ if environ is None else environ)
    directory = _get("FFDEBUG_FWD_DUMP_DIR", env)
    if not directory:
        return None
    side = check_side(_get("FFDEBUG_FWD_DUMP_SIDE", env) or "target", "FFDEBUG_FWD_DUMP_SIDE")
    mode = check_mode(_get("FFDEBUG_FWD_DUMP_MODE", env) or "full", "FFDEBUG_FWD_DUMP_MODE")
    attrs = split_list(_get("FFDEBUG_FWD_DUMP_LAYER_ATTR", env)) or ("layer_id", "layer_idx", "layer_number")
    return DumpConfig(
        dir=directory,
        side=side,
        layers=parse_layers(_get("FFDEBUG_FWD_DUMP_LAYERS", env), "FFDEBUG_FWD_DUMP_LAYERS"),
        block_classes=tuple(c for c in split_list(_get("FFDEBUG_FWD_DUMP_BLOCK_CLASS", env)) if c != "auto"),
        layer_attrs=attrs,
        stages=split_list(_get("FFDEBUG_FWD_DUMP_STAGES", env)),
        calls=parse_calls(_get("FFDEBUG_FWD_DUMP_CALLS", env)),
        mode=mode,
        sketch_seed=_int("FFDEBUG_FWD_DUMP_SKETCH_SEED", _get("FFDEBUG_FWD_DUMP_SKETCH_SEED", env)) or 0,
        grads=_bool("FFDEBUG_FWD_DUMP_GRADS", _get("FFDEBUG_FWD_DUMP_GRADS", env), False),
        max_bytes=_int("FFDEBUG_FWD_DUMP_MAX_BYTES", _get("FFDEBUG_FWD_DUMP_MAX_BYTES", env), 1),
        queue_bytes=_queue_bytes(_get("FFDEBUG_FWD_DUMP_QUEUE_BYTES", env)),
        ranks=parse_layers(_get("FFDEBUG_FWD_DUMP_RANKS", env), "FFDEBUG_FWD_DUMP_RANKS"),
        overwrite=_bool("FFDEBUG_FWD_DUMP_OVERWRITE", _get("FFDEBUG_FWD_DUMP_OVERWRITE", env), False),
        topk=_int("FFDEBUG_DEBUG_TOPK", _get("FFDEBUG_DEBUG_TOPK", env)) or 0,
        substages=_bool("FFDEBUG_FWD_DUMP_SUBSTAGES", _get("FFDEBUG_FWD_DUMP_SUBSTAGES", env), False),
        grad_sample=_int("FFDEBUG_FWD_DUMP_GRAD_SAMPLE", _get("FFDEBUG_FWD_DUMP_GRAD_SAMPLE", env)) or 0,
        tap_functions=parse_tap_functions(
            _get("FFDEBUG_FWD_DUMP_TAP_FUNCTIONS", env), "FFDEBUG_FWD_DUMP_TAP_FUNCTIONS"
        ),
        feed_dir=_get("FFDEBUG_FWD_FEED_DIR", env) or None,
    )


def _queue_bytes(value: str | None) -> int:
    n = _int("FFDEBUG_FWD_DUMP_QUEUE_BYTES", value, 0)
    return 256 << 20 if n is None else n


def parse_tap_functions(value: str | None, name: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """`pkg.mod:fn=attn.q_rot,attn.k_rot;other.mod:g=stage` into (spec, stages) pairs."""
    out = []
    for part in (value or "").split(";"):
        part = part.strip()
        if not part:
            continue
        spec, _, stages = part.partition("=")
        mod, _, fn = spec.strip().partition(":")
        names = tuple(s.strip() for s in stages.split(",") if s.strip())
        if not mod or not fn.isidentifier() or not names:
            raise FFDebugError(
                f"{name}={value!r} is invalid: use 'pkg.module:function=stage[,stage...]' entries joined by ';', "
                "e.g. 'mypkg.rope:apply_rope=attn.q_rot,attn.k_rot'"
            )
        out.append((f"{mod}:{fn}", names))
    return tuple(out)


def read_weight_dump_config(environ: dict[str, str] | None = None) -> WeightDumpConfig | None:
    env = dict(os.environ if environ is None else environ)
    directory = _get("FFDEBUG_WEIGHT_DUMP_DIR", env)
    if not directory:
        return None
    return WeightDumpConfig(
        dir=directory,
        layers=parse_layers(_get("FFDEBUG_WEIGHT_DUMP_LAYERS", env), "FFDEBUG_WEIGHT_DUMP_LAYERS"),
        exit=_bool("FFDEBUG_WEIGHT_DUMP_EXIT", _get("FFDEBUG_WEIGHT_DUMP_EXIT", env), True),
    )


_UNSET = object()
_dump_config: object = _UNSET


def dump_config() -> DumpConfig | None:
    """The process-wide forward-dump config, read once at first use."""
    global _dump_config
    if _dump_config is _UNSET:
        _dump_config = read_dump_config()
    return _dump_config  # type: ignore[return-value]


def forget_dump_config() -> None:
    """Forget the cached config: the next use reads os.environ again (`capture.state.reset`)."""
    global _dump_config
    _dump_config = _UNSET


def selected_env() -> dict[str, str]:
    """The FFDEBUG_* / ATOM_* variables of this process, recorded in run.json."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("FFDEBUG_", "ATOM_"))}


def debug_tracebacks() -> bool:
    return os.environ.get("FFDEBUG_DEBUG", "0") not in ("", "0")


PROGRESS_INTERVAL_S = 10.0  # FFDEBUG_PROGRESS_INTERVAL's default: one line every 10 s without a TTY


def progress_interval(environ: dict[str, str] | None = None) -> float:
    """`FFDEBUG_PROGRESS_INTERVAL`: seconds between progress lines on stderr without a TTY (0: one
    line per item; docs/cli.md "Progress"). Raises FFDebugError naming the variable on a bad value."""
    env = os.environ if environ is None else environ
    value = env.get("FFDEBUG_PROGRESS_INTERVAL", "").strip()
    if not value:
        return PROGRESS_INTERVAL_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not (0.0 <= seconds < float("inf")):
        raise FFDebugError(
            f"FFDEBUG_PROGRESS_INTERVAL={value!r} is invalid: use seconds >= 0, e.g. 10 (0: a line per item)"
        )
    return seconds
