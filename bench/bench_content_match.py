"""Benchmark content matching (`weights-diff` with no map between a checkpoint and a port with
its own names, fused qkv / gate-up) against the name-matched diff of the same checkpoint.

Writes, in --dir, a reference checkpoint of `--size` GiB (float32, Llama-shaped: hidden 1024,
MLP 2816, vocab 32000, layers to fill the size) and two targets:
- named: the same tensors under the same names (+1e-3·noise on half of them: byte-equal fast path
  and float64 maths both run) — the name-matched diff;
- port: the same values as a from-scratch port stores them (`blocks.N.attn.wqkv`, `ff.w13`, `ff.w2`,
  `attn_norm.scale`, `tok_emb`, `output`, …) — every name differs, content matching relates them.
Then runs `ffdebug weights-diff REF T --json` for each in its own process: wall time, peak RSS
(wait4) and, for the port, the seconds content matching took (its JSON `content.seconds`).

    python bench/bench_content_match.py --size 0.05   # smoke
    python bench/bench_content_match.py --size 1      # the figure in docs/weights-diff.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

WRITE = textwrap.dedent(
    """
    import sys, torch
    from safetensors.torch import save_file
    size, out = float(sys.argv[1]), sys.argv[2]
    H, I, V = 1024, 2816, 32000
    per_layer = (4 * H * H + 3 * H * I + 2 * H) * 4
    layers = max(1, int((size * (1 << 30) - 2 * V * H * 4) // per_layer))
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.02
    ref, named, port = {}, {}, {}
    ref["model.embed_tokens.weight"], ref["lm_head.weight"] = r(V, H), r(V, H)
    ref["model.norm.weight"] = 1 + r(H)
    port["tok_emb.weight"], port["output.weight"] = ref["model.embed_tokens.weight"], ref["lm_head.weight"]
    port["norm_f.scale"] = ref["model.norm.weight"]
    for i in range(layers):
        p = f"model.layers.{i}."
        for n, s in (("q", (H, H)), ("k", (H, H)), ("v", (H, H)), ("o", (H, H))):
            ref[p + f"self_attn.{n}_proj.weight"] = r(*s)
        for n, s in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            ref[p + f"mlp.{n}_proj.weight"] = r(*s)
        ref[p + "input_layernorm.weight"] = 1 + r(H)
        ref[p + "post_attention_layernorm.weight"] = 1 + r(H)
        b = f"blocks.{i}."
        port[b + "attn.wqkv.weight"] = torch.cat([ref[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        port[b + "attn.wo.weight"] = ref[p + "self_attn.o_proj.weight"]
        port[b + "ff.w13.weight"] = torch.cat([ref[p + "mlp.gate_proj.weight"], ref[p + "mlp.up_proj.weight"]])
        port[b + "ff.w2.weight"] = ref[p + "mlp.down_proj.weight"]
        port[b + "attn_norm.scale"] = ref[p + "input_layernorm.weight"]
        port[b + "ff_norm.scale"] = ref[p + "post_attention_layernorm.weight"]
    for j, (k, v) in enumerate(ref.items()):
        named[k] = v + 1e-3 * r(*v.shape) if j % 2 else v
    save_file(ref, out + "/ref.safetensors")
    save_file(named, out + "/named.safetensors")
    save_file(port, out + "/port.safetensors")
    print(layers, len(ref), len(port))
    """
)


def measure(cmd: list[str]) -> tuple[float, float, str]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, _, usage = os.wait4(proc.pid, 0)
    return time.perf_counter() - t0, usage.ru_maxrss / 1024.0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=float, default=1.0, help="GiB of the reference checkpoint")
    ap.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp dir)")
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="ffdebug-bench-content-")
    os.makedirs(root, exist_ok=True)
    try:
        info = subprocess.run(
            [sys.executable, "-c", WRITE, str(args.size), root], check=True, capture_output=True, text=True
        )
        layers, n_ref, n_port = info.stdout.split()
        ref = os.path.join(root, "ref.safetensors")
        cli = [sys.executable, "-m", "ffdebug.cli.app", "weights-diff", ref]
        wall_named, rss_named, _ = measure(cli + [os.path.join(root, "named.safetensors"), "--json"])
        wall_port, rss_port, out = measure(cli + [os.path.join(root, "port.safetensors"), "--json"])
        res = json.loads(out)
        content = res["content"]
        print(
            f"reference: {os.path.getsize(ref) / (1 << 30):.2f} GiB, {layers} layers, {n_ref} tensors; port {n_port} tensors"
        )
        print(f"name-matched weights-diff: {wall_named:.1f} s, peak RSS {rss_named:.0f} MiB")
        print(
            f"port, no map: {wall_port:.1f} s (content matching {content['seconds']:.1f} s), "
            f"peak RSS {rss_port:.0f} MiB; {len(res['tensors'])} tensors compared, passed={res['passed']}, "
            f"unmatched {len(content['unmatched_ref']) + len(content['unmatched_target'])}"
        )
        print(
            f"ratio: port / name-matched {wall_port / wall_named:.2f}x; content matching alone {content['seconds'] / wall_named:.2f}x"
        )
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
