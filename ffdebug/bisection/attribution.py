"""Local or inherited: re-run each target block on the reference's input, from disk.

A layer's dumped output error mixes what the layer adds with what it inherits. Feeding every
block of the target model the reference's `hidden_in` (a forward pre-hook substitutes the block's
hidden-state argument; position embeddings, masks and the rest come from the model's own forward
on the reference's input ids) and comparing the block's output with the reference's `hidden_out`
measures the layer's own error. The reference model, replayed the same way, is the control: what
it fails to reproduce of its own dump is the replay's noise floor.

Entries are `module:function` or `path/to/file.py:function` (the file's folder is importable);
the function takes no arguments and returns one of:
- the model (an `nn.Module`): fed the reference's `embed.input_ids` as `input_ids=` when its
  forward takes that keyword (or `**kwargs`), else as its first positional argument;
- `(model, "keyword")`: the input ids passed as that keyword (`tokens=`);
- `(model, forward_kwargs)`: the forward called with exactly these keyword arguments.
Every failure (the entry, the forward) is one line naming the flag, exit 2.

From Python (`ffdebug.bisect(..., model_target=...)`) either side may also be the model object itself,
or the same `(model, "keyword")` / `(model, forward_kwargs)` pair the function would return
(`selftest` passes its in-memory models so).
"""

from __future__ import annotations

from ffdebug import verdict as V
from ffdebug.bisection.budget import LAYER_KEY, Precision, noise_factor
from ffdebug.comparison.align import MASK_KEY
from ffdebug.errors import FFDebugError

LOCAL_SHARE = 0.1  # local error must be at least this share of the dumped output error


def load_entry(spec, flag: str):
    """(model, forward_kwargs or None) from a `module:function` entry (no arguments), or from what
    such a function returns, given directly (module doc)."""
    if isinstance(spec, str):
        from ffdebug._entry import call_entry

        try:
            out = call_entry(spec)
        except FFDebugError as err:
            raise FFDebugError(f"{flag} {err}") from None
    else:
        out, spec = spec, f"<{type(spec).__name__}>"
    model, kwargs = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if not hasattr(model, "named_modules"):
        raise FFDebugError(
            f"{flag} {spec!r}: the function must return an nn.Module, (module, 'keyword') or (module, kwargs)"
        )
    if kwargs is not None and not isinstance(kwargs, (str, dict)):
        raise FFDebugError(
            f"{flag} {spec!r}: the second item must be the input keyword (str) or the forward kwargs "
            f"(dict), not {type(kwargs).__name__}"
        )
    return model, kwargs


def _ids_call(model, ids, keyword: str | None) -> tuple[tuple, dict]:
    """(args, kwargs) feeding the input ids: `keyword=` when given, `input_ids=` when the forward
    takes it, else the forward's first positional argument."""
    import inspect

    if keyword:
        return (), {keyword: ids}
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return (), {"input_ids": ids}
    if any(p.name == "input_ids" or p.kind == p.VAR_KEYWORD for p in params):
        return (), {"input_ids": ids}
    return (ids,), {}


def _block_inputs(records: list[tuple]) -> tuple[dict, dict, object, dict]:
    """Reference hidden_in / hidden_out records per layer (first invocation), the input ids, and a
    decoder block's encoder_hidden_in records."""
    ins, outs, ids, encs = {}, {}, None, {}
    for r, _t in records:
        if r.key == "embed.input_ids" and ids is None:
            ids = r
        m = LAYER_KEY.match(r.key)
        if m and r.invocation == 0:
            into = {"hidden_in": ins, "hidden_out": outs, "encoder_hidden_in": encs}[m.group(2)]
            into.setdefault(int(m.group(1)), r)
    return ins, outs, ids, encs


def replay(
    model,
    kwargs,
    ref_in: dict,
    ids_record,
    flag: str = "--model-target",
    ref_enc: dict | None = None,
    mask=None,
) -> dict:
    """Each block's output when fed the reference's hidden_in, and a decoder block the reference's
    encoder_hidden_in (`ref_enc`) too (layer -> tensor); `mask`: the reference's `[B, S]` attention
    mask, for a packed model (`as_packed`)."""
    from ffdebug.models.blocks import find_blocks

    blocks = find_blocks(model)
    if not blocks:
        raise FFDebugError(
            f"{type(model).__name__}: no repeated blocks found to replay; return the model whose "
            "blocks were dumped"
        )
    outs: dict[int, object] = {}
    hooks = _replay_hooks(blocks, ref_in, outs, ref_enc or {}, mask)
    try:
        _forward(model, kwargs, ids_record, flag)
    finally:
        for h in hooks:
            h.remove()
    return outs


def as_packed(padded, like, mask=None):
    """The reference's `[B, S, ...]` rows in the layout of a block input `like`: as it is when the
    shapes agree; for a packed `[T, ...]` / `[1, T, ...]` one (an engine's port of the padded
    reference), the padded side's tokens in order — those of `mask` (`[B, S]`, the reference's
    attention mask) when recorded, else every position when there are exactly T; else None."""
    if tuple(padded.shape) == tuple(like.shape):
        return padded
    if padded.dim() < 3 or tuple(padded.shape[2:]) != tuple(like.shape[-(padded.dim() - 2) :]):
        return None
    if mask is not None and tuple(mask.shape) == tuple(padded.shape[:2]):
        rows = padded[mask.bool()]
    else:
        rows = padded.reshape(-1, *padded.shape[2:])
    return rows.reshape(like.shape) if rows.numel() == like.numel() else None


def _replay_hooks(blocks, ref_in: dict, outs: dict, ref_enc: dict, mask=None) -> list:
    """Hooks on every block: its first call gets the reference's hidden_in in place of its own input
    (same shape, or its tokens in a packed block's layout: `as_packed`), a decoder block the
    reference's encoder output in place of the one its own encoder made (`encoder_hidden_states`,
    by keyword or by position: an encoder bug is not the decoder's own), and its first output
    tensor lands in `outs[layer]`."""
    from ffdebug.capture.hooks import positional_index
    from ffdebug.capture.outputs import first_tensor, tensors_of

    seen: set[int] = set()

    def make(layer):
        def pre(module, args, kw):
            if layer in seen or layer not in ref_in:
                return None
            h = first_tensor(args, kw)
            if h is None:
                return None
            sub = as_packed(_tensor(ref_in[layer]), h, mask)
            if sub is None:
                return None
            sub = sub.to(dtype=h.dtype, device=h.device)
            if "hidden_states" in kw:
                kw = dict(kw, hidden_states=sub)
            else:
                args = tuple(sub if a is h else a for a in args)
            return _encoder_input(module, layer, args, kw)

        def _encoder_input(module, layer, args, kw):
            if layer not in ref_enc:
                return args, kw
            at = positional_index(module, "encoder_hidden_states")
            own = kw.get("encoder_hidden_states")
            if own is None and at is not None and at < len(args):
                own = args[at]
            if not hasattr(own, "shape"):
                return args, kw
            enc = _tensor(ref_enc[layer]).to(dtype=own.dtype, device=own.device)
            if tuple(enc.shape) != tuple(own.shape):
                return args, kw
            if "encoder_hidden_states" in kw:
                return args, dict(kw, encoder_hidden_states=enc)
            return tuple(enc if i == at else a for i, a in enumerate(args)), kw

        def post(module, args, kw, output):
            if layer not in seen:
                seen.add(layer)
                first = next((t for _, t in tensors_of(output)), None)
                if first is not None:
                    outs[layer] = first.detach().to("cpu", copy=True)

        return pre, post

    hooks = []
    for b in blocks:
        pre, post = make(b.layer)
        hooks.append(b.module.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(b.module.register_forward_hook(post, with_kwargs=True))
    return hooks


def _tensor(record):
    """A dumped tensor as a torch tensor (a model runs on it; `ffdebug.arrays.to_torch`)."""
    from ffdebug.arrays import to_torch

    return to_torch(record.load())


def _forward(model, kwargs, ids_record, flag: str) -> None:
    """One no-grad forward of `model` with the entry's keyword arguments, else the reference's
    input ids; a forward that raises is one line naming `flag` and what it was fed."""
    import torch

    call_args: tuple = ()
    call_kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
    if not call_kwargs:
        if ids_record is None:
            raise FFDebugError(
                f"attribution: the reference dumped no embed.input_ids; make the {flag} entry "
                "return (model, forward_kwargs)"
            )
        call_args, call_kwargs = _ids_call(
            model, _tensor(ids_record), kwargs if isinstance(kwargs, str) else None
        )
    with torch.no_grad():
        try:
            model(*call_args, **call_kwargs)
        except FFDebugError:
            raise
        except Exception as err:
            from ffdebug.errors import short_reason

            fed = ", ".join(
                [f"{len(call_args)} positional"] * bool(call_args) + [f"{k}=" for k in call_kwargs]
            )
            raise FFDebugError(
                f"{flag}: {type(model).__name__}.forward({fed}) raised {type(err).__name__}: "
                f"{short_reason(err)}; return (model, 'keyword') or (model, forward_kwargs) from the entry"
            ) from None


def attribute(
    model_ref: str | None, model_target: str, records: list[tuple], stages: list[dict]
) -> list[dict]:
    """Per layer: local error of the target block on the reference input, and the verdict."""
    from ffdebug.comparison.metrics import compare_tensors

    ref_in, ref_out, ids, ref_enc = _block_inputs(records)
    if not ref_in:
        raise FFDebugError("attribution needs L*.hidden_in dumps on the reference side; dump whole blocks")
    masks = [r for r, _ in records if r.key == MASK_KEY and r.has_payload]
    mask = _tensor(masks[0]) if masks else None
    t_model, t_kwargs = load_entry(model_target, "--model-target")
    t_outs = replay(t_model, t_kwargs, ref_in, ids, ref_enc=ref_enc, mask=mask)
    c_outs = {}
    if model_ref:
        r_model, r_kwargs = load_entry(model_ref, "--model-ref")
        c_outs = replay(r_model, r_kwargs, ref_in, ids, "--model-ref", ref_enc)
    by_key = {e.key: e for e in stages}
    rows = []
    for layer in sorted(ref_out):
        if layer not in t_outs:
            continue
        ref = _tensor(ref_out[layer])
        ref_rows = as_packed(ref, t_outs[layer], mask)
        local = compare_tensors(ref if ref_rows is None else ref_rows, t_outs[layer])
        if local.rel is None:  # not comparable (another shape, another first output): no verdict
            continue
        control = compare_tensors(ref, c_outs[layer]) if layer in c_outs else None
        dumped = by_key.get(f"L{layer:03d}.hidden_out")
        k = noise_factor(dumped) if dumped is not None else V.noise_factor()
        floor = k * (control.rel or 0.0) if control is not None else 0.0
        # and never below what rounding alone adds in the layer's dtypes: a block computed in
        # another order (an engine's fused projections) reproduces the reference to the last bits
        # only, and the control (the reference replaying itself) is exact
        floor = max(floor, Precision.of(e for e in stages if e.layer == layer).floor())
        dumped_rel = (dumped.rel if dumped is not None else None) or 0.0
        is_local = (local.rel or 0.0) > floor and (local.rel or 0.0) >= LOCAL_SHARE * dumped_rel
        rows.append(
            {
                "layer": layer,
                "local_cos": local.cos,
                "local_rel": local.rel,
                "control_rel": None if control is None else control.rel,
                "dumped_rel": dumped.rel if dumped is not None else None,
                "verdict": "local" if is_local else ("clean" if dumped_rel == 0 else "inherited"),
            }
        )
    return rows
