"""Round 3 of `ffdebug hunt` when round 2 named a layer whose input already differs between the
sides: attribution (docs/hunt.md "ffdebug hunt", round 3). The target runs once more, its named layer fed the
reference's dumped `hidden_in` (`FFDEBUG_FWD_FEED_DIR`, capture/feed.py), with the same full dump
of that layer as round 2. Against round 2's reference dump, the layer's output error on the
reference's own input is the error it makes itself:

    local  when  rel_fed(out) > 0  and  rel_fed(out) >= LOCAL_SHARE · rel_round2(out)

(`ffdebug/bisection/attribution.py`'s rule, the same share), else `inherited`: the layer only
carries (or amplifies) what its input brought. The sub-stage is the first lossy one on the fed
input, where no inherited error can mask it.
"""

from __future__ import annotations

import os

from ffdebug.bisection.attribution import LOCAL_SHARE
from ffdebug.hunt.runner import command_text, fresh_dir, run_side, tree_bytes
from ffdebug.hunt.state import HuntState, Round


def is_local(fed_rel: float | None, dumped_rel: float | None) -> bool:
    """The layer makes its own error: some on the reference's input, and not a negligible share of
    what round 2 measured on its own input."""
    fed, dumped = fed_rel or 0.0, dumped_rel or 0.0
    return fed > 0.0 and fed >= LOCAL_SHARE * dumped


def attribution_env(layer: int, feed_dir: str) -> dict[str, str]:
    return {
        "FFDEBUG_FWD_DUMP_MODE": "full",
        "FFDEBUG_FWD_DUMP_SUBSTAGES": "1",
        "FFDEBUG_FWD_DUMP_LAYERS": str(layer),
        "FFDEBUG_FWD_DUMP_STAGES": f"L{layer:03d}.*",
        "FFDEBUG_FWD_FEED_DIR": feed_dir,
    }


def _row(result, layer: int):
    return next((r for r in result.layers if r.layer == layer), None)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.3g}%"


def round3_attribution(cfg, state: HuntState, dumped_rel: float | None) -> Round:
    """Replay the target's layer `state.layer` on the reference's input and say local or inherited."""
    from ffdebug.bisection.engine import bisect
    from ffdebug.hunt.rounds import check_budget

    layer = state.layer
    round2_ref = os.path.abspath(os.path.join(cfg.dir, "round2", "ref"))
    root = fresh_dir(os.path.abspath(os.path.join(cfg.dir, "round3")))
    env = {
        "FFDEBUG_FWD_DUMP_DIR": root,
        "FFDEBUG_FWD_DUMP_SIDE": "target",
        "FFDEBUG_FWD_DUMP_OVERWRITE": "1",
        **attribution_env(layer, round2_ref),
    }
    if cfg.budget is not None:
        env["FFDEBUG_FWD_DUMP_MAX_BYTES"] = str(max(1, cfg.budget - state.used))
    run_side(cfg.target, env, os.path.join(root, "target.log"), "round 3, target")
    check_budget(root, 3)
    result = bisect(round2_ref, os.path.join(root, "target"), allow_partial=True)
    row = _row(result, layer)
    fed_rel = row.rel_out if row is not None else None
    evidence = [
        f"layer {layer} fed the reference's L{layer:03d}.hidden_in (round 2's dump): rel out {_pct(fed_rel)}"
        f" on the reference's input, {_pct(dumped_rel)} on its own (round 2)"
    ]
    state.local = is_local(fed_rel, dumped_rel)
    sub = result.sub_stage or result.first_divergence
    if state.local and sub is not None and sub.layer == layer:
        state.sub_stage = sub.stage
        evidence.append(
            f"sub-stage {sub.key} on the reference's input: cos {sub.cos}, rel {_pct(sub.rel)} "
            f"({result.sub_stage_why or 'first lossy stage'})"
        )
    state.complete = True
    if state.local:
        decision = f"layer {layer}, sub-stage {state.sub_stage}: the error is local to it (attribution)"
    else:
        evidence.append(
            f"under {LOCAL_SHARE:.0%} of round 2's error is left on the reference's input: the layer "
            "carries what its input brought"
        )
        decision = f"layer {layer} is inherited: its error comes from its input, not from the layer"
    return Round(
        3,
        {"target": env},
        command_text(cfg.ref),
        command_text(cfg.target),
        tree_bytes(root),
        decision,
        evidence,
    )
