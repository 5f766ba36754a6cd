"""A capture session: one side of one process, deciding what is captured and with which metadata.

The session owns the filters (layers, stages, calls, ranks), the call counter of the instrumented
root module, the invocation counters and the hold of a block's first call; each capture goes to its
sink (capture/sinks.py: the dump store, or `ffdebug.trace`'s tracer). Step tags, the layer stack
and which session is active live in capture/state.py.
"""

from __future__ import annotations

import functools
import os
import re
import sys

from ffdebug._env import DumpConfig
from ffdebug.capture.inputs import GATED, SEQ_LENS_KEY
from ffdebug.capture.kernel_taps import ROTARY_STAGES
from ffdebug.capture.sinks import StoreSink

# the capture state (tags, layers, sessions) lives in capture/state.py
from ffdebug.capture.state import current_layer, current_order, current_tags
from ffdebug.capture.trainer_inputs import INPUT_KEYS
from ffdebug.logs import get_logger

_LAYER_PREFIX = re.compile(r"^L\d+\.")


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

    def __init__(self, config: DumpConfig, declared_classes: str | None = None, sink=None) -> None:
        self.config = config
        self.declared_classes = declared_classes
        self.rank, self.world_size = _dist_coords()
        self.enabled_rank = config.ranks.contains(self.rank, self.world_size)
        # where the captures go (capture/sinks.py): the dump store unless told otherwise
        self.sink = sink if sink is not None else StoreSink(config, self.rank, self.world_size)
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
        self.first_real_done: set[tuple] = set()  # step-tag sets whose first real call was taken
        self.invocations: dict[tuple, int] = {}
        self.input_ids_sha: str | None = None
        self.ids_shape: tuple | None = None  # the root call's input ids shape ([B, S])
        self.unplaced: dict[str, list[str]] = {}  # block class -> children without a role
        self.forms: dict[str, dict] = {}  # block class.child -> its form's held / lacked sub-stages
        self.whole: dict[str, str] = {}  # block class.child -> why it is compared as a whole
        self._held: list | None = None
        self._hold_depth = 0
        self.closed = False

    # -- calls ------------------------------------------------------------------------------
    def begin_call(self, input_ids=None) -> None:
        self.call_depth += 1
        if self.call_depth > 1:
            return
        tags = current_tags()
        self.ids_shape = tuple(input_ids.shape) if input_ids is not None else None
        key = tuple(sorted((k, str(v)) for k, v in tags.items()))
        self.call = self.call_counters.get(key, 0)
        self.call_counters[key] = self.call + 1
        self.invocations = {}
        self.call_warmup_guess = False
        calls = self.config.calls
        if not calls.first_real:
            self.call_selected = calls.contains(self.call)
            return
        # first-real: the first call of each step-tag set not tagged phase=warmup. Engines that do not
        # tag: a dummy batch (one repeated id) is guessed to be a warm-up; its ids alone are written,
        # with phase "warmup_guess", so the store shows what was skipped and why.
        from ffdebug.store.schema import looks_like_dummy_ids

        warm = tags.get("phase") == "warmup"
        if "phase" not in tags and input_ids is not None:
            warm = self.call_warmup_guess = looks_like_dummy_ids(input_ids)
        self.call_selected = not warm and key not in self.first_real_done
        if self.call_selected:
            self.first_real_done.add(key)

    def end_call(self) -> None:
        self.call_depth = max(0, self.call_depth - 1)
        if self.call_depth == 0:
            self.call = None
            self.call_selected = True
            self.ids_shape = None

    def next_invocation(self, path: str) -> int:
        n = self.invocations.get(path, 0)
        self.invocations[path] = n + 1
        return n

    # -- capture ----------------------------------------------------------------------------
    def wants(self, key: str, layer: int | None, ids: bool = False) -> bool:
        if not self.enabled_rank or self.closed:
            return False
        if self.call_depth > 0 and not self.call_selected:
            return ids and self.call_warmup_guess
        if layer is not None and not self.config.layers.contains(layer, self.num_layers):
            return False
        # input ids are always kept (tiny, and the compare gate needs them)
        return ids or self.config.keep_stage(key)

    def capture(
        self, key: str, tensor, tags: dict | None = None, step_tags: dict | None = None, **meta
    ) -> None:
        """Send one tensor to the sink (the store copies it and writes its statistics and payload
        off the forward thread). `tags` are step tags of this capture only, on top of the
        `ffdebug.step(...)` ones in force; `step_tags` replaces the latter (the tags of the forward
        a gradient belongs to, `capture_later`). `free=True` in meta marks a free tap."""
        if self._held is not None:  # inside a block's first call: written in order at its return
            copy, extra = tensor.detach().clone(), dict(tags or {})
            held_tags = current_tags() if step_tags is None else step_tags
            self._held.append(lambda: self.capture(key, copy, tags=extra, step_tags=held_tags, **meta))
            return
        order = current_order()
        if order is not None and order.pending and meta.get("layer") == current_layer():
            # a tap inside a block whose number follows execution (capture/order.py): held with
            # the block's own captures and renamed with them when the first root call ends
            copy, extra_tags = tensor.detach().clone(), dict(tags or {})
            held_tags = current_tags() if step_tags is None else step_tags

            def replay():
                renamed, renamed_meta = order.rename(key, meta)
                self.capture(renamed, copy, tags=extra_tags, step_tags=held_tags, **renamed_meta)

            order.hold(replay)
            return
        free = meta.pop("free", False)
        extra = meta.get("extra") or {}
        ids = key == "embed.input_ids" or bool(extra.get("input_ids"))
        # kept in full always, like the ids: the token mask (comparison/align.py), the inputs the gate
        # reads (capture/inputs.py, capture/trainer_inputs.py) and scalars judged near zero by a declared scale
        small = ids or bool(extra.get("token_mask")) or key in GATED or key in INPUT_KEYS or "scale" in extra
        small = small or key == SEQ_LENS_KEY  # a packed side's layout: alignment data
        if not (free or self.sink.takes_module_stages) or not self.wants(key, meta.get("layer"), small):
            self.filtered += 1
            return
        if _graph_capturing():
            self.sink.count_skip("skipped_graph_capture")
            return
        tags = {**(current_tags() if step_tags is None else step_tags), **(tags or {})}
        meta.setdefault("call", self.call)
        meta.setdefault("invocation", 0)
        meta["step"] = {k: v for k, v in tags.items() if k not in ("phase", "shard", "reduction")}
        meta["phase"] = tags.get("phase") or ("warmup_guess" if self.call_warmup_guess else None)
        for reserved in ("shard", "reduction"):
            if reserved in tags:
                meta.setdefault(reserved, tags[reserved])
        payload_of = None
        if self.config.mode == "sketch" and not small and tensor.is_floating_point() and tensor.numel():
            from ffdebug.count_sketch import SKETCH_BUCKETS, sketch

            seed = self.config.sketch_seed
            payload_of = functools.partial(_sketch_payload, seed=seed, sketch=sketch)
            meta["extra"] = {**(meta.get("extra") or {}), "sketch": {"seed": seed, "buckets": SKETCH_BUCKETS}}
        self.sink.write(key, tensor, meta, always_payload=small, payload_of=payload_of)
        self.captured += 1
        if ids and self.input_ids_sha is None:  # run.json identifies the run by its first input ids
            from ffdebug.store.schema import sha256_of_tensor

            self.input_ids_sha = sha256_of_tensor(tensor)
            self.sink.update_run_info(input_ids_sha256=self.input_ids_sha)

    def capture_later(self, key: str, **meta):
        """A function that captures a tensor arriving later (a gradient, in a backward hook,
        maybe on another thread) as `key` with this forward's call and step tags, taken now."""
        meta = dict(meta, call=self.call)
        forward_tags = current_tags()
        return lambda tensor: self.capture(key, tensor, step_tags=forward_tags, **meta)

    # -- holding (a block's first call: its captures wait until the block's stage names are known)
    def begin_hold(self) -> None:
        if self._hold_depth == 0:
            self._held = []
        self._hold_depth += 1

    def end_hold(self) -> list:
        """Leave one hold level; the held replays (in capture order) when the outermost ends."""
        self._hold_depth = max(0, self._hold_depth - 1)
        if self._hold_depth:
            return []
        held, self._held = self._held or [], None
        return held

    def hold(self, replay) -> bool:
        """Queue `replay()` while holding; False when nothing is held (the caller acts now)."""
        if self._held is None:
            return False
        self._held.append(replay)
        return True

    def note_unplaced(self, block_class: str, children: tuple[str, ...]) -> None:
        """Record in run.json the block children role detection could not name (coverage lists them)."""
        self._note(self.unplaced, "unplaced_stages", block_class, list(children))

    def note_whole(self, branch: str, why: str) -> None:
        """Record in run.json a branch compared as a whole, without role sub-stages (coverage says so)."""
        self._note(self.whole, "compared_whole", branch, why)

    def note_form(self, branch: str, form: dict) -> None:
        """Record in run.json a branch whose form holds other role sub-stages than the usual one
        (an absorbed MLA attention: `models/mla_roles.py`); coverage excuses exactly those kinds."""
        self._note(self.forms, "form_stages", branch, form)

    def _note(self, table: dict, run_key: str, name: str, value) -> None:
        """Set `table[name]` and write the table to run.json as `run_key` when it changed."""
        if not self.enabled_rank or table.get(name) == value:
            return
        table[name] = value
        self.sink.update_run_info(**{run_key: dict(table)})

    def tap(self, stage: str, tensor, tags: dict) -> None:
        """A free tap. Reserved tags describe the tensor (`io`, `shard`, `reduction`, `layer`,
        `layer_class`, `input_ids=True`: these are token ids for the compare gate; `scale=S`: the
        absolute size of the terms a reduced value was summed from; `derived_from="..."`: this input is
        computed from those configuration fields, not drawn, docs/trainer-taps.md); the others
        are step tags of this capture."""
        tags = dict(tags)
        meta: dict = {"io": tags.pop("io", "out"), "layer": tags.pop("layer", current_layer())}
        for reserved in ("shard", "reduction", "layer_class"):
            if reserved in tags:
                meta[reserved] = tags.pop(reserved)
        if tags.pop("input_ids", False):
            meta["extra"] = {"input_ids": True}
        if "scale" in tags:  # the size of the terms a reduced value was summed from (compare.near_zero)
            meta.setdefault("extra", {})["scale"] = float(tags.pop("scale"))
        if "derived_from" in tags:  # an input computed from configuration, not drawn (comparison.inputs_gate)
            meta.setdefault("extra", {})["derived_from"] = str(tags.pop("derived_from"))
        if meta["layer"] is not None and not _LAYER_PREFIX.match(stage):
            stage = f"L{meta['layer']:03d}.{stage}"  # a tap inside a block is one of its stages
        if _LAYER_PREFIX.sub("", stage) in ROTARY_STAGES:
            tensor, layout = heads_last(tensor, self.ids_shape)
            if layout:
                meta["extra"] = {**meta.get("extra", {}), **layout}
        self.capture(stage, tensor, tags=tags, free=True, **meta)

    def tap_placed(self, stage: str, tensor, extra: dict, **where) -> None:
        """A stage ffdebug found inside the running block (the rotary q / k at the attention kernel,
        `capture.kernel_taps`), already in its stored layout; `extra` goes to the record, `where`
        (`module_path`, `module_class`: the child it was read in) too."""
        layer = current_layer()
        key = f"L{layer:03d}.{stage}" if layer is not None else stage
        self.capture(key, tensor, free=True, io="out", layer=layer, extra=dict(extra), **where)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.sink.close()

    def report_problems(self) -> None:
        """At the end of a run, say on stderr when it captured nothing or found no blocks, and why."""
        if not self.enabled_rank:
            return
        refused = getattr(self.sink, "refused", None)
        if refused:  # not "captured nothing": the captures ran, the store would not take them
            get_logger("capture").warning(
                "side '%s' wrote nothing: its store refused this run: %s", self.config.side, refused
            )
            return
        no_blocks = self.installs and not self.blocks_found
        if self.captured and not no_blocks:
            return
        if no_blocks:
            why = (
                "no blocks were found, so no layer stage was dumped: set FFDEBUG_FWD_DUMP_BLOCK_CLASS "
                "(or capture(classes=...)) to the decoder layer class, e.g. LlamaDecoderLayer"
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
        done = f"captured {self.captured} tensor(s)" if self.captured else "captured nothing"
        get_logger("capture").warning("side '%s' %s: %s", self.config.side, done, why)


def heads_last(t, ids_shape):
    """A rotated q / k as `[batch, seq, heads, head_dim]`, like the role sub-stages (docs/dumping.md "Role
    sub-stages"): a 4-D `[B, heads, S, D]` tensor is transposed when the root's ids say which dim
    is the sequence; `[B, S, heads, D]`, an ambiguous one (heads == S) and anything else stay as
    they are. Returns the tensor and the record's extra fields ({} when unchanged)."""
    if ids_shape is None or len(ids_shape) != 2 or t.dim() != 4 or t.shape[0] != ids_shape[0]:
        return t, {}
    seq = ids_shape[1]
    if t.shape[2] == seq and t.shape[1] != seq:
        return t.transpose(1, 2), {"orig_shape": list(t.shape), "layout": "B,H,S,D"}
    return t, {}


CAPTURE_OPTIONS = (
    "layers",
    "classes",
    "stages",
    "calls",
    "mode",
    "grads",
    "max_bytes",
    "queue_bytes",
    "overwrite",
    "topk",
    "layer_attrs",
    "substages",
    "grad_sample",
)


def explicit_config(directory: str, side: str, **options) -> DumpConfig:
    """The settings of `ffdebug.capture(...)`, validated like their environment variables."""
    from ffdebug._env import check_mode, check_side, parse_calls, parse_layers, split_list

    unknown = sorted(set(options) - set(CAPTURE_OPTIONS))
    if unknown:
        raise TypeError(
            f"ffdebug.capture(): unknown option(s) {', '.join(unknown)}; use {', '.join(CAPTURE_OPTIONS)}"
        )
    fields = {k: v for k, v in options.items() if v is not None}
    if isinstance(fields.get("layers"), str):
        fields["layers"] = parse_layers(fields["layers"], "layers")
    if "calls" in fields:
        fields["calls"] = parse_calls(str(fields["calls"]), "calls")
    for name in ("classes", "stages", "layer_attrs"):
        if name in fields:
            value = fields.pop(name)
            fields["block_classes" if name == "classes" else name] = (
                split_list(value) if isinstance(value, str) else tuple(value)
            )
    check_mode(fields.get("mode", "full"), "mode")
    return DumpConfig(dir=os.fspath(directory), side=check_side(side, "side"), **fields)


def _sketch_payload(tensor, seed: int, sketch):
    """The sketch written in place of a tensor's payload (sketch mode; on the writer thread)."""
    from ffdebug.arrays import to_torch

    return to_torch(sketch(tensor, seed).astype("float32"))
