"""The rounds of `ffdebug hunt` (docs/hunt.md "Hunt: from symptom to root cause").

  0. weights (`--weights A B`, or `--dump-weights`: the commands' `maybe_dump_weights_and_exit`):
     weights-diff; a weight bug ends the hunt;
  1. a sketch of every layer's block stages plus embed and final (`FFDEBUG_FWD_DUMP_MODE=sketch`);
     bisect over those estimates names the first introducing layer;
  2. full dumps of that layer with its role sub-stages (`attn.q.out`, `mlp.gate.out`, …) and the
     block stages of the one before it;
     bisect names the layer, the sub-stage that loses accuracy first, and whether the layer
     introduces the error itself (`local`).

Each round returns a `Round` (its decision and evidence) and fills in the state's conclusion.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ffdebug.errors import FFDebugError
from ffdebug.hunt.runner import Command, command_text, fresh_dir, run_side, tree_bytes
from ffdebug.hunt.state import HuntState, Round

# Round 1's stages: each block's branch outputs and its output, plus the stages outside the blocks.
# Left out because another stage carries them: `hidden_in` past layer 0 (the previous block's
# `hidden_out`; bisect reads it as the input) and the norm outputs (the branch they feed shows their
# error; round 2 dumps them). A sketch costs 4 KiB whatever the tensor's size.
ROUND1_STAGES = (
    "L000.hidden_in",
    "L*.attn_out",
    "L*.ffn_out",
    "L*.hidden_out*",
    "embed.*",
    "final.*",
)


@dataclass(frozen=True)
class HuntConfig:
    """What `ffdebug hunt` was asked: the commands, the directory, the budget."""

    ref: Command  # a shell line, or (Python API) a function run in this process
    target: Command
    dir: str
    noise: Command | None = None
    budget: int | None = None  # bytes, every side and round together
    weights: tuple[str, str] | None = None
    dump_weights: bool = False  # round 0 from the commands' `maybe_dump_weights_and_exit`
    seed: int = 0

    def __post_init__(self) -> None:
        if self.weights is not None and self.dump_weights:
            raise FFDebugError("hunt: give --weights A B or --dump-weights, not both")

    def sides(self) -> dict[str, Command]:
        out = {"ref": self.ref, "target": self.target}
        if self.noise:
            out["noise"] = self.noise
        return out


def _run_round(cfg: HuntConfig, state: HuntState, number: int, env: dict[str, dict[str, str]]) -> str:
    """Run every side's command for round `number` into `D/round<N>/`; returns that directory."""
    root = fresh_dir(os.path.abspath(os.path.join(cfg.dir, f"round{number}")))
    left = None if cfg.budget is None else max(1, (cfg.budget - state.used) // len(cfg.sides()))
    for side, command in cfg.sides().items():
        side_env = {
            "FFDEBUG_FWD_DUMP_DIR": root,
            "FFDEBUG_FWD_DUMP_SIDE": side,
            "FFDEBUG_FWD_DUMP_OVERWRITE": "1",
            **env.get(side, {}),
        }
        if left is not None:
            side_env["FFDEBUG_FWD_DUMP_MAX_BYTES"] = str(left)
        env[side] = {k: v for k, v in side_env.items()}
        run_side(command, side_env, os.path.join(root, f"{side}.log"), f"round {number}, {side}")
    return root


def over_budget(root: str) -> int:
    """Captures the writers left out because the byte budget was reached (their status.json)."""
    count = 0
    for dirpath, _, files in os.walk(root):
        if "status.json" in files:
            with open(os.path.join(dirpath, "status.json"), encoding="utf-8") as f:
                count += int(json.load(f).get("over_budget") or 0)
    return count


class BudgetSpent(Exception):
    """A round's writers reached the byte budget: what they left out would be judged on statistics
    alone, which never clears a stage, so the round is not kept."""

    def __init__(self, number: int, skipped: int) -> None:
        super().__init__(
            f"round {number}: {skipped} capture(s) not written, the byte budget was reached; "
            "raise --budget and --resume"
        )
        self.number, self.skipped = number, skipped


def check_budget(root: str, number: int) -> None:
    skipped = over_budget(root)
    if skipped:
        raise BudgetSpent(number, skipped)


def _round(cfg: HuntConfig, number: int, env: dict, root: str, decision: str, evidence: list[str]) -> Round:
    return Round(
        round=number,
        env=env,
        command_ref=command_text(cfg.ref),
        command_target=command_text(cfg.target),
        bytes=tree_bytes(root),
        decision=decision,
        evidence=evidence,
    )


def _dump_weights(cfg: HuntConfig) -> tuple[tuple[str, str], dict[str, dict[str, str]]]:
    """Run the reference and target with FFDEBUG_WEIGHT_DUMP_DIR set: each command's
    `ffdebug.maybe_dump_weights_and_exit(model)` dumps its weights under `D/round0/<side>/weights`
    and exits before the forward. Returns the two dumps and the environments used."""
    root = fresh_dir(os.path.abspath(os.path.join(cfg.dir, "round0")))
    env, dumps = {}, []
    for side, command in (("ref", cfg.ref), ("target", cfg.target)):
        side_dir = os.path.join(root, side)
        env[side] = {"FFDEBUG_WEIGHT_DUMP_DIR": side_dir, "FFDEBUG_WEIGHT_DUMP_EXIT": "1"}
        run_side(command, env[side], os.path.join(root, f"{side}.log"), f"round 0, {side}")
        dumps.append(os.path.join(side_dir, "weights"))
        if not os.path.isdir(dumps[-1]):
            raise FFDebugError(
                f"--dump-weights: the {side} command ({command_text(command)!r}) wrote no weights under {side_dir}; "
                "call ffdebug.maybe_dump_weights_and_exit(model) before its forward, or drop --dump-weights"
            )
    return (dumps[0], dumps[1]), env


def round0_weights(cfg: HuntConfig, state: HuntState) -> Round:
    """Weights-diff of the two checkpoints (given, or dumped by the commands); a difference ends
    the hunt (a weight bug)."""
    from ffdebug.weights.diff import weights_diff

    env: dict[str, dict[str, str]] = {}
    if cfg.dump_weights:
        (a, b), env = _dump_weights(cfg)
    else:
        a, b = cfg.weights
    result = weights_diff(a, b)
    failed = result.failed()
    evidence = [f"weights-diff {a} {b}: verdict {result.verdict.value}"]
    evidence.extend(f"{t.name}: {t.finding} ({t.severity.value})" for t in result.problems()[:5])
    if not result.schema_clean:
        evidence.append("the checkpoints differ in their keys, shapes or dtypes")
    if failed:  # the error starts before any stage: at the weights
        state.complete, state.sub_stage = True, "weights"
        decision = "weight bug: the checkpoints differ, fix the weights before any forward"
    else:
        decision = "weights match: go on to the forward"
    used = tree_bytes(os.path.join(cfg.dir, "round0")) if cfg.dump_weights else 0
    return Round(0, env, command_text(cfg.ref), command_text(cfg.target), used, decision, evidence)


def _bisect(root: str, noise: bool):
    from ffdebug.bisection.engine import bisect

    ref, target = os.path.join(root, "ref"), os.path.join(root, "target")
    return bisect(ref, target, noise=os.path.join(root, "noise") if noise else None, allow_partial=True)


def _layer_lines(result, around: int | None) -> list[str]:
    lines = []
    for row in result.layers:
        if around is not None and abs(row.layer - around) > 1:
            continue
        lines.append(
            f"layer {row.layer} ({row.layer_class}): rel in {_pct(row.rel_in)}, rel out {_pct(row.rel_out)}, "
            f"added {_pct(row.added)}{', introduces error' if row.introduces else ''}"
        )
    return lines


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.3g}%"


def round1_sketch(cfg: HuntConfig, state: HuntState) -> Round:
    """Sketches of every block stage: the first layer that introduces error."""
    env = {
        side: {
            "FFDEBUG_FWD_DUMP_MODE": "sketch",
            "FFDEBUG_FWD_DUMP_SKETCH_SEED": str(cfg.seed),
            "FFDEBUG_FWD_DUMP_STAGES": ",".join(ROUND1_STAGES),
        }
        for side in cfg.sides()
    }
    root = _run_round(cfg, state, 1, env)
    check_budget(root, 1)
    result = _bisect(root, bool(cfg.noise))
    first = result.first_divergence
    evidence = [f"pattern {result.pattern.value}: {result.reason}"]
    if first is None:
        state.complete = True
        return _round(cfg, 1, env, root, "no stage leaves the ok band: nothing to hunt", evidence)
    evidence.append(
        f"first divergence {first.key}: {first.severity.value} (cos {first.cos}, rel {_pct(first.rel)})"
    )
    if first.layer is None:
        state.sub_stage, state.complete = first.stage, True
        return _round(cfg, 1, env, root, f"the error starts outside the layers, at {first.key}", evidence)
    evidence.extend(_layer_lines(result, first.layer))
    state.layer, state.layer_class = first.layer, first.layer_class
    before = f" (and layer {first.layer - 1}'s block stages)" if first.layer > 0 else ""
    decision = f"layer {first.layer} introduces error: dump it in full with its sub-stages{before}"
    return _round(cfg, 1, env, root, decision, evidence)


def _round2_stages(layer: int) -> list[str]:
    """Every stage of `layer` (sub-stages and taps included); round 1's stages of the one before
    (its output is the layer's input, and says whether the sketch placed the error one layer late)."""
    before = [g.replace("L*", f"L{layer - 1:03d}") for g in ROUND1_STAGES if g.startswith("L*")]
    return [*(before if layer > 0 else []), f"L{layer:03d}.*"]


def round2_full(cfg: HuntConfig, state: HuntState) -> Round:
    """Full dumps of the introducing layer with its role sub-stages, and the block stages of the
    one before."""
    return _full_round(cfg, state, 2)


def round3(cfg: HuntConfig, state: HuntState) -> Round:
    """Round 2 found the layer before already wrong: the same full dump of that layer. Else round 2
    named a layer whose input already differed: attribution (its target block replayed on the
    reference's input, `attribution_round`) says local or inherited."""
    from ffdebug.hunt.attribution_round import round3_attribution

    dumped = state.done(2).env["target"]["FFDEBUG_FWD_DUMP_LAYERS"].split(",")[-1]
    if state.layer != int(dumped):
        return _full_round(cfg, state, 3)
    result = _bisect(os.path.join(os.path.abspath(cfg.dir), "round2"), bool(cfg.noise))
    row = next((r for r in result.layers if r.layer == state.layer), None)
    return round3_attribution(cfg, state, row.rel_out if row is not None else None)


def _full_env(cfg: HuntConfig, layer: int) -> dict[str, dict[str, str]]:
    """Full dumps with role sub-stages (docs/dumping.md "Role sub-stages"): `attn.q.out`, `mlp.gate.out`, …
    pair between two codebases however their modules are named."""
    layers = [x for x in (layer - 1, layer) if x >= 0]
    common = {
        "FFDEBUG_FWD_DUMP_MODE": "full",
        "FFDEBUG_FWD_DUMP_SUBSTAGES": "1",
        "FFDEBUG_FWD_DUMP_LAYERS": ",".join(map(str, layers)),
        "FFDEBUG_FWD_DUMP_STAGES": ",".join(_round2_stages(layer)),
    }
    return {side: dict(common) for side in cfg.sides()}


def _around(result, stage) -> list[str]:
    """What the named sub-stage's step was measured against (its `.in`, else the nearest earlier
    stage of its shape, else the block's input: `ffdebug/bisection/substage.py`), and the later
    stages of the layer measured against it."""
    from ffdebug.bisection.substage import input_and_readers

    base, readers = input_and_readers([e for e in result.stages if e.layer == stage.layer], stage.key)
    lines = []
    if base is not None:
        lines.append(f"its step measured against {base.key}: {_state_of(base)}")
    lines.extend(f"measured against it: {e.key}, {_state_of(e)}" for e in readers[:4])
    return lines


def _state_of(e) -> str:
    return (
        "bit-equal"
        if e.exact
        else f"cos {e.cos:.6g}, rel {_pct(e.rel)}"
        if e.cos is not None
        else _pct(e.rel)
    )


def _input_exact(result, layer: int) -> bool:
    """The layer's `hidden_in` was compared and is bit-equal (same dtype) on both sides."""
    from ffdebug.bisection.budget import is_exact

    key = f"L{layer:03d}.hidden_in"
    return is_exact(next((e for e in result.stages if e.key == key), None))


def _full_round(cfg: HuntConfig, state: HuntState, number: int) -> Round:
    layer = state.layer
    env = _full_env(cfg, layer)
    root = _run_round(cfg, state, number, env)
    check_budget(root, number)
    result = _bisect(root, bool(cfg.noise))
    first, sub = result.first_divergence, result.sub_stage
    evidence = [f"pattern {result.pattern.value}: {result.reason}"]
    if first is None or first.layer is None:
        evidence.append("the full dumps show no divergence in these layers: the sketch estimate was wrong")
        state.complete = True
        return _round(cfg, number, env, root, f"no divergence in layer {layer} at full precision", evidence)
    evidence.extend(_layer_lines(result, first.layer))
    row = next((r for r in result.layers if r.layer == first.layer), None)
    state.layer, state.layer_class = first.layer, first.layer_class
    state.local = bool(row.introduces) if row is not None else None
    stage = sub if sub is not None else first
    state.sub_stage = stage.stage
    why = result.sub_stage_why or "first lossy stage"
    evidence.append(f"sub-stage {stage.key}: cos {stage.cos}, rel {_pct(stage.rel)} ({why})")
    evidence.extend(_around(result, stage))
    missing = result.coverage.to_json().get("missing")
    if missing:
        evidence.append(f"not paired between the sides: {missing}")
    if first.layer != layer and number == 2:  # the layer before: its sub-stages were not dumped
        return _round(
            cfg, number, env, root, f"layer {first.layer} already diverges: dump it in full", evidence
        )
    if number == 2 and not _input_exact(result, layer):
        evidence.append(
            f"L{layer:03d}.hidden_in differs between the sides: local or inherited needs a replay"
        )
        decision = f"layer {layer}, sub-stage {stage.stage}: replay it on the reference's input (round 3)"
        return _round(cfg, number, env, root, decision, evidence)
    if number == 2:
        evidence.append(f"L{layer:03d}.hidden_in is bit-equal on both sides: the layer's error is its own")
    state.complete = True
    where = "local to it" if state.local else "inherited from earlier layers"
    decision = f"layer {first.layer}, sub-stage {stage.stage}: the error is {where}"
    return _round(cfg, number, env, root, decision, evidence)
