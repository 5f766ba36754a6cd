"""Module hooks that dump canonical stages of a model (README "Stage names by role").

Installed on: the root module (call counter, `embed.input_ids`, `final.logits` / `final.out`), the
input embedding (`embed.out`), each block (`L{NNN}.hidden_in` / `.hidden_out`), the block's direct
children with canonical names (`attn_norm_out`, `attn_out`, `ffn_norm_out`, `ffn_out`; other
children as `L{NNN}.{child}.out`), sub-stage classes named in the block-class list
(`L{NNN}.{path}.in` / `.out`), and the final norm (`final.norm_out`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ffdebug.capture.children import ChildRoles
from ffdebug.capture.copies import drop_inherited, remember
from ffdebug.capture.functions import known_function_taps, tap_function
from ffdebug.capture.inputs import LATENTS_KEY, root_inputs
from ffdebug.capture.order import ExecutionOrder
from ffdebug.capture.stage_map import StageMap
from ffdebug.capture.state import pop_layer, push_layer
from ffdebug.models.blocks import find_blocks
from ffdebug.models.roles import has_role, is_norm, is_norm_type, norm_shaped, role_children


class Handle:
    """Returned by `install`; `remove()` takes every hook away."""

    def __init__(self, session, blocks) -> None:
        self.session = session
        self.blocks = blocks
        self.order = None  # ExecutionOrder of the blocks (capture/order.py)
        self._hooks: list = []

    def add(self, hook) -> None:
        remember(hook)
        self._hooks.append(hook)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.order is not None:  # blocks run without a root call: write what was held
            for replay in self.order.decide():
                replay()

    @property
    def num_hooks(self) -> int:
        return len(self._hooks)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _tensors(obj, prefix: str = ""):
    """(suffix, tensor) pairs of a module output: tensor, tuple/list, dict or ModelOutput."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            if isinstance(v, torch.Tensor):
                yield f"{prefix}.{i}", v
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, torch.Tensor):
                yield f"{prefix}.{k}", v


def _first_tensor(args, kwargs, names=("hidden_states", "x", "input", "sample")):
    import torch

    for n in names:
        v = kwargs.get(n)
        if isinstance(v, torch.Tensor):
            return v
    for v in args:
        if isinstance(v, torch.Tensor):
            return v
    return None


def _input_ids(args, kwargs):
    import torch

    v = kwargs.get("input_ids")
    if isinstance(v, torch.Tensor):
        return v
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
        return args[0]
    return None


@dataclass
class _RootState:
    """What the root call in flight has seen, shared by the root, embedding and final-norm hooks."""

    vocab: int | None  # logits are the output whose last dim is this size
    ids: object = None  # the root call's input ids
    embedded: bool = False  # `embed.out` written for this call
    blocks_done: int = 0
    final_norm: tuple | None = None  # (copy, live, meta) of the last norm after the last block


def install(
    model,
    session,
    classes: tuple[str, ...] | None = None,
    declared_classes: str | None = None,
    stage_names=None,
) -> Handle:
    """Register the dump hooks of `session` on `model` and return a handle."""
    config = session.config
    drop_inherited(model)  # a deep copy of an installed model: its copied hooks go (capture.copies)
    globs = tuple(classes) if classes is not None else config.block_classes
    blocks = find_blocks(model, globs[:1], config.layer_attrs, declared_classes or session.declared_classes)
    handle = Handle(session, blocks)
    session.installs += 1
    session.blocks_found += len(blocks)
    if blocks:
        session.num_layers = max(b.layer for b in blocks) + 1
    order = handle.order = ExecutionOrder(blocks)
    capture = _capture_function(session, order, StageMap.of(stage_names))
    root = _RootState(vocab=_vocab_size(model))
    _hook_root(handle, session, capture, model, root, order)
    inside_blocks: set[int] = set()
    for b in blocks:
        inside_blocks.update(id(m) for m in b.module.modules())
    _hook_input_embedding(handle, session, capture, model, root, inside_blocks)
    _hook_final_norm(handle, session, capture, model, root, inside_blocks)
    _hook_blocks(handle, session, capture, model, root, globs[1:])
    for spec, stages in (*known_function_taps([b.module for b in blocks]), *config.tap_functions):
        handle.add(tap_function(spec, stages))
    return handle


def _capture_function(session, order: ExecutionOrder, stage_map: StageMap):
    """`capture(key, tensor, grad_source=None, **meta)` of an install: held while the execution
    order is pending, renamed by the order and the stage map, its gradient hooked when asked."""
    import torch

    grads = session.config.grads

    def capture(key, tensor, grad_source=None, **meta):
        """Write `tensor` as `key` (renamed by the stage map); its gradient is taken from
        `grad_source` (the live tensor a buffered copy was made of) or the tensor itself."""
        if not isinstance(tensor, torch.Tensor):
            return
        if order.pending:  # layer numbers follow the first call's execution (capture/order.py)
            copy, live = tensor.detach().clone(), tensor if grad_source is None else grad_source
            order.hold(lambda: capture(key, copy, grad_source=live, **meta))
            return
        key, meta = order.rename(key, meta)
        key = stage_map.apply(key)
        session.capture(key, tensor, **meta)
        live = tensor if grad_source is None else grad_source
        grad_key = f"{key}.grad"
        if grads and live.requires_grad and session.wants(grad_key, meta.get("layer")):
            # the gradient arrives after the forward: it keeps the forward's call and step tags
            live.register_hook(session.capture_later(grad_key, **dict(meta, io="grad")))

    return capture


def _hook_root(handle: Handle, session, capture, model, root: _RootState, order: ExecutionOrder) -> None:
    """The root module: call counter, `embed.input_ids` and the other root inputs before the call;
    `final.norm_out`, `final.logits` (and top-k) or `final.out` after it."""
    forward_sig = _signature(model)

    def root_pre(module, args, kwargs):
        ids = _input_ids(args, kwargs)
        session.begin_call(ids)
        if session.call_depth != 1:
            return
        root.ids, root.embedded = ids, False
        meta = dict(io="in", module_class=type(module).__name__, module_path="")
        if ids is not None:
            capture("embed.input_ids", ids, **meta)
        for spec, t in root_inputs(_bind(forward_sig, args, kwargs), ids):
            if spec is None:
                capture(LATENTS_KEY, t, **meta)
            elif spec.kwarg == "attention_mask" and ids is not None and tuple(t.shape) == tuple(ids.shape):
                # a padded batch: which positions are tokens (a packed side aligns through it)
                capture(spec.key, t, extra={"token_mask": True}, **meta)
            else:
                capture(spec.key, t, **meta)

    def root_post(module, args, kwargs, output):
        try:
            if session.call_depth == 1:
                pending, root.final_norm = root.final_norm, None
                if pending is not None:
                    tensor, live, meta = pending
                    capture("final.norm_out", tensor, grad_source=live, **meta)
                _capture_final(capture, module, output, root.vocab, session.config.topk)
        finally:
            if session.call_depth == 1:
                for replay in order.decide():
                    replay()
            session.end_call()

    handle.add(model.register_forward_pre_hook(root_pre, with_kwargs=True))
    handle.add(model.register_forward_hook(root_post, with_kwargs=True, always_call=True))


def _capture_final(capture, module, output, vocab: int | None, topk: int) -> None:
    """The root's output: its logits (an output whose last dim is the vocabulary), else its
    `sample`, else its first tensor as `final.out`."""
    import torch

    meta = dict(module_class=type(module).__name__, module_path="")
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if logits is None and isinstance(output, torch.Tensor) and vocab and output.dim() >= 1:
        logits = output if output.shape[-1] == vocab else None
    if isinstance(logits, torch.Tensor):
        capture("final.logits", logits, **meta)
        if topk:
            _capture_topk(capture, logits, topk)
        return
    sample = getattr(output, "sample", None)
    if isinstance(sample, torch.Tensor):
        capture("final.out", sample, **meta)
        return
    for suffix, t in _tensors(output, "final.out"):
        capture(suffix, t, **meta)
        break


def _hook_input_embedding(handle: Handle, session, capture, model, root: _RootState, inside_blocks) -> None:
    """`embed.out`: the model's own input embedding (and its tied copies), else the nn.Embedding
    outside the blocks that was fed the root's ids."""
    import torch

    emb = _input_embedding(model)
    known = emb is not None
    candidates = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if known:  # the model's own, and its tied copies (T5's encoder / decoder `embed_tokens`)
        weight = getattr(emb, "weight", None)
        candidates = [m for m in candidates if m is emb or (weight is not None and m.weight is weight)] or [
            emb
        ]
    for e in candidates:
        if id(e) in inside_blocks:
            continue

        def emb_post(m, a, o, known=known):
            if session.call_depth != 1 or root.embedded:
                return
            if not known and not (a and isinstance(a[0], torch.Tensor) and _same_ids(a[0], root.ids)):
                return
            root.embedded = True
            if root.vocab is None:
                root.vocab = getattr(m, "num_embeddings", None)
            capture("embed.out", o, module_class=type(m).__name__, module_path="embed")

        handle.add(e.register_forward_hook(emb_post))


def _hook_final_norm(handle: Handle, session, capture, model, root: _RootState, inside_blocks) -> None:
    """`final.norm_out`: the last norm (by type or behaviour) that runs after the last block, kept
    until the root returns (a norm followed by another block is not the final one)."""
    import torch

    for path, norm in _norm_candidates(model, inside_blocks):

        def norm_post(m, a, o, p=path):
            out = o if isinstance(o, torch.Tensor) else next((t for _, t in _tensors(o)), None)
            if session.call_depth != 1 or root.blocks_done == 0 or out is None:
                return
            if not is_norm(m, out):
                return
            meta = dict(module_class=type(m).__name__, module_path=p)
            root.final_norm = (out.detach().clone(), out, meta)

        handle.add(norm.register_forward_hook(norm_post))


def _hook_blocks(
    handle: Handle, session, capture, model, root: _RootState, sub_globs: tuple[str, ...]
) -> None:
    """Every block's hooks (`_install_block`), after the pre-hooks that give the execution order
    its layer numbers (registered first: a block's number is known before its input is held)."""
    blocks, order = handle.blocks, handle.order

    def block_done() -> None:
        root.blocks_done += 1
        root.final_norm = None  # a norm followed by another block is not the final one

    for b in blocks:
        handle.add(b.module.register_forward_pre_hook(lambda m, a, b=b: order.enter(b.layer)))
    substages = bool(session.config.substages or sub_globs)
    dims = getattr(model, "config", None)
    for b in blocks:
        _install_block(
            handle, session, capture, b, sub_globs, block_done, dims if substages else None, substages
        )


def _signature(model):
    import inspect

    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def _bind(sig, args, kwargs) -> dict:
    """The root call's arguments by name (positional ones too: a UNet's `timestep`)."""
    import inspect

    if sig is not None:
        try:
            bound = sig.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return dict(kwargs)
        out: dict = {}
        for name, value in bound.items():  # `**kwargs` of the forward: its entries by name
            if sig.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            else:
                out[name] = value
        return out
    return dict(kwargs)


def _same_ids(x, ids) -> bool:
    """`x` is the root's token ids (the same tensor, or equal values)."""
    import torch

    if ids is None:
        return False
    return x is ids or (x.shape == ids.shape and x.dtype == ids.dtype and bool(torch.equal(x, ids)))


def _vocab_size(model) -> int | None:
    """The vocabulary size: config `vocab_size`, else the input embedding's `num_embeddings`."""
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None) if config is not None else None
    if isinstance(size, int) and size > 1:
        return size
    emb = _input_embedding(model)
    return getattr(emb, "num_embeddings", None) if emb is not None else None


def _input_embedding(model):
    """`get_input_embeddings()` where the model has it, else its only `nn.Embedding` outside any
    ModuleList-of-blocks (None when there are several or none)."""
    import torch.nn as nn

    if hasattr(model, "get_input_embeddings"):
        try:
            emb = model.get_input_embeddings()
            if emb is not None:
                return emb
        except (NotImplementedError, AttributeError):
            pass
    embs = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    return embs[0] if len(embs) == 1 else None


def _norm_candidates(model, inside_blocks: set[int]) -> list[tuple[str, object]]:
    """Modules outside every block that may be a norm (by type, or shaped like one)."""
    out = []
    for path, m in model.named_modules():
        if not path or id(m) in inside_blocks:
            continue
        if is_norm_type(m) or norm_shaped(m):
            out.append((path, m))
    return out


def _capture_topk(capture, logits, k: int) -> None:
    import torch

    probs = torch.softmax(logits.detach().float(), dim=-1)
    values, ids = probs.topk(min(k, probs.shape[-1]), dim=-1)
    capture("final.topk_ids", ids, module_path="")
    capture("final.topk_probs", values, module_path="")


def _install_block(
    handle: Handle, session, capture, block, sub_globs: tuple[str, ...], block_done, dims, substages: bool
) -> None:
    """Hooks of one block: its input/output, its direct children (with their role sub-stages when
    `substages`; `dims` is the model config they read head and expert counts from), and sub-stage
    classes inside it."""
    from ffdebug.capture.substages import BranchRecorder, RoleTensors

    base = {"layer": block.layer, "layer_class": block.layer_class}
    prefix = f"L{block.layer:03d}"
    children = ChildRoles(session, capture, block, prefix, base)
    written = RoleTensors(_sub_paths(block, sub_globs))
    if substages:  # registered first: a branch's sub-stages are written before its output
        for name, child, _ in role_children(block.module):
            if has_role(child) and not is_norm_type(child) and not norm_shaped(child):
                path = f"{block.path}.{name}"
                recorder = BranchRecorder(
                    session, capture, name, child, path, prefix, base, children, dims, written
                )
                recorder.install(handle)
    children.install(handle)
    _hook_block_io(handle, session, capture, block, prefix, base, children.begin, children.flush, block_done)
    if sub_globs:
        _hook_substages(handle, session, capture, block, prefix, base, sub_globs, children, written)


def _hook_block_io(
    handle: Handle, session, capture, block, prefix: str, base: dict, begin, flush, block_done
) -> None:
    """`L{NNN}.hidden_in` (+ `encoder_hidden_in`) before the block, `L{NNN}.hidden_out` after.

    A tuple output names `hidden_out` the one tensor shaped like the input (diffusers' joint
    blocks return (encoder_hidden_states, hidden_states)); the others keep a field suffix.
    """
    import torch

    meta = dict(base, module_class=block.class_name, module_path=block.path)
    state: dict = {}  # invocation index and input shape of the call in flight

    def pre(module, args, kwargs):
        push_layer(block.layer, handle.order)
        state["inv"] = inv = session.next_invocation(block.path)
        h = _first_tensor(args, kwargs)
        if h is not None:
            state["shape"] = tuple(h.shape)
            capture(f"{prefix}.hidden_in", h, io="in", invocation=inv, **meta)
        enc = kwargs.get("encoder_hidden_states")
        if isinstance(enc, torch.Tensor):
            capture(f"{prefix}.encoder_hidden_in", enc, io="in", invocation=inv, **meta)
        begin()

    def post(module, args, kwargs, output):
        try:
            flush()
            pairs = list(_tensors(output))
            same = [t for _, t in pairs if tuple(t.shape) == state.get("shape")]
            for suffix, t in pairs:
                main = len(pairs) == 1 or (len(same) == 1 and t is same[0])
                key = f"{prefix}.hidden_out" if main else f"{prefix}.hidden_out{suffix}"
                capture(key, t, invocation=state.get("inv", 0), **meta)
        finally:
            pop_layer()
            block_done()

    handle.add(block.module.register_forward_pre_hook(pre, with_kwargs=True))
    handle.add(block.module.register_forward_hook(post, with_kwargs=True, always_call=True))


def _sub_paths(block, sub_globs) -> set[str]:
    """Module paths inside the block whose class matches a sub-stage glob."""
    import fnmatch

    return {
        f"{block.path}.{rel}"
        for rel, sub in block.module.named_modules()
        if rel and any(fnmatch.fnmatchcase(type(sub).__name__, g) for g in sub_globs)
    }


def _hook_substages(
    handle: Handle, session, capture, block, prefix: str, base: dict, sub_globs, children, written
) -> None:
    """Modules inside the block whose class matches a sub-stage glob: `L{NNN}.{path}.in` / `.out`.

    One stage per tensor: a module whose tensors already have a key is not written again under
    its module path — a direct child of the block (its output is `attn_out` / `ffn_out` / ... or
    `L{NNN}.<child>.out`; a placed child's input is the stage before it, so neither is written;
    an unplaced one keeps its `.in`) and a projection whose input or output a role sub-stage
    holds (`written`: a `RoleTensors`, the same tensors of the same call). The decision is taken
    when the module returns (its `.in` is written then, just before its `.out`), after the
    block's roles are known."""
    for rel, sub in block.module.named_modules():
        path = f"{block.path}.{rel}"
        if path not in written.module_paths:
            continue
        meta = dict(base, module_class=type(sub).__name__, module_path=path)
        child = rel if "." not in rel and has_role(sub) else None
        pending: list = []  # (invocation, input copy) of the call in flight

        def sub_pre(m, a, kw, path=path, pending=pending):
            h = _first_tensor(a, kw)
            if h is not None:
                pending.append((session.next_invocation(path), h.detach().clone(), h))

        def write(call, outputs, rel=rel, path=path, meta=meta, child=child):
            inv, x, live = call
            placed = child is not None and child in (children.names or {})
            in_ptr = live.data_ptr() if live is not None else None
            if x is not None and not placed and not written.holds(path, "in", in_ptr):
                capture(f"{prefix}.{rel}.in", x, grad_source=live, io="in", invocation=inv, **meta)
            out_ptr = outputs[0][2].data_ptr() if outputs else None
            if child is None and not written.holds(path, "out", out_ptr):
                for i, (suffix, t, live_out) in enumerate(outputs):
                    key = f"{prefix}.{rel}.out" if i == 0 else f"{prefix}.{rel}.out{suffix}"
                    capture(key, t, grad_source=live_out, invocation=inv, **meta)

        def sub_post(m, a, kw, o, path=path, pending=pending, write=write):
            call = pending.pop() if pending else (session.invocations.get(path, 1) - 1, None, None)
            outputs = [(sfx, t.detach().clone(), t) for sfx, t in _tensors(o)]
            if not session.hold(lambda: write(call, outputs)):
                write(call, outputs)

        handle.add(sub.register_forward_pre_hook(sub_pre, with_kwargs=True))
        handle.add(sub.register_forward_hook(sub_post, with_kwargs=True))
