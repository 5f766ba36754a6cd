"""Training-order bisect of trainer stores: the first divergent stage of the first divergent
optimizer step, in the order training computes them (docs/trainer-taps.md "Bisecting a trainer").

A trainer store's stages carry an `optimizer_step` tag. Their paired calls are grouped by phase
(`engine._by_call`), but the call order of a store is not the training order: the taps of one
optimizer step that share their tags (`train.order`, `grad_norm.<role>`, `update.<role>`) form one
call that starts before the step's forwards. So the stages are ordered here as training computes
them:

    optimizer step → phase (rollout, then train) → rollout → reward → advantage
                   → train forwards and losses (in capture order) → gradients → updates

and the first stage outside the ok band is the first divergence; when every stage is inside the
band, the first stage that is not exactly equal after an exact prefix is (`verdict.exact_prefix_end`:
bit-equal in the same dtype). Either way, a first divergence that ends the exact prefix is the
exact-prefix signal (a bug however small). With a noise run, compare has already judged each stage
where the noise run was measured against its error there (beyond it: at least diverge), so the first
stage outside the ok band is the divergence and rounding the noise run shares is not a signal; a
stage where the noise run was not comparable is judged as without one. Per role (the suffix of `loss.<role>`, `grad.<role>.<group>`,
`grad_norm.<role>`, `update.<role>`), the first such stage of that role is reported too: an
unfrozen reference is named as `update.reference` changing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ffdebug import verdict as V
from ffdebug.results import StageResult

PHASE_RANK = {"rollout": 0, "train": 1}
ROLE_PREFIXES = ("loss.", "grad_norm.", "update.", "grad.")


def is_trainer_run(stages: list[StageResult]) -> bool:
    """Stages of a training run: tagged with `optimizer_step`."""
    return any("optimizer_step" in e.step for e in stages)


def _step(e: StageResult) -> int:
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


def training_order(stages: list[StageResult]) -> list[StageResult]:
    """`stages` in training order (module docstring); ties keep their order in `stages`."""
    indexed = list(enumerate(stages))
    indexed.sort(key=lambda p: (_step(p[1]), PHASE_RANK.get(p[1].phase or "", 2), _stage_rank(p[1]), p[0]))
    return [e for _, e in indexed]


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


def locate(stages: list[StageResult]) -> TrainingFirst | None:
    """The first divergent stage in training order (module docstring), or None when all match."""
    ordered = training_order(stages)
    first = next((e for e in ordered if not e.ok), None)
    broken = _exact_prefix_break(ordered)
    exact_signal = broken is not None and (first is None or first is broken)
    first = first or broken
    if first is None:
        return None
    located = TrainingFirst(first, exact_signal)
    for e in ordered:
        role = role_of(e.key)
        if role is None or role in located.per_role:
            continue
        if not e.ok or (exact_signal and e is first):
            located.per_role[role] = e
    return located
