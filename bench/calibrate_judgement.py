"""Calibration data for the judgement rules (docs/bisect.md, "Calibration"): what precision alone
does to each measure, against what planted mutations do.

Reads the dumps `ffdebug selftest --keep DIR` left (one folder per architecture: `ref`, the
precision sides `bf16` / `fp16` / `sdpa`, the mutation sides `m_*`), compares every side with `ref`
through `ffdebug.compare` and prints, per precision side:

- the element-wise error `elem` against depth (the stage's position among the blocks), as a
  multiple of the target dtype's machine epsilon, and `rel`;
- the error each layer adds (`added`, rel out - rel in) and the largest ratio of one layer's added
  error to the next layer's (what a `jump` needs);
- for same-dtype sides (sdpa), the first stage that is not bit-equal: its rel and elem in ulps.

and for the mutations the same measures at the mutated layer, so the gap between the two
populations is visible. `--json FILE` writes every row.

    ffdebug selftest --zoo --sample 40 --seed 11 --keep /tmp/cal
    python bench/calibrate_judgement.py /tmp/cal [--json rows.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from pathlib import Path

PRECISION_SIDES = ("bf16", "fp16", "sdpa")
_LAYER = re.compile(r"^L(\d+)\.")


def _eps(dtype: str | None) -> float:
    import torch

    d = getattr(torch, dtype or "float32", torch.float32)
    return torch.finfo(d).eps if isinstance(d, torch.dtype) and d.is_floating_point else torch.finfo().eps


def side_rows(ref: str, side: str) -> dict:
    """Per-stage and per-layer measures of one side against the reference."""
    import ffdebug
    from ffdebug.bisection import budget

    result = ffdebug.compare(ref, side)
    stages = [e for e in result.stages if e.rel is not None and (e.invocation or 0) == 0]
    low = max((_eps(e.dtype_target) for e in stages), default=_eps(None))
    from ffdebug.bisection.substage import largest_step

    rows = budget.layer_rows(stages)
    steps = [largest_step([e for e in stages if e.layer == r.layer]) for r in rows]
    added = [r.added for r in rows if r.added is not None]
    pos = sorted(added, reverse=True)
    ratio = pos[0] / pos[1] if len(pos) > 1 and pos[1] > 0 else None
    first_inexact = next((e for e in stages if not e.exact), None)
    return {
        "eps": low,
        "layers": len(rows),
        "stages": [
            {
                "key": e.key,
                "layer": e.layer,
                "depth": (e.layer + 1)
                if e.layer is not None
                else (0 if e.key.startswith("embed") else len(rows)),
                "dtype": e.dtype_target,
                "elem": e.elem,
                "rel": e.rel,
                "cos": e.cos,
                "severity": e.severity.value,
            }
            for e in stages
        ],
        "added": [(r.layer, r.layer_class, r.added, r.rel_in) for r in rows],
        "steps": [(r.layer, st.key if st is not None else None, v) for r, (st, v) in zip(rows, steps)],
        "jump_ratio": ratio,
        "first_inexact": None
        if first_inexact is None
        else {
            "key": first_inexact.key,
            "rel": first_inexact.rel,
            "elem": first_inexact.elem,
            "same_dtype": first_inexact.same_dtype,
            "eps": _eps(first_inexact.dtype_target),
        },
        "worst": result.verdict.value if hasattr(result, "verdict") else None,
    }


def _q(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return math.nan
    return values[min(len(values) - 1, int(q * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("keep", help="the --keep directory of ffdebug selftest")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    os.environ.setdefault("FFDEBUG_LOG_LEVEL", "error")
    out: dict = {}
    for arch in sorted(Path(args.keep).iterdir()):
        ref = arch / "ref"
        if not ref.is_dir():
            continue
        for side in sorted(arch.iterdir()):
            if side.name == "ref" or side.name == "copy" or not side.is_dir():
                continue
            try:
                out[f"{arch.name}/{side.name}"] = side_rows(str(ref), str(side))
            except Exception as e:  # noqa: BLE001 - a side that cannot be compared is listed
                out[f"{arch.name}/{side.name}"] = {"error": f"{type(e).__name__}: {e}"}
    report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


def report(out: dict) -> None:
    for side in PRECISION_SIDES:
        runs = [v for k, v in out.items() if k.endswith("/" + side) and "error" not in v]
        if not runs:
            continue
        print(f"\n== {side}: {len(runs)} architectures")
        by_depth: dict[int, list[float]] = {}
        rel_depth: dict[int, list[float]] = {}
        for v in runs:
            for s in v["stages"]:
                if s["elem"] is not None:
                    by_depth.setdefault(s["depth"], []).append(s["elem"] / v["eps"])
                    rel_depth.setdefault(s["depth"], []).append(s["rel"] / v["eps"])
        print("depth  n    elem/eps p50 p95 max      rel/eps p50 p95 max")
        for d in sorted(by_depth):
            e, r = by_depth[d], rel_depth[d]
            print(
                f"{d:5d} {len(e):4d}   {_q(e, 0.5):8.3g} {_q(e, 0.95):8.3g} {max(e):8.3g}"
                f"   {_q(r, 0.5):8.3g} {_q(r, 0.95):8.3g} {max(r):8.3g}"
            )
        added = [a[2] / v["eps"] for v in runs for a in v["added"] if a[2] is not None]
        steps = [x[2] / v["eps"] for v in runs for x in v.get("steps", []) if x[2] is not None]
        print(
            f"largest stage step/eps per layer: p50 {_q(steps, 0.5):.3g} p95 {_q(steps, 0.95):.3g} max {max(steps, default=0):.3g}"
        )
        ratios = [v["jump_ratio"] for v in runs if v["jump_ratio"] is not None]
        print(
            f"added/eps per layer: p50 {_q(added, 0.5):.3g} p95 {_q(added, 0.95):.3g} max {max(added, default=0):.3g}"
        )
        if ratios:
            print(
                f"largest/second added: p50 {_q(ratios, 0.5):.3g} p95 {_q(ratios, 0.95):.3g} max {max(ratios):.3g}"
            )
        fi = [v["first_inexact"] for v in runs if v["first_inexact"] and v["first_inexact"]["same_dtype"]]
        if fi:
            rels = [f["rel"] / f["eps"] for f in fi]
            elems = [(f["elem"] or 0) / f["eps"] for f in fi]
            print(
                f"first inexact (same dtype) n={len(fi)}: rel/eps max {max(rels):.3g} p95 {_q(rels, 0.95):.3g}; elem/eps max {max(elems):.3g} p95 {_q(elems, 0.95):.3g}"
            )
        sev = [s["severity"] for v in runs for s in v["stages"]]
        print("stage severities:", {k: sev.count(k) for k in sorted(set(sev))})
    muts = {k: v for k, v in out.items() if "/m_" in k and "error" not in v}
    if muts:
        print(f"\n== mutations: {len(muts)}")
        for k, v in sorted(muts.items()):
            fi = v["first_inexact"]
            top = max((a for a in v["added"] if a[2] is not None), key=lambda a: a[2], default=None)
            fi_s = (
                f"{fi['key']} rel/eps {fi['rel'] / fi['eps']:.3g} elem/eps {(fi['elem'] or 0) / fi['eps']:.3g}"
                if fi
                else "-"
            )
            top_s = f"L{top[0]} added {top[2]:.3g}" if top else "-"
            ratio = f"{v['jump_ratio']:.3g}" if v["jump_ratio"] else "-"
            print(f"{k:55s} first inexact {fi_s:60s} top {top_s:22s} ratio {ratio}")


if __name__ == "__main__":
    main()
