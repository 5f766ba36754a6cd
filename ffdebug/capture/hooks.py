"""Module hooks that dump canonical stages of a model (DESIGN §2, "Stage keys").

Installed on: the root module (call counter, `embed.input_ids`, `final.logits` / `final.out`), the
input embedding (`embed.out`), each block (`L{NNN}.hidden_in` / `.hidden_out`), the block's direct
children with canonical names (`attn_norm_out`, `attn_out`, `ffn_norm_out`, `ffn_out`; other
children as `L{NNN}.{child}.out`), sub-stage classes named in the block-class list
(`L{NNN}.{path}.in` / `.out`), and the final norm (`final.norm_out`).
"""

from __future__ import annotations

from ffdebug.capture import session as sess
from ffdebug.models.blocks import CANONICAL_CHILDREN, find_blocks, find_named_child


class Handle:
    """Returned by `install`; `remove()` takes every hook away."""

    def __init__(self, session, blocks) -> None:
        self.session = session
        self.blocks = blocks
        self._hooks: list = []

    def add(self, hook) -> None:
        self._hooks.append(hook)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

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


def install(
    model, session, classes: tuple[str, ...] | None = None, declared_classes: str | None = None
) -> Handle:
    """Register the dump hooks of `session` on `model` and return a handle."""
    import torch

    config = session.config
    globs = tuple(classes) if classes is not None else config.block_classes
    block_globs = globs[:1] if globs else ()
    sub_globs = globs[1:]
    blocks = find_blocks(model, block_globs, config.layer_attrs, declared_classes or session.declared_classes)
    handle = Handle(session, blocks)
    session.installs += 1
    session.blocks_found += len(blocks)
    if blocks:
        session.num_layers = max(b.layer for b in blocks) + 1

    def capture(key, tensor, **meta):
        if not isinstance(tensor, torch.Tensor):
            return
        session.capture(key, tensor, **meta)
        grad_key = f"{key}.grad"
        if config.grads and tensor.requires_grad and session.wants(grad_key, meta.get("layer")):
            # the gradient arrives after the forward: it keeps the forward's call and step tags
            grad_meta = dict(meta, io="grad", call=session.call, tags=sess.current_tags())
            tensor.register_hook(lambda g: session.capture(grad_key, g, **grad_meta))

    # root: call counter, input ids, final output
    def root_pre(module, args, kwargs):
        ids = _input_ids(args, kwargs)
        session.begin_call(ids)
        if session.call_depth == 1 and ids is not None:
            capture("embed.input_ids", ids, io="in", module_class=type(module).__name__, module_path="")

    def root_post(module, args, kwargs, output):
        try:
            if session.call_depth == 1:
                logits = getattr(output, "logits", None)
                if logits is None and isinstance(output, dict):
                    logits = output.get("logits")
                if isinstance(logits, torch.Tensor):
                    capture("final.logits", logits, module_class=type(module).__name__, module_path="")
                    if config.topk:
                        _capture_topk(capture, logits, config.topk)
                else:
                    sample = getattr(output, "sample", None)
                    if isinstance(sample, torch.Tensor):
                        capture("final.out", sample, module_class=type(module).__name__, module_path="")
                    else:
                        for suffix, t in _tensors(output, "final.out"):
                            capture(suffix, t, module_class=type(module).__name__, module_path="")
                            break
        finally:
            session.end_call()

    handle.add(model.register_forward_pre_hook(root_pre, with_kwargs=True))
    handle.add(model.register_forward_hook(root_post, with_kwargs=True, always_call=True))

    inside_blocks: set[int] = set()
    for b in blocks:
        inside_blocks.update(id(m) for m in b.module.modules())

    # input embedding
    emb = None
    if hasattr(model, "get_input_embeddings"):
        try:
            emb = model.get_input_embeddings()
        except (NotImplementedError, AttributeError):
            emb = None
    if emb is not None and id(emb) not in inside_blocks:
        handle.add(
            emb.register_forward_hook(
                lambda m, a, o: capture("embed.out", o, module_class=type(m).__name__, module_path="embed")
            )
        )

    # final norm (outside every block)
    path, norm = find_named_child(
        model, ("norm", "final_layernorm", "ln_f", "norm_out", "final_norm"), inside_blocks
    )
    if norm is not None:
        handle.add(
            norm.register_forward_hook(
                lambda m, a, o, p=path: capture(
                    "final.norm_out",
                    o if isinstance(o, torch.Tensor) else next((t for _, t in _tensors(o)), None),
                    module_class=type(m).__name__,
                    module_path=p,
                )
            )
        )

    for b in blocks:
        _install_block(handle, session, capture, b, sub_globs)
    return handle


def _capture_topk(capture, logits, k: int) -> None:
    import torch

    probs = torch.softmax(logits.detach().float(), dim=-1)
    values, ids = probs.topk(min(k, probs.shape[-1]), dim=-1)
    capture("final.topk_ids", ids, module_path="")
    capture("final.topk_probs", values, module_path="")


def _install_block(handle: Handle, session, capture, block, sub_globs: tuple[str, ...]) -> None:
    import fnmatch

    import torch

    layer = block.layer
    prefix = f"L{layer:03d}"
    base = {"layer": layer, "layer_class": block.layer_class}
    shape_in: dict = {}

    def pre(module, args, kwargs):
        sess.push_layer(layer)
        inv = session.next_invocation(block.path)
        shape_in["inv"] = inv
        h = _first_tensor(args, kwargs)
        if h is not None:
            shape_in["shape"] = tuple(h.shape)
            capture(
                f"{prefix}.hidden_in",
                h,
                io="in",
                invocation=inv,
                module_class=block.class_name,
                module_path=block.path,
                **base,
            )
        enc = kwargs.get("encoder_hidden_states")
        if isinstance(enc, torch.Tensor):
            capture(
                f"{prefix}.encoder_hidden_in",
                enc,
                io="in",
                invocation=inv,
                module_class=block.class_name,
                module_path=block.path,
                **base,
            )

    def post(module, args, kwargs, output):
        try:
            inv = shape_in.get("inv", 0)
            pairs = list(_tensors(output))
            if len(pairs) == 1:
                capture(
                    f"{prefix}.hidden_out",
                    pairs[0][1],
                    invocation=inv,
                    module_class=block.class_name,
                    module_path=block.path,
                    **base,
                )
            else:
                same = [t for _, t in pairs if tuple(t.shape) == shape_in.get("shape")]
                for suffix, t in pairs:
                    key = (
                        f"{prefix}.hidden_out"
                        if len(same) == 1 and t is same[0]
                        else f"{prefix}.hidden_out{suffix}"
                    )
                    capture(
                        key, t, invocation=inv, module_class=block.class_name, module_path=block.path, **base
                    )
        finally:
            sess.pop_layer()

    handle.add(block.module.register_forward_pre_hook(pre, with_kwargs=True))
    handle.add(block.module.register_forward_hook(post, with_kwargs=True, always_call=True))

    used: set[str] = set()
    for name, child in block.module.named_children():
        stage = CANONICAL_CHILDREN.get(name)
        if stage is None or stage in used:
            stage = f"{name}.out"
        used.add(stage)
        key = f"{prefix}.{stage}"
        path = f"{block.path}.{name}"

        def child_post(m, a, o, key=key, path=path):
            pairs = list(_tensors(o))
            for i, (suffix, t) in enumerate(pairs):
                k = key if i == 0 else f"{key}{suffix}"
                capture(
                    k,
                    t,
                    invocation=session.invocations.get(block.path, 1) - 1,
                    module_class=type(m).__name__,
                    module_path=path,
                    **base,
                )

        handle.add(child.register_forward_hook(child_post))

    if sub_globs:
        for rel, sub in block.module.named_modules():
            if not rel or not any(fnmatch.fnmatchcase(type(sub).__name__, g) for g in sub_globs):
                continue

            def sub_pre(m, a, kw, rel=rel):
                h = _first_tensor(a, kw)
                if h is not None:
                    capture(
                        f"{prefix}.{rel}.in",
                        h,
                        io="in",
                        invocation=session.next_invocation(f"{block.path}.{rel}"),
                        module_class=type(m).__name__,
                        module_path=f"{block.path}.{rel}",
                        **base,
                    )

            def sub_post(m, a, kw, o, rel=rel):
                for i, (suffix, t) in enumerate(_tensors(o)):
                    k = f"{prefix}.{rel}.out" if i == 0 else f"{prefix}.{rel}.out{suffix}"
                    capture(
                        k,
                        t,
                        invocation=session.invocations.get(f"{block.path}.{rel}", 1) - 1,
                        module_class=type(m).__name__,
                        module_path=f"{block.path}.{rel}",
                        **base,
                    )

            handle.add(sub.register_forward_pre_hook(sub_pre, with_kwargs=True))
            handle.add(sub.register_forward_hook(sub_post, with_kwargs=True))
