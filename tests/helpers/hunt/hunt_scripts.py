"""Small run scripts for the hunt tests: a tiny Llama built from torch alone (`torch_llama`, with
transformers' module names), or an HF `LlamaForCausalLM` from a config (or its port) where two
codebases are the point, one planted bug on the target side, `ffdebug.install`, one forward. Each run appends its dump directory
to a log so a test can count which rounds ran.

Imported as `from helpers.hunt.hunt_scripts import write_script`; the scripts import `helpers` too,
so the test that runs them puts `tests/` on `PYTHONPATH` (`helpers.subprocess_env`).
"""

from __future__ import annotations

import os
import sys

# target-side bugs: each line runs with `m` the HF model (or `net` the port) and `L` the layer
PLANTS = {
    "none": "",
    "q_proj": "m.model.layers[L].self_attn.q_proj.weight.data[:16] *= 2.0",
    "mlp_gate": "m.model.layers[L].mlp.gate_proj.weight.data[:32] *= 2.0",
    "norm": "m.model.layers[L].post_attention_layernorm.weight.data[:32] *= 2.0",
    # rotary frequencies in reverse order in one layer: every q / k pair is still a rotation
    # (norms kept), by the wrong angle
    "rotary": (
        "def _swap(mod, args, kw):\n"
        "    cos, sin = kw['position_embeddings']\n"
        "    h = cos.shape[-1] // 2\n"
        "    perm = torch.cat([torch.arange(h).flip(0), torch.arange(h, 2 * h).flip(0)])\n"
        "    kw['position_embeddings'] = (cos[..., perm], sin[..., perm])\n"
        "    return args, kw\n"
        "m.model.layers[L].self_attn.register_forward_pre_hook(_swap, with_kwargs=True)"
    ),
    # a tiny error from layer 1 on (inside the ok band): later layers' inputs are no longer
    # bit-equal, so a hunt must replay the planted layer on the reference's input (round 3)
    "drift": "m.model.layers[1].mlp.down_proj.weight.data *= 1.0 + 1e-3",
    # not a bug (give it to both sides): layer L's attention made sharp, so it amplifies a small
    # input difference ~35x; with "drift" the layer looks like it introduces error but inherits it
    "amplifier": (
        "for p in ('q_proj', 'k_proj', 'o_proj'):\n"
        "    getattr(m.model.layers[L].self_attn, p).weight.data *= 30.0"
    ),
    # the port's fused q/k/v weight: its first rows are q's
    "port_q": "getattr(net, 'blocks')[L].attn.wqkv.weight.data[:16] *= 2.0",
    # the port's down projection of layer L never loaded (seeded random weights instead), and
    # its norms taking the mean square in float64 (the same value to a rounding), so no layer
    # input after the first norm is bit-equal to HF's
    "port_down": (
        "getattr(net, 'blocks')[L].ff.w2.weight.data.normal_(0.0, 0.02, "
        "generator=torch.Generator().manual_seed(3))\n"
        "def _resummed(self, x):\n"
        "    h = x.float()\n"
        "    h = h * (h.double().pow(2).mean(-1, keepdim=True) + self.eps).rsqrt().float()\n"
        "    return self.scale * h.to(x.dtype)\n"
        "import types\n"
        "for _mod in net.modules():\n"
        "    if hasattr(_mod, 'eps') and hasattr(_mod, 'scale'):\n"
        "        _mod.forward = types.MethodType(_resummed, _mod)"
    ),
}

_SCRIPT = """import os, sys
import torch
{model_import}
import ffdebug

torch.set_num_threads(1)
with open({log!r}, "a") as f:
    f.write(os.environ.get("FFDEBUG_FWD_DUMP_DIR", "") + "\\n")
m = {build}(num_layers={layers}, hidden={hidden})
L = {layer}
{port}
{plant}
m = m.to(torch.{dtype})
{tap}
{weights}
ffdebug.install({model})
ids = torch.randint(0, 1000, (1, {seq}), generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    {model}(ids)
"""

_PORT = "from helpers.llama_ports import make_port\nnet = make_port(m)"
_HF = "from helpers.tiny_models import tiny_llama"
# the torch-only model's rotary function, tapped as a user's codebase would (docs/dumping.md "Role sub-stages")
_TORCH = (
    "from helpers.hunt.torch_llama import torch_llama\n"
    "ffdebug_rotary = ('helpers.hunt.torch_llama:apply_rotary_pos_emb', ('attn.q_rot', 'attn.k_rot'))"
)


def write_script(
    tmp,
    name: str,
    plant: str = "none",
    layer: int = 0,
    layers: int = 8,
    hidden: int = 64,
    seq: int = 64,
    port: bool = False,
    hf: bool = False,
    dtype: str = "float32",
    weights: bool = False,
) -> tuple[str, str]:
    """Write `tmp/name.py`; returns (shell command, run log path). `hf` (implied by `port`)
    builds transformers' `LlamaForCausalLM`, else the torch-only `torch_llama`; `dtype` is the
    model's dtype once planted (a noise command: the reference in another dtype); `weights` calls
    `ffdebug.maybe_dump_weights_and_exit` before the forward (hunt --dump-weights)."""
    hf = hf or port
    log = os.path.join(str(tmp), f"{name}.runs")
    text = _SCRIPT.format(
        model_import=_HF if hf else _TORCH,
        build="tiny_llama" if hf else "torch_llama",
        tap="" if hf else "ffdebug.tap_function(*ffdebug_rotary)",
        log=log,
        layers=layers,
        hidden=hidden,
        layer=layer,
        seq=seq,
        port=_PORT if port else "",
        plant=PLANTS[plant],
        dtype=dtype,
        weights=f"ffdebug.maybe_dump_weights_and_exit({'net' if port else 'm'})" if weights else "",
        model="net" if port else "m",
    )
    path = os.path.join(str(tmp), f"{name}.py")
    with open(path, "w") as f:
        f.write(text)
    return f"{sys.executable} {path}", log


def runs(log: str) -> list[str]:
    """The dump directories (one per run) a script's log holds."""
    if not os.path.exists(log):
        return []
    with open(log) as f:
        return [os.path.basename(line.strip()) for line in f if line.strip()]


def in_process(
    plant: str = "none",
    layer: int = 0,
    layers: int = 8,
    hidden: int = 64,
    seq: int = 64,
    dtype: str = "float32",
    calls: list | None = None,
    weights: bool = False,
    hf: bool = False,
    port: bool = False,
):
    """The torch-only run script as a function run in the test's own process (hunt's Python API:
    a side's command may be a function; `ffdebug.hunt.runner.run_in_process`): no interpreter nor
    torch start per round. Each call appends its dump directory to `calls` when given."""

    def run() -> None:
        import contextlib

        import torch

        import ffdebug

        if calls is not None:
            calls.append(os.path.basename(os.environ.get("FFDEBUG_FWD_DUMP_DIR", "")))
        if hf or port:
            from helpers.tiny_models import tiny_llama as build

            taps = contextlib.nullcontext()  # transformers' rotary function is tapped by ffdebug
        else:
            from helpers.hunt.torch_llama import torch_llama as build

            taps = ffdebug.tap_function(
                "helpers.hunt.torch_llama:apply_rotary_pos_emb", ("attn.q_rot", "attn.k_rot")
            )
        m = build(num_layers=layers, hidden=hidden)
        net = None
        if port:
            from helpers.llama_ports import make_port

            net = make_port(m)
        for one in plant.split("+"):  # several plants: "drift+q_proj"
            exec(PLANTS[one], {"m": m, "net": net, "L": layer, "torch": torch})
        model = (net if port else m).to(getattr(torch, dtype))
        with taps:
            if weights:
                ffdebug.maybe_dump_weights_and_exit(model)
            ffdebug.install(model)
            ids = torch.randint(0, 1000, (1, seq), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                model(ids)

    kind = "port" if port else "hf_llama" if hf else "torch_llama"
    run.__qualname__ = f"{kind}[{layers} layers, {plant}@{layer}, {dtype}]"
    return run
