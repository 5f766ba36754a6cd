"""Write dumps with SGLang's own dumper, then check them with ffdebug (docs/peer-dumps.md "Peer dumps").

    pip download --no-deps sglang==0.5.23 -d /tmp/sgl && unzip -q /tmp/sgl/*.whl 'sglang/*' -d /tmp/sgl/x
    python scripts/peer_dumps/sglang_genuine.py /tmp/sgl/x /tmp/sgl_dumps
    ffdebug compare /tmp/sgl_dumps/baseline /tmp/sgl_dumps/target        # layer 0's mlp_output first
    ffdebug compare /tmp/sgl_dumps/baseline /tmp/sgl_dumps/target_extra  # one extra dump: not a pass

The dumper module is imported from the unpacked wheel (nothing installed); the serving-side
modules it imports for HTTP / ZMQ control are stubbed, as file dumps do not use them.
"""

import os
import shutil
import sys
import types


def _stub(name, **attrs):
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod


def _no_parallel():
    raise RuntimeError("no parallel state outside a server")


def main(sglang_root: str, out: str) -> None:
    sys.path.insert(0, sglang_root)
    noop = lambda *a, **k: None  # noqa: E731
    _stub("zmq")
    _stub("sglang.srt.managers")
    _stub("sglang.srt.managers.io_struct", sock_recv=noop, sock_send=noop, wrap_as_pickle=noop)
    _stub("sglang.srt.runtime_context", get_parallel=_no_parallel, get_server_args=noop, get_serving=noop)
    _stub("sglang.srt.utils", get_device=lambda: "cpu")
    import torch
    from sglang.srt.debug_utils.dumper import DumperConfig, _Dumper

    shutil.rmtree(out, ignore_errors=True)

    def run(side, bug_layer=None, extra=False):
        torch.manual_seed(0)
        d = _Dumper(config=DumperConfig(enable=True, dir=os.path.join(out, side), exp_name="genuine"))
        h = torch.randn(5, 8)
        ws = [torch.randn(8, 8) / 3 for _ in range(3)]
        d.dump("input_ids", torch.arange(5))
        for layer, w in enumerate(ws):
            d.set_ctx(layer_id=layer)
            d.dump("layer_input", h)
            u = torch.tanh(h @ w) * (1.5 if layer == bug_layer else 1.0)
            d.dump("mlp_output", u)
            h = h + u
            d.dump("layer_output", h)
            if extra and layer == 0:
                d.dump("probe", h)
            d.set_ctx(layer_id=None)
        d.step()

    run("baseline")
    run("target", bug_layer=0)
    run("target_extra", extra=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
