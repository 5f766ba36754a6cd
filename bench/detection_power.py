"""Detection power of the judgement (docs/bisect.md, "Calibration"): the smallest planted effect
bisect finds, in fp32 and next to bf16 rounding.

For a seeded sample of the zoo's architectures, the attention's v projection (or q where there
is no v sub-stage) of layer 1 is scaled by 1 + delta for several deltas, in the fp32 model and in
its bf16 copy, each against the fp32 reference; a case is found when bisect fails at layer 1. Prints
the found share per delta and dtype, and the smallest delta found on at least 95% of the models.

    python bench/detection_power.py [--sample 24] [--seed 3]
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import tempfile
from pathlib import Path

DELTAS = (1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=24)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("FFDEBUG_LOG_LEVEL", "error")
    import torch

    import ffdebug
    from ffdebug.selftest.cases import SelftestOptions, _dump, _ids, _records
    from ffdebug.selftest.models import SelftestError, build, resolve
    from ffdebug.selftest.mutations import ONE_LAYER, Planner, _columns, _feature_axes, _scale_output
    from ffdebug.selftest.zoo import sample

    found = {(d, dt): [0, 0] for d in DELTAS for dt in ("float32", "bfloat16")}
    options = SelftestOptions()
    for name in sample(args.sample, args.seed):
        try:
            model = build(resolve(name), options.sizes, 0)
        except (SelftestError, Exception):  # noqa: BLE001 - an architecture that does not build is skipped
            continue
        root = Path(tempfile.mkdtemp(prefix="ffdebug-power-"))
        try:
            ids = _ids(model, options)
            ref = _dump(model, ids, root, "ref")
            planner = Planner(model, _records(ref))
            r = planner.sub(ONE_LAYER, "attn.v") or planner.sub(ONE_LAYER, "attn.q")
            if r is None or not r.module_path or _feature_axes(model.get_submodule(r.module_path)) is None:
                continue
            for delta in DELTAS:
                target = copy.deepcopy(model)
                _scale_output(r.module_path, _columns(r.extra), 1.0 + delta)(target)
                for dtype in ("float32", "bfloat16"):
                    side = f"d{delta:g}_{dtype}"
                    result = ffdebug.bisect(
                        ref, _dump(copy.deepcopy(target).to(getattr(torch, dtype)), ids, root, side)
                    )
                    first = result.first_divergence
                    hit = result.exit_code() == 1 and first is not None and first.layer == ONE_LAYER
                    found[(delta, dtype)][0] += hit
                    found[(delta, dtype)][1] += 1
            print(f"{name}: done", flush=True)
        except Exception as e:  # noqa: BLE001 - a model the harness cannot run is reported, not fatal
            print(f"{name}: {type(e).__name__}: {e}"[:200], flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print("\n| delta | fp32 target | bf16 target |\n|---|---|---|")
    for delta in DELTAS:
        cells = []
        for dtype in ("float32", "bfloat16"):
            h, n = found[(delta, dtype)]
            cells.append(f"{h}/{n} ({100 * h / n:.0f}%)" if n else "-")
        print(f"| {delta:g} | {cells[0]} | {cells[1]} |")
    for dtype in ("float32", "bfloat16"):
        ok = [
            d for d in DELTAS if found[(d, dtype)][1] and found[(d, dtype)][0] >= 0.95 * found[(d, dtype)][1]
        ]
        print(f"smallest delta found on >= 95% ({dtype}): {min(ok) if ok else 'none'}")


if __name__ == "__main__":
    main()
