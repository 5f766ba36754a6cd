"""Write dumps with ATOM's own debug_helper, then check them with ffdebug (docs/peer-dumps.md "Peer dumps").

    git clone https://github.com/ROCm/ATOM /tmp/ATOM
    python scripts/peer_dumps/atom_genuine.py /tmp/ATOM /tmp/atom_dumps
    ffdebug compare ref-vs-target --dir /tmp/atom_dumps/fwd        # hook files vs ref_ files: layer 1
    ffdebug weights-diff /tmp/atom_dumps/model.safetensors /tmp/atom_dumps/weights   # layer 1's mlp

`dump.py` and `ref_patch.py` are loaded from the checkout by path; `atom.utils.envs` is replaced by
the env values below (ATOM reads them there).
"""

import importlib.util
import os
import shutil
import sys
import types


def _load(atom_root: str, name: str):
    path = os.path.join(atom_root, "atom", "utils", "debug_helper", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"atom_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main(atom_root: str, out: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    envs = types.SimpleNamespace(
        ATOM_FWD_DUMP_DIR=os.path.join(out, "fwd"),
        ATOM_FWD_DUMP_LAYERS="",
        ATOM_FWD_DUMP_BLOCK_CLASS="Block,MLP",
        ATOM_FWD_DUMP_LAYER_ATTR="layer_id",
        ATOM_FWD_DUMP_ONE_SHOT=True,
        ATOM_WEIGHT_DUMP_DIR=os.path.join(out, "weights"),
        ATOM_WEIGHT_DUMP_LAYERS="0,1",
        ATOM_WEIGHT_DUMP_EXIT=False,
        ATOM_DEBUG_TOPK=0,
        ATOM_DEBUG_TOPK_PATH="",
    )
    utils = types.ModuleType("atom.utils")
    utils.envs = envs
    sys.modules.update({"atom": types.ModuleType("atom"), "atom.utils": utils, "atom.utils.envs": envs})
    import torch
    from safetensors.torch import save_file
    from torch import nn

    dump, ref_patch = _load(atom_root, "dump"), _load(atom_root, "ref_patch")

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.up(x))

    class Block(nn.Module):
        def __init__(self, i):
            super().__init__()
            self.layer_id = i
            self.norm = nn.LayerNorm(8)
            self.mlp = MLP()

        def forward(self, x):
            return x + self.mlp(self.norm(x))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(Block(i) for i in range(3))

        def forward(self, x):
            for b in self.layers:
                x = b(x)
            return x

    torch.manual_seed(0)
    ref, tgt = Model(), Model()
    tgt.load_state_dict(ref.state_dict())
    with torch.no_grad():
        tgt.layers[1].mlp.up.weight[0] *= 1.5  # the target's bug: layer 1's MLP
    x = torch.randn(7, 8)
    dump.install_block_forward_hooks(tgt)
    tgt(x)  # ATOM's hook files
    with ref_patch.patch_block_forward(Block), ref_patch.patch_module_dump(MLP):
        ref(x)  # the reference's ref_ files, in the same directory
    dump.maybe_dump_weights_and_exit(tgt)
    save_file(
        {k: v.contiguous() for k, v in ref.state_dict().items()}, os.path.join(out, "model.safetensors")
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
