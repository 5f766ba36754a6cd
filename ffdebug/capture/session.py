"""A capture session: one side of one process writing into a dump store.

The session owns the filters (layers, stages, calls, ranks), the call counter of the instrumented
root module, the invocation counters, the step tags and the store writer. The process-wide
session is created from the environment at first use; `ffdebug.capture(...)` pushes an explicit
one for the duration of a `with` block.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from dataclasses import replace

from ffdebug._env import DumpConfig, dump_config

# Step tags pushed by `ffdebug.step(...)`, outermost first. Module-level so that tags work before any
# session exists and cost nothing when dumps are off.
_TAGS: list[dict] = []
_local = threading.local()


def current_tags() -> dict:
    merged: dict = {}
    for t in _TAGS:
        merged.update(t)
    return merged


def current_layer() -> int | None:
    stack = getattr(_local, "layers", None)
    return stack[-1] if stack else None


def push_layer(layer: int) -> None:
    if not hasattr(_local, "layers"):
        _local.layers = []
    _local.layers.append(layer)


def pop_layer() -> None:
    stack = getattr(_local, "layers", None)
    if stack:
        stack.pop()


def _dist_coords() -> tuple[int, int]:
    torch = sys.modules.get("torch")
    if torch is not None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _graph_capturing() -> bool:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return False
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except RuntimeError:
        return False


class Session:
    """Filters and writes captures for one side."""

    def __init__(self, config: DumpConfig, source: str = "env", declared_classes: str | None = None) -> None:
        self.config = config
        self.source = source
        self.declared_classes = declared_classes
        self.rank, self.world_size = _dist_coords()
        self.enabled_rank = config.ranks.contains(self.rank, self.world_size)
        self._writer = None
        self.captured = 0
        self.filtered = 0
        self.installs = 0
        self.blocks_found = 0
        self.num_layers: int | None = None
        # Call bookkeeping of the instrumented root module.
        self.call_counters: dict[tuple, int] = {}
        self.call: int | None = None
        self.call_depth = 0
        self.call_selected = True
        self.call_warmup_guess = False
        self.first_real_done = False
        self.invocations: dict[tuple, int] = {}
        self.input_ids_sha: str | None = None
        self.closed = False

    # -- writer -----------------------------------------------------------------------------
    @property
    def side_dir(self) -> str:
        return os.path.join(self.config.dir, self.config.side)

    def writer(self):
        if self._writer is None:
            from ffdebug.store.writer import StoreWriter

            self._writer = StoreWriter(
                self.side_dir,
                side=self.config.side,
                rank=self.rank,
                world_size=self.world_size,
                mode=self.config.mode,
                max_bytes=self.config.max_bytes,
                overwrite=self.config.overwrite,
            )
        return self._writer

    # -- calls ------------------------------------------------------------------------------
    def begin_call(self, input_ids=None) -> None:
        self.call_depth += 1
        if self.call_depth > 1:
            return
        tags = current_tags()
        key = tuple(sorted((k, str(v)) for k, v in tags.items()))
        self.call = self.call_counters.get(key, 0)
        self.call_counters[key] = self.call + 1
        self.invocations = {}
        self.call_warmup_guess = False
        calls = self.config.calls
        if calls.first_real:
            warm = tags.get("phase") == "warmup"
            if not warm and "phase" not in tags and input_ids is not None:
                # Engines that do not tag: a dummy batch (one repeated id) is a warm-up guess.
                warm = input_ids.numel() > 1 and bool((input_ids == input_ids.reshape(-1)[0]).all())
                self.call_warmup_guess = warm
            self.call_selected = not warm and not self.first_real_done
            if self.call_selected:
                self.first_real_done = True
        else:
            self.call_selected = calls.contains(self.call)

    def end_call(self) -> None:
        self.call_depth = max(0, self.call_depth - 1)
        if self.call_depth == 0:
            self.call = None
            self.call_selected = True

    def next_invocation(self, path: str) -> int:
        n = self.invocations.get(path, 0)
        self.invocations[path] = n + 1
        return n

    # -- capture ----------------------------------------------------------------------------
    def wants(self, key: str, layer: int | None) -> bool:
        if not self.enabled_rank or self.closed:
            return False
        if self.call_depth > 0 and not self.call_selected:
            return False
        if layer is not None and not self.config.layers.contains(layer, self.num_layers):
            return False
        # input ids are always kept (tiny, and the compare gate needs them)
        return key == "embed.input_ids" or self.config.keep_stage(key)

    def capture(self, key: str, tensor, **meta) -> None:
        """Clone-on-capture: the dump must not see later in-place ops."""
        layer = meta.get("layer")
        if not self.wants(key, layer):
            self.filtered += 1
            return
        if _graph_capturing():
            self.writer().count_skip("skipped_graph_capture")
            return
        tags = current_tags()
        meta.setdefault("call", self.call)
        meta.setdefault("invocation", 0)
        meta["step"] = {k: v for k, v in tags.items() if k not in ("phase", "shard", "reduction")}
        meta["phase"] = tags.get("phase")
        if self.call_warmup_guess:
            meta["phase"] = meta["phase"] or "warmup_guess"
        for reserved in ("shard", "reduction"):
            if reserved in tags:
                meta.setdefault(reserved, tags[reserved])
        ids = key == "embed.input_ids"
        t = tensor.detach()
        if self.config.mode == "full" or ids:
            t = t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()
        self.writer().write(key, t, meta, always_payload=ids)
        self.captured += 1

    def tap(self, stage: str, tensor, tags: dict) -> None:
        meta: dict = {"io": tags.pop("io", "out")}
        for reserved in ("shard", "reduction", "layer", "layer_class"):
            if reserved in tags:
                meta[reserved] = tags.pop(reserved)
        if "layer" not in meta and current_layer() is not None:
            meta["layer"] = current_layer()
        if tags:  # per-tap tags apply to this capture only
            _TAGS.append(tags)
            try:
                self.capture(stage, tensor, **meta)
            finally:
                _TAGS.pop()
        else:
            self.capture(stage, tensor, **meta)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._writer is not None:
            self._writer.close()

    def report_if_empty(self) -> None:
        if self.captured or not self.enabled_rank:
            return
        if self.installs and not self.blocks_found:
            why = (
                "no blocks were found: set FFDEBUG_FWD_DUMP_BLOCK_CLASS to the decoder layer class "
                "(e.g. LlamaDecoderLayer)"
            )
        elif self.installs and self.filtered:
            why = "every capture was filtered out: check FFDEBUG_FWD_DUMP_LAYERS / _STAGES / _CALLS"
        elif self.installs:
            why = (
                "the model never ran a forward after install, or it is compiled (torch.compile / CUDA "
                "graphs bypass module hooks)"
            )
        else:
            why = "ffdebug.install(model) was never called and no ffdebug.tap ran"
        print(f"ffdebug: warning: side '{self.config.side}' captured nothing: {why}", file=sys.stderr)


_ENV_SESSION: Session | None = None
_ENV_READ = False
_explicit: list[Session] = []


def env_session() -> Session | None:
    global _ENV_SESSION, _ENV_READ
    if not _ENV_READ:
        _ENV_READ = True
        config = dump_config()
        if config is not None:
            _ENV_SESSION = Session(config)
            atexit.register(_close_env_session)
    return _ENV_SESSION


def _close_env_session() -> None:
    if _ENV_SESSION is not None:
        _ENV_SESSION.report_if_empty()
        _ENV_SESSION.close()


def active_session() -> Session | None:
    """The innermost explicit `capture()` session, else the env session."""
    if _explicit:
        return _explicit[-1]
    return env_session()


def push_explicit(session: Session) -> None:
    _explicit.append(session)


def pop_explicit(session: Session) -> None:
    if session in _explicit:
        _explicit.remove(session)


def reset_for_tests() -> None:
    global _ENV_SESSION, _ENV_READ
    if _ENV_SESSION is not None:
        _ENV_SESSION.close()
    _ENV_SESSION = None
    _ENV_READ = False
    _explicit.clear()
    _TAGS.clear()


def explicit_config(directory: str, side: str, **kw) -> DumpConfig:
    from ffdebug._env import parse_calls, parse_layers

    base = DumpConfig(dir=os.fspath(directory), side=side)
    fields = {}
    if kw.get("layers") is not None:
        fields["layers"] = (
            kw["layers"] if not isinstance(kw["layers"], str) else parse_layers(kw["layers"], "layers")
        )
    if kw.get("classes"):
        c = kw["classes"]
        fields["block_classes"] = tuple(c.split(",")) if isinstance(c, str) else tuple(c)
    if kw.get("stages"):
        s = kw["stages"]
        fields["stages"] = tuple(s.split(",")) if isinstance(s, str) else tuple(s)
    if kw.get("calls") is not None:
        fields["calls"] = parse_calls(str(kw["calls"]), "calls")
    for name in ("mode", "grads", "max_bytes", "overwrite", "topk"):
        if kw.get(name) is not None:
            fields[name] = kw[name]
    if kw.get("layer_attrs"):
        fields["layer_attrs"] = tuple(kw["layer_attrs"])
    return replace(base, **fields)
