"""An engine-style rewrite of a zoo model: what an inference engine's port of it looks like to
ffdebug, built automatically from the model itself, so the sweep measures pairing across codebases.

    fuse      sibling `nn.Linear`s fed the same tensor in one call (q / k / v, gate / up, a
              diffusers block's to_q / to_k / to_v) become one Linear of their rows stacked; the
              parent reads its old projections as slices of that one output
    rename    every child below the root gets another name (`self_attn` → `s3`, by position);
              the forward still finds it under the old attribute, `named_modules` does not
    pack      a causal LM takes the batch as one packed row `[T]` with `cu_seqlens` (what an
              engine's varlen attention takes): position ids restart per sequence, and the mask
              is block-diagonal (HF's own packed-sequence mask from the position ids, else an
              explicit 4-D additive mask); kept only when its logits equal the padded model's
              (`PACK_REL`), else the model is not packed and `Rewrite.packing` says why

Expert weights are left as the model holds them (transformers stacks them per layer already).
Nothing keys on a family's names: the groups come from one probe forward (which Linears read the
same tensor object), and a group is fused only when each member is a plain `nn.Linear` called
once, with no hooks and no per-instance forward (a planted mutation's patch stays in force), held
as an attribute (a `ModuleList`'s, `Sequential`'s or `ModuleDict`'s members are indexed by the
forward: they are neither fused nor, for a `ModuleDict`, renamed).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

PACK_REL = 1e-4  # packed vs padded logits: max |Δ| / max |ref| (fp32; a wrong mask is O(1))


@dataclass
class Rewrite:
    """The rewritten model, the inputs its forward takes, and what was done."""

    module: Any
    feed: dict[str, Any]
    fused: list[str] = field(default_factory=list)  # "parent: a + b + c" per fused group
    renamed: int = 0
    packing: str = "not packed: not a causal LM"

    def describe(self) -> str:
        return (
            f"engine rewrite: {len(self.fused)} fused projection group(s), {self.renamed} module(s) renamed, "
            f"{self.packing}"
        )


class _Slice:
    """A fused group's member as its parent reads it: `slice(x)` is the fused output's columns
    for this member, computed once per input tensor for the whole group. Not a Module, so the
    dump sees only the fused Linear."""

    def __init__(self, owner: _Group, start: int, stop: int) -> None:
        self.owner, self.start, self.stop = owner, start, stop

    def __call__(self, x):
        return self.owner.output(x)[..., self.start : self.stop]

    @property
    def weight(self):
        return self.owner.linear.weight[self.start : self.stop]

    @property
    def bias(self):
        b = self.owner.linear.bias
        return None if b is None else b[self.start : self.stop]

    @property
    def in_features(self) -> int:
        return self.owner.linear.in_features

    @property
    def out_features(self) -> int:
        return self.stop - self.start


class _Group:
    """One fused Linear and the last input it ran on (the members share it)."""

    def __init__(self, linear: Any, members: int) -> None:
        self.linear, self.members = linear, members
        self._key: tuple | None = None
        self._out = None
        self._served = 0

    def output(self, x):
        key = (id(x), getattr(x, "_version", 0), tuple(x.shape))
        if key != self._key or self._served >= self.members:
            self._key, self._out, self._served = key, self.linear(x), 0
        self._served += 1
        out = self._out
        if self._served >= self.members:
            self._key, self._out = None, None  # the last member read it: nothing kept alive
        return out


def _plain_linear(m: Any) -> bool:
    import torch.nn as nn

    return (
        type(m) is nn.Linear
        and "forward" not in m.__dict__
        and not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks)
    )


def _groups(model: Any, feed: dict[str, Any]) -> list[tuple[Any, list[str]]]:
    """(parent, child names) of every fusable group, from one probe forward."""
    import torch
    import torch.nn as nn

    containers = (nn.ModuleDict, nn.ModuleList, nn.Sequential)  # their members are indexed, not attributes
    parent_of = {
        id(child): (parent, name)
        for parent in model.modules()
        if not isinstance(parent, containers)
        for name, child in parent.named_children()
    }
    seen: dict[int, list] = {}  # id(linear) -> [calls, its input (held: its id is not reused)]
    handles = []
    for m in model.modules():
        if _plain_linear(m) and id(m) in parent_of:

            def pre(mod, args, _seen=seen):
                entry = _seen.setdefault(id(mod), [0, None])
                entry[0] += 1
                entry[1] = args[0] if args and isinstance(args[0], torch.Tensor) else None

            handles.append(m.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            model(**feed)
    finally:
        for h in handles:
            h.remove()
    by_input: dict[tuple, list[str]] = {}
    for mid, (calls, inp) in seen.items():
        if calls != 1 or inp is None:
            continue
        parent, name = parent_of[mid]
        by_input.setdefault((id(parent), id(inp)), []).append(name)
    out = []
    parents = {id(p): p for p in model.modules()}
    for (pid, _), names in by_input.items():
        parent = parents[pid]
        order = list(names)  # in the order the forward called them (q, k, v), not as defined
        members = [parent._modules[n] for n in order]
        if len(members) < 2:
            continue
        first = members[0]
        if any(
            m.in_features != first.in_features
            or m.weight.dtype != first.weight.dtype
            or (m.bias is None) != (first.bias is None)
            for m in members
        ):
            continue
        out.append((parent, order))
    return out


def _fuse(parent: Any, names: list[str]) -> None:
    import torch
    import torch.nn as nn

    members = [parent._modules[n] for n in names]
    rows = [m.out_features for m in members]
    first = members[0]
    fused = nn.Linear(first.in_features, sum(rows), bias=first.bias is not None)
    fused = fused.to(dtype=first.weight.dtype, device=first.weight.device)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([m.weight for m in members]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([m.bias for m in members]))
    fused.train(first.training)
    group = _Group(fused, len(members))
    new = "_".join(names)
    children = {}
    first_defined = next(n for n in parent._modules if n in names)
    for n, child in parent._modules.items():
        if n == first_defined:
            children[new] = fused
        if n not in names:
            children[n] = child
    parent._modules.clear()
    parent._modules.update(children)
    start = 0
    for n, size in zip(names, rows):
        object.__setattr__(parent, n, _Slice(group, start, start + size))
        start += size


def _rename(model: Any) -> int:
    """Every non-index child below the root renamed `<first letter><position>`; the old name stays
    an attribute (not a child) so the model's forward reads it unchanged. A `ModuleDict`'s keys
    are left as they are: they are data the forward indexes with (`experts[f"expert_{i}"]`), like
    a `ModuleList`'s indices."""
    import torch.nn as nn

    count = 0
    for parent in list(model.modules()):
        if not parent._modules or isinstance(parent, nn.ModuleDict):
            continue
        children = {}
        for i, (name, child) in enumerate(parent._modules.items()):
            if name.isdigit() or child is None:
                children[name] = child
                continue
            new = f"{name[0].lower() if name[0].isalpha() else 'm'}{i}"
            while new in parent._modules and new != name:
                new += "_"
            children[new] = child
            object.__setattr__(parent, name, child)
            count += 1
        parent._modules.clear()
        parent._modules.update(children)
    return count


def _packed_class():
    import torch
    import torch.nn as nn

    class PackedCausalLM(nn.Module):
        """`forward(input_ids [T], cu_seqlens [B + 1])`: the batch as one packed row; position ids
        restart per sequence; `mask` "positions" lets HF build the block-diagonal causal mask
        from them, "explicit" passes it as a 4-D additive mask."""

        def __init__(self, net: Any, mask: str) -> None:
            super().__init__()
            self.net, self.mask = net, mask

        def get_input_embeddings(self):
            """The token embedding, as engines expose it (vLLM's and SGLang's models do)."""
            return self.net.get_input_embeddings()

        def forward(self, input_ids, cu_seqlens):
            lengths = cu_seqlens.diff().tolist()
            pos = torch.cat([torch.arange(n) for n in lengths])[None]
            kwargs: dict[str, Any] = {"position_ids": pos}
            if self.mask == "explicit":
                seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
                t = seq.numel()
                allowed = (seq[:, None] == seq[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
                dtype = next(p.dtype for p in self.net.parameters() if p.is_floating_point())
                mask = torch.zeros(t, t, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
                kwargs["attention_mask"] = mask[None, None]
            return self.net(input_ids=input_ids[None], **kwargs)

    return PackedCausalLM


def _logits(out):
    import torch

    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else out[0]


def _pack(model: Any, feed: dict[str, Any]) -> tuple[Any, dict[str, Any], str]:
    """The packed causal LM and its inputs, or (model, feed, why not) when packing changes its
    logits or its forward refuses the packed inputs."""
    import torch

    ids = feed.get("input_ids")
    if set(feed) != {"input_ids"} or ids is None or ids.dim() != 2:
        return model, feed, "not packed: its forward takes more than token ids"
    b, s = ids.shape
    packed_feed = {"input_ids": ids.reshape(-1), "cu_seqlens": torch.arange(b + 1) * s}
    with torch.no_grad():
        want = _logits(model(**feed)).reshape(b * s, -1).double()
    cls = _packed_class()
    why = []
    for mask in ("positions", "explicit"):
        packed = cls(model, mask).eval()
        try:
            with torch.no_grad():
                got = _logits(packed(**packed_feed)).reshape(b * s, -1).double()
        except Exception as e:  # noqa: BLE001 - a forward that refuses packed inputs is not packable
            why.append(f"{mask}: {type(e).__name__}")
            continue
        rel = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
        if rel <= PACK_REL:
            how = "HF's mask from the position ids" if mask == "positions" else "an explicit 4-D mask"
            return packed, packed_feed, f"packed (block-diagonal: {how})"
        why.append(f"{mask}: logits differ (rel {rel:.1e})")
    return model, feed, "not packed: " + "; ".join(why)


def engine_rewrite(model: Any, feed: dict[str, Any], causal_lm: bool) -> Rewrite:
    """A rewritten deep copy of `model` (fused, renamed, packed where it holds) and its inputs."""
    net = copy.deepcopy(model)
    groups = _groups(net, feed)
    fused = [f"{type(p).__name__}: {' + '.join(names)}" for p, names in groups]
    for parent, names in groups:
        _fuse(parent, names)
    renamed = _rename(net)
    out = Rewrite(net, feed, fused, renamed)
    if causal_lm:
        out.module, out.feed, out.packing = _pack(net, feed)
    return out
