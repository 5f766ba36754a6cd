"""Training-order bisect of trainer stores: the first divergent stage of the first divergent
optimizer step, in the order training computes them (docs/trainer-taps.md "Bisecting a trainer").

A trainer store's stages carry an `optimizer_step` tag. Their paired calls are grouped by phase
(`engine._by_call`), but the call order of a store is not the training order: the taps of one
optimizer step that share their tags (`train.order`, `grad_norm.<role>`, `update.<role>`) form one
call that starts before the step's forwards. So the stages are ordered here as training computes
them:

    optimizer step → phase (eval, rollout, then train) → rollout → reward → advantage
                   → train forwards and losses (in capture order) → gradients → updates

(within a step, phase and rank, in the order the reference captured them; a stage without an
`optimizer_step` tag where it was captured), and the first stage outside the ok band is the first
divergence, unless a stage before it in
training order is the first that is not exactly equal after an exact prefix
(`verdict.exact_prefix_end`: bit-equal in the same dtype): that stage is, the exact-prefix signal (a
bug however small), whatever later steps do; a KL gradient lost at step 1 grows into a drift of
step 2 that must not hide it. With a noise run, compare has already judged each stage
where the noise run was measured against its error there (beyond it: at least diverge), so the first
stage outside the ok band is the divergence and rounding the noise run shares is not a signal; a
stage where the noise run was not comparable is judged as without one.

A gradient finding names the role whose gradients changed: among the divergent gradient stages of
the first divergent step and rank, a role the reference holds no gradient for (all zeros: a frozen
snapshot) that the target gives one comes first (a target's total norm over every parameter differs
only because of it), and the sentence names the update it leads to (`update.<role>`). Per role (the suffix of `loss.<role>`, `grad.<role>.<group>`,
`grad_norm.<role>`, `update.<role>`), the first such stage of that role is reported too: an
unfrozen reference is named at `grad_norm.reference` (it gained a gradient), or as
`update.reference` changing where no side taps its gradient norm.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ffdebug import verdict as V
from ffdebug.results import StageResult

PHASE_RANK = {"eval": 0, "rollout": 1, "train": 2}
"""Within one optimizer step: the evaluation of the weights it starts from, its rollout, its training."""
ROLE_PREFIXES = ("loss.", "grad_norm.", "update.", "grad.")


def is_trainer_run(stages: list[StageResult]) -> bool:
    """Stages of a training run: tagged with `optimizer_step`."""
    return any("optimizer_step" in e.step for e in stages)


def step_of(e: StageResult) -> int:
    """The stage's optimizer step (-1 when untagged)."""
    value = e.step.get("optimizer_step")
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def _stage_rank(e: StageResult) -> int:
    key = e.key
    if e.phase == "rollout":
        return {"reward": 1, "advantage": 2}.get(key, 0)
    if key.startswith("update."):
        return 3
    if key.startswith(("grad.", "grad_norm.")):
        return 2
    return 1


def _capture_position(e: StageResult, index: int) -> tuple[int, int]:
    """Where the reference captured `e`: its record's sequence number (per rank), else its index."""
    return (0, e.seq) if e.seq is not None else (1, index)


def _place(e: StageResult) -> tuple[int, int, int]:
    return step_of(e), PHASE_RANK.get(e.phase or "", 2), _stage_rank(e)


def training_order(stages: list[StageResult]) -> list[StageResult]:
    """`stages` in training order (module docstring). Within one step, phase and rank, stages keep
    the order the reference captured them in, so a tap made after a forward comes after the
    forward's stages. A stage without an `optimizer_step` tag is placed where it was captured:
    right after the tagged stage captured before it (at the start when none was), never before step
    0 by default."""
    by_capture = sorted(range(len(stages)), key=lambda i: _capture_position(stages[i], i))
    place: dict[int, tuple[int, int, int]] = {}
    last = (0, -1, -1)  # before anything tagged: the start of step 0
    for i in by_capture:
        e = stages[i]
        if "optimizer_step" in e.step and step_of(e) >= 0:
            last = place[i] = _place(e)
        else:
            place[i] = last
    rank = {i: n for n, i in enumerate(by_capture)}
    order = sorted(range(len(stages)), key=lambda i: (place[i], rank[i]))
    return [stages[i] for i in order]


def role_of(key: str) -> str | None:
    """The role a stage belongs to: `loss.policy` -> policy, `grad.policy.attn` -> policy."""
    for prefix in ROLE_PREFIXES:
        if key.startswith(prefix):
            return key[len(prefix) :].split(".", 1)[0] or None
    return None


@dataclass
class TrainingFirst:
    """The first divergence in training order, whether it is the exact-prefix signal, and per role."""

    stage: StageResult
    exact_signal: bool
    per_role: dict[str, StageResult] = field(default_factory=dict)

    def sentence(self) -> str:
        e = self.stage
        how = f"{e.severity}"
        if self.exact_signal:
            how = "first stage not bit-equal after bit-equal ones"
        elif e.beyond_noise and e.noise_rel:
            how = f"{e.severity}: rel {e.rel:.3g}, {e.rel / e.noise_rel:.3g} x the noise run's"
        text = f"training order: first divergence at optimizer_step {e.step.get('optimizer_step')}, {e.key} ({how})"
        role = role_of(e.key)
        if role is not None and e.key.startswith(("grad.", "grad_norm.")):
            text += f", the gradient of update.{role}"
        if self.per_role:
            roles = "; ".join(
                f"{role}: {s.key} at optimizer_step {s.step.get('optimizer_step')}"
                for role, s in self.per_role.items()
            )
            text += f"; per role: {roles}"
        return text


def _exact_prefix_break(ordered: list[StageResult]) -> StageResult | None:
    """The exact-prefix rule in training order (`verdict.exact_prefix_end`): its own computation
    differs, a bug signal however small. Not where a noise run was measured at that stage
    (`--noise`): compare has judged it against the noise run's error, exact-prefix breaks included."""
    broken = V.exact_prefix_end(ordered)
    return None if broken is None or broken.noise_measured else broken


def _gains_a_gradient(e: StageResult) -> bool:
    """A gradient stage the reference holds all zeros for (a frozen role) and the target does not."""
    return (
        not e.ok
        and e.key.startswith(("grad.", "grad_norm."))
        and e.rel is None
        and e.norm_ratio is None
        and bool(e.max_abs)
    )


def _gradient_role(first: StageResult, ordered: list[StageResult]) -> StageResult:
    """`first`, or the divergent gradient stage of its step and rank whose role gained a gradient."""
    if not first.key.startswith(("grad.", "grad_norm.")):
        return first
    same = [e for e in ordered if step_of(e) == step_of(first) and _stage_rank(e) == _stage_rank(first)]
    return next((e for e in same if _gains_a_gradient(e)), first)


def locate(stages: list[StageResult]) -> TrainingFirst | None:
    """The first divergent stage in training order (module docstring), or None when all match."""
    ordered = training_order(stages)
    position = {id(e): i for i, e in enumerate(ordered)}
    first = next((e for e in ordered if not e.ok), None)
    broken = _exact_prefix_break(ordered)
    if broken is not None and (first is None or position[id(broken)] <= position[id(first)]):
        first, exact_signal = broken, True
    else:
        exact_signal = False
    if first is None:
        return None
    first = _gradient_role(first, ordered)  # the same step and rank: an exact-prefix break stays one
    located = TrainingFirst(first, exact_signal)
    for e in ordered:
        role = role_of(e.key)
        if role is None or role in located.per_role:
            continue
        if not e.ok or (exact_signal and e is first):
            located.per_role[role] = e
    return located
