"""Module hooks that dump canonical stages of a model (docs/dumping.md "Stage names by role").

Installed on: the root module (call counter, `embed.input_ids`, `final.logits` / `final.out`), the
input embedding (`embed.out`), each block (`L{NNN}.hidden_in` / `.hidden_out`), the block's direct
children with canonical names (`attn_norm_out`, `attn_out`, `ffn_norm_out`, `ffn_out`; other
children as `L{NNN}.{child}.out`), sub-stage classes named in the block-class list
(`L{NNN}.{path}.in` / `.out`), and the final norm (`final.norm_out`).
"""

from __future__ import annotations

from ffdebug.capture.children import ChildRoles
from ffdebug.capture.copies import drop_inherited, remember
from ffdebug.capture.edges import (
    RootState,
    hook_final_norm,
    hook_input_embedding,
    hook_root,
    vocab_size,
)
from ffdebug.capture.feed import hook_feed
from ffdebug.capture.functions import known_function_taps, tap_function
from ffdebug.capture.order import ExecutionOrder
from ffdebug.capture.outputs import first_tensor, tensors_of
from ffdebug.capture.stage_map import StageMap
from ffdebug.capture.state import pop_layer, push_layer
from ffdebug.models.blocks import find_blocks
from ffdebug.models.config_fields import model_config
from ffdebug.models.roles import has_role, is_norm_type, norm_shaped, role_children


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
    hook_feed(handle, session, blocks)  # before every other hook: they see the fed input
    root = RootState(vocab=vocab_size(model))
    capture = _capture_function(session, order, StageMap.of(stage_names), root)
    hook_root(handle, session, capture, model, root, order)
    inside_blocks: set[int] = set()
    for b in blocks:
        inside_blocks.update(id(m) for m in b.module.modules())
    hook_input_embedding(handle, session, capture, model, root, inside_blocks)
    hook_final_norm(handle, session, capture, model, root, inside_blocks)
    _hook_blocks(handle, session, capture, model, root, globs[1:])
    for spec, stages in (*known_function_taps([b.module for b in blocks]), *config.tap_functions):
        handle.add(tap_function(spec, stages))
    return handle


def _capture_function(session, order: ExecutionOrder, stage_map: StageMap, root: RootState):
    """`capture(key, tensor, grad_source=None, **meta)` of an install: held while the execution
    order is pending, renamed by the order and the stage map, its gradient hooked when asked;
    nothing while another install's root runs (a module the two models share)."""
    import torch

    grads = session.config.grads

    def capture(key, tensor, grad_source=None, **meta):
        """Write `tensor` as `key` (renamed by the stage map); its gradient is taken from
        `grad_source` (the live tensor a buffered copy was made of) or the tensor itself."""
        if not isinstance(tensor, torch.Tensor) or root.foreign(session):
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

    capture.foreign = lambda: root.foreign(session)  # the block hooks skip a foreign call too
    return capture


def _hook_blocks(
    handle: Handle, session, capture, model, root: RootState, sub_globs: tuple[str, ...]
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
    dims = model_config(model)
    for b in blocks:
        _install_block(
            handle, session, capture, b, sub_globs, block_done, dims if substages else None, substages
        )


def _install_block(
    handle: Handle, session, capture, block, sub_globs: tuple[str, ...], block_done, dims, substages: bool
) -> None:
    """Hooks of one block: its input/output, its direct children (with their role sub-stages when
    `substages`; `dims` is the model config they read head and expert counts from), and sub-stage
    classes inside it."""
    from ffdebug.capture.kernel_taps import KernelWatcher
    from ffdebug.capture.substages import BranchRecorder, RoleTensors

    base = {"layer": block.layer, "layer_class": block.layer_class}
    prefix = f"L{block.layer:03d}"
    children = ChildRoles(session, capture, block, prefix, base)
    written = RoleTensors(_sub_paths(block, sub_globs))
    for name, child, _ in role_children(block.module):
        if has_role(child) and not is_norm_type(child) and not norm_shaped(child):
            path = f"{block.path}.{name}"
            watcher = KernelWatcher(session, child, path)
            watcher.install(handle)  # attn.q_rot / k_rot at the kernel
            children.watchers[name] = watcher  # which child attends (role naming)
            if substages:  # registered first: a branch's sub-stages are written before its output
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
    enc_at = positional_index(block.module, "encoder_hidden_states")

    def pre(module, args, kwargs):
        state["foreign"] = capture.foreign()
        if state["foreign"]:  # another installed model runs this shared block: its hooks number it
            return
        push_layer(block.layer, handle.order)
        state["inv"] = inv = session.next_invocation(block.path)
        h = first_tensor(args, kwargs)
        if h is not None:
            state["shape"] = tuple(h.shape)
            capture(f"{prefix}.hidden_in", h, io="in", invocation=inv, **meta)
        enc = kwargs.get("encoder_hidden_states")
        if enc is None and enc_at is not None and len(args) > enc_at:
            enc = args[enc_at]  # passed by position (for gradient checkpointing: NLLB-MoE, T5)
        if isinstance(enc, torch.Tensor):
            capture(f"{prefix}.encoder_hidden_in", enc, io="in", invocation=inv, **meta)
        begin(enc if isinstance(enc, torch.Tensor) else None, state.get("shape"))

    def post(module, args, kwargs, output):
        if state.get("foreign"):
            return
        try:
            flush()
            pairs = list(tensors_of(output))
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


def positional_index(module, name: str) -> int | None:
    """Where parameter `name` of `module.forward` sits among the positional arguments (None when
    it has none or cannot be passed by position)."""
    import inspect

    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return next((i for i, p in enumerate(positional) if p.name == name), None)


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
            h = first_tensor(a, kw)
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
            outputs = [(sfx, t.detach().clone(), t) for sfx, t in tensors_of(o)]
            if not session.hold(lambda: write(call, outputs)):
                write(call, outputs)

        handle.add(sub.register_forward_pre_hook(sub_pre, with_kwargs=True))
        handle.add(sub.register_forward_hook(sub_post, with_kwargs=True))
