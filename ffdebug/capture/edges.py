"""The model's edges: hooks on the root call (`embed.input_ids`, root inputs, `final.logits` /
`final.out`, top-k), the input embedding (`embed.out`) and the final norm (`final.norm_out`).
Blocks and their children are capture/hooks.py's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ffdebug.capture.inputs import LATENTS_KEY, SEQ_LENS_KEY, packed_lengths, root_inputs
from ffdebug.capture.order import ExecutionOrder
from ffdebug.capture.outputs import tensors_of
from ffdebug.models.config_fields import config_field, model_config
from ffdebug.models.roles import is_norm, is_norm_type, norm_shaped

if TYPE_CHECKING:
    from ffdebug.capture.hooks import Handle


def _input_ids(args, kwargs):
    import torch

    v = kwargs.get("input_ids")
    if isinstance(v, torch.Tensor):
        return v
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
        return args[0]
    return None


@dataclass
class RootState:
    """What the root call in flight has seen, shared by the root, embedding and final-norm hooks."""

    vocab: int | None  # logits are the output whose last dim is this size
    ids: object = None  # the root call's input ids
    embedded: bool = False  # `embed.out` written for this call
    in_flight: bool = False  # this install's root started the call in flight: a module two
    # installed models share (a drafter's embedding or block of its target's) is captured by the
    # install whose root is running (`foreign`)
    blocks_done: int = 0
    final_norm: tuple | None = None  # (copy, live, meta) of the last norm after the last block

    def foreign(self, session) -> bool:
        """Another install's root call is in flight: this install's hooks capture nothing now."""
        return session.call_depth > 0 and not self.in_flight


def hook_root(handle: Handle, session, capture, model, root: RootState, order: ExecutionOrder) -> None:
    """The root module: call counter, `embed.input_ids` and the other root inputs before the call;
    `final.norm_out`, `final.logits` (and top-k) or `final.out` after it."""
    forward_sig = _signature(model)

    def root_pre(module, args, kwargs):
        ids = _input_ids(args, kwargs)
        session.begin_call(ids)
        if session.call_depth != 1:
            return
        root.ids, root.embedded, root.in_flight = ids, False, True
        meta = dict(io="in", module_class=type(module).__name__, module_path="")
        if ids is not None:
            capture("embed.input_ids", ids, **meta)
        named = _bind(forward_sig, args, kwargs)
        lens = packed_lengths(named)
        if lens is not None:  # a packed forward's layout, from its own inputs
            capture(SEQ_LENS_KEY, lens, **meta)
        for spec, t in root_inputs(named, ids):
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
                for replay in order.decide():  # held captures of this call: still this root's
                    replay()
                root.in_flight = False
            session.end_call()

    handle.add(model.register_forward_pre_hook(root_pre, with_kwargs=True))
    handle.add(model.register_forward_hook(root_post, with_kwargs=True, always_call=True))


def _capture_final(capture, module, output, vocab: int | None, topk: int) -> None:
    """The root's output: its logits (`.logits`, else the first floating tensor of the output —
    a tensor, a tuple, a dict or a dataclass, under any name — whose last dim is the vocabulary),
    else its `sample`, else its first tensor as `final.out`."""
    import torch

    meta = dict(module_class=type(module).__name__, module_path="")
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if logits is None and vocab:
        fields = output
        if dataclasses.is_dataclass(output) and not isinstance(output, type):
            fields = {f.name: getattr(output, f.name, None) for f in dataclasses.fields(output)}
        logits = next(
            (
                t
                for _, t in tensors_of(fields)
                if t.is_floating_point() and t.dim() >= 1 and t.shape[-1] == vocab
            ),
            None,
        )
    if isinstance(logits, torch.Tensor):
        capture("final.logits", logits, **meta)
        if topk:
            _capture_topk(capture, logits, topk)
        return
    sample = getattr(output, "sample", None)
    if isinstance(sample, torch.Tensor):
        capture("final.out", sample, **meta)
        return
    for suffix, t in tensors_of(output, "final.out"):
        capture(suffix, t, **meta)
        break


def hook_input_embedding(handle: Handle, session, capture, model, root: RootState, inside_blocks) -> None:
    """`embed.out`: the model's own input embedding (and its tied copies), else the nn.Embedding
    outside the blocks that was fed the root's ids."""
    import torch

    emb = input_embedding(model)
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
            if session.call_depth != 1 or root.embedded or not root.in_flight:
                return
            if not known and not (a and isinstance(a[0], torch.Tensor) and _same_ids(a[0], root.ids)):
                return
            root.embedded = True
            if root.vocab is None:
                root.vocab = getattr(m, "num_embeddings", None)
            capture("embed.out", o, module_class=type(m).__name__, module_path="embed")

        handle.add(e.register_forward_hook(emb_post))


def hook_final_norm(handle: Handle, session, capture, model, root: RootState, inside_blocks) -> None:
    """`final.norm_out`: the last norm (by type or behaviour) that runs after the last block, kept
    until the root returns (a norm followed by another block is not the final one)."""
    import torch

    for path, norm in _norm_candidates(model, inside_blocks):

        def norm_post(m, a, o, p=path):
            out = o if isinstance(o, torch.Tensor) else next((t for _, t in tensors_of(o)), None)
            if session.call_depth != 1 or not root.in_flight or root.blocks_done == 0 or out is None:
                return
            if not is_norm(m, out, a[0] if a else None):
                return
            meta = dict(module_class=type(m).__name__, module_path=p)
            root.final_norm = (out.detach().clone(), out, meta)

        handle.add(norm.register_forward_hook(norm_post))


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


def vocab_size(model) -> int | None:
    """The vocabulary size: config `vocab_size`, else the input embedding's `num_embeddings`."""
    size = config_field(model_config(model), "vocab_size")
    if isinstance(size, int) and size > 1:
        return size
    emb = input_embedding(model)
    return getattr(emb, "num_embeddings", None) if emb is not None else None


def input_embedding(model):
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
