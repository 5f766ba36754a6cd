"""Detection power of the judgement (docs/bisect.md, "Calibration"): the smallest planted effect
bisect finds, in fp32 and next to bf16 rounding.

For a seeded sample of the zoo's architectures, the attention's v projection (or q where there
is no v sub-stage) of layer 1 gets one of two planted effects of size delta, in the fp32 model and
in its bf16 copy, each against the fp32 reference; a case is found when bisect fails at layer 1:

- `scale`: its output x (1 + delta), an error along the signal (a wrong constant, a loader that
  scales a tensor);
- `rotate`: each pair of its output features (2i, 2i + 1) rotated by the angle whose sine is
  delta, an error of size about delta that is not a scale of the signal (cos(t - r, r) = -delta / 2:
  mixed features, a wrong rotary angle), which against another dtype is told from amplified
  rounding only by its size (`verdict.amplified_precision`).

Prints the found share per effect, delta and dtype, and the smallest delta found on at least 95%
of the models.

    python bench/detection_power.py [--sample 24] [--seed 3]
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import tempfile
from pathlib import Path

DELTAS = (1e-4, 1e-3, 1e-2, 3e-2, 0.1, 0.3, 0.5)
EFFECTS = ("scale", "rotate")


def _rotate_output(path: str, cols, delta: float):
    """The projection's output feature pairs (2i, 2i + 1) inside `cols` rotated by asin(delta), in
    its weights (and bias)."""
    import math

    def plant(model) -> None:
        import torch

        from ffdebug.selftest.mutations import _feature_axes

        module = model.get_submodule(path)
        out_axis, _ = _feature_axes(module)
        c, s = math.sqrt(1.0 - delta * delta), delta
        with torch.no_grad():
            for lo, hi in cols or [(0, module.weight.shape[out_axis])]:
                for p in [module.weight] + (
                    [module.bias] if getattr(module, "bias", None) is not None else []
                ):
                    axis = out_axis if p.dim() == 2 else 0
                    even = p.narrow(axis, lo, hi - lo).narrow(axis, 0, (hi - lo) // 2 * 2)
                    a = even.unflatten(axis, (-1, 2)).select(axis + 1, 0).clone()
                    b = even.unflatten(axis, (-1, 2)).select(axis + 1, 1).clone()
                    even.unflatten(axis, (-1, 2)).select(axis + 1, 0).copy_(c * a - s * b)
                    even.unflatten(axis, (-1, 2)).select(axis + 1, 1).copy_(s * a + c * b)

    return plant


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sample", type=int, default=24)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("FFDEBUG_LOG_LEVEL", "error")
    import torch

    import ffdebug
    from ffdebug.selftest.cases import SelftestOptions, _dump, _inputs, _records
    from ffdebug.selftest.models import SelftestError, build, resolve
    from ffdebug.selftest.mutations import ONE_LAYER, Planner, _columns, _feature_axes, _scale_output
    from ffdebug.selftest.zoo import sample

    found = {(f, d, dt): [0, 0] for f in EFFECTS for d in DELTAS for dt in ("float32", "bfloat16")}
    options = SelftestOptions()
    for name in sample(args.sample, args.seed):
        try:
            spec = resolve(name)
            model = build(spec, options.sizes, 0)
        except (SelftestError, Exception):  # noqa: BLE001 - an architecture that does not build is skipped
            continue
        root = Path(tempfile.mkdtemp(prefix="ffdebug-power-"))
        try:
            ids = _inputs(spec, model, options)
            ref = _dump(model, ids, root, "ref")
            planner = Planner(model, _records(ref))
            r = planner.sub(ONE_LAYER, "attn.v") or planner.sub(ONE_LAYER, "attn.q")
            if r is None or not r.module_path or _feature_axes(model.get_submodule(r.module_path)) is None:
                continue
            for effect in EFFECTS:
                for delta in DELTAS:
                    target = copy.deepcopy(model)
                    plant = _scale_output if effect == "scale" else _rotate_output
                    plant(r.module_path, _columns(r.extra), 1.0 + delta if effect == "scale" else delta)(
                        target
                    )
                    for dtype in ("float32", "bfloat16"):
                        side = f"{effect}{delta:g}_{dtype}"
                        result = ffdebug.bisect(
                            ref, _dump(copy.deepcopy(target).to(getattr(torch, dtype)), ids, root, side)
                        )
                        first = result.first_divergence
                        hit = result.exit_code() == 1 and first is not None and first.layer == ONE_LAYER
                        found[(effect, delta, dtype)][0] += hit
                        found[(effect, delta, dtype)][1] += 1
            print(f"{name}: done", flush=True)
        except Exception as e:  # noqa: BLE001 - a model the harness cannot run is reported, not fatal
            print(f"{name}: {type(e).__name__}: {e}"[:200], flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print("\n| effect | delta | fp32 target | bf16 target |\n|---|---|---|---|")
    for effect in EFFECTS:
        for delta in DELTAS:
            cells = []
            for dtype in ("float32", "bfloat16"):
                h, n = found[(effect, delta, dtype)]
                cells.append(f"{h}/{n} ({100 * h / n:.0f}%)" if n else "-")
            print(f"| {effect} | {delta:g} | {cells[0]} | {cells[1]} |")
    for effect in EFFECTS:
        for dtype in ("float32", "bfloat16"):
            ok = [
                d
                for d in DELTAS
                if found[(effect, d, dtype)][1]
                and found[(effect, d, dtype)][0] >= 0.95 * found[(effect, d, dtype)][1]
            ]
            print(f"smallest delta found on >= 95% ({effect}, {dtype}): {min(ok) if ok else 'none'}")


if __name__ == "__main__":
    main()
