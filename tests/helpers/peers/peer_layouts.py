"""Files in the peers' exact current layouts, written without the peer packages.

SGLang 0.5.23 `sglang/srt/debug_utils/dumper.py` (`_Dumper._dump_single`): file
`{dir}/{exp_name}/` + "___".join(f"{k}={v}") over step, rank, dump_index, then the tags (name,
recompute_status, the dump's kwargs, the set_ctx context) + ".pt"; payload `{"value": tensor,
"meta": {those tags, world_rank, world_size, sglang_parallel_info, dims}}`; dump_index counts from 1
per process, step from 0 (advanced by `dumper.step()`).

ATOM main `atom/utils/debug_helper/dump.py` / `ref_patch.py`: hook files
`layer{LL:02d}_{Class}_rank{R}.pt` or `..._rank{R}_call{NNN:03d}.pt` holding `{hidden, shape,
input, input_fields, output_fields}`; reference files `{prefix}_layer{LL:02d}_{Class}__{stage}_rank{R}.pt`
holding `{hidden, shape}`; weight files `weight_rank{R}_layer{L}.pt` holding params, `buffer:NAME`
buffers, `_tp_rank`, `_tp_size`, `_layer`; `compare.py ref-vs-target` reads `{side}_rank{R}_fwd.pt`.
"""

from __future__ import annotations

import os

import torch


class SGLangRun:
    """One SGLang dumper process: `dump()` as `dumper.dump(name, value, dims=..., **kwargs)` with
    the `set_ctx` context in `ctx`, `step()` as `dumper.step()`."""

    def __init__(
        self, root, exp_name="dump_20261201_120000_000abc", rank=0, world_size=1, parallel_info=None
    ):
        self.dir = os.path.join(str(root), exp_name)
        os.makedirs(self.dir, exist_ok=True)
        self.rank, self.world_size = rank, world_size
        self.parallel_info = parallel_info
        self.dump_index = 0
        self.step_n = 0
        self.ctx: dict = {}

    def dump(self, name, value, dims=None, recompute_status="disabled", **kwargs):
        self.dump_index += 1
        tags = dict(name=name, recompute_status=recompute_status, **kwargs, **self.ctx)
        full = dict(step=self.step_n, rank=self.rank, dump_index=self.dump_index, **tags)
        path = os.path.join(self.dir, "___".join(f"{k}={v}" for k, v in full.items()) + ".pt")
        meta = dict(full, world_rank=self.rank, world_size=self.world_size)
        if self.parallel_info is not None:
            meta["sglang_parallel_info"] = self.parallel_info
        if dims is not None:
            meta["dims"] = dims
        torch.save({"value": value, "meta": meta}, path)
        return path

    def step(self):
        self.step_n += 1


def atom_hook(d, layer, cls, rank, hidden, inp=None, call=None, input_fields=None, output_fields=None):
    base = os.path.join(str(d), f"layer{layer:02d}_{cls}_rank{rank}")
    path = base + (".pt" if call is None else f"_call{call:03d}.pt")
    torch.save(
        {
            "hidden": hidden,
            "shape": tuple(hidden.shape),
            "input": inp,
            "input_fields": input_fields or {},
            "output_fields": output_fields or {},
        },
        path,
    )
    return path


def atom_ref(d, layer, cls, stage, rank, t, prefix="ref"):
    path = os.path.join(str(d), f"{prefix}_layer{layer:02d}_{cls}__{stage}_rank{rank}.pt")
    torch.save({"hidden": t, "shape": tuple(t.shape)}, path)
    return path


def atom_weights(d, rank, layer, params: dict, buffers: dict, tp_size=1):
    pkt = {"_tp_rank": rank, "_tp_size": tp_size, "_layer": layer}
    pkt.update(params)
    pkt.update({f"buffer:{k}": v for k, v in buffers.items()})
    path = os.path.join(str(d), f"weight_rank{rank}_layer{layer}.pt")
    torch.save(pkt, path)
    return path


def residual_stream(num_layers=3, tokens=7, width=16, seed=0, bug_layer=None, bug_scale=1.5):
    """Hidden states of a toy residual stack: h_{l+1} = h_l + tanh(h_l W_l); `bug_layer` scales
    that layer's update (an injected bug whose first effect is that layer's output)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, width, generator=g)
    ws = [torch.randn(width, width, generator=g) / width**0.5 for _ in range(num_layers)]
    ins, updates, outs = [], [], []
    for layer, w in enumerate(ws):
        ins.append(h)
        u = torch.tanh(h @ w) * (bug_scale if layer == bug_layer else 1.0)
        updates.append(u)
        h = h + u
        outs.append(h)
    return ins, updates, outs
