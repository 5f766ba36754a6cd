"""`hunt(config)`: the rounds in order, the state saved after each, resumable
(docs/hunt.md "Hunt: from symptom to root cause")."""

from __future__ import annotations

import os
from collections.abc import Callable

from ffdebug.errors import FFDebugError
from ffdebug.hunt.rounds import (
    BudgetSpent,
    HuntConfig,
    round0_weights,
    round1_sketch,
    round2_full,
    round3,
)
from ffdebug.hunt.runner import command_text
from ffdebug.hunt.state import HuntState, Round, load_state

ROUNDS = ((0, round0_weights), (1, round1_sketch), (2, round2_full), (3, round3))


def _check_resumable(cfg: HuntConfig, state: HuntState, directory: str) -> None:
    """A resumed hunt must run the same commands as the rounds it keeps."""
    for r in state.rounds:
        if (r.command_ref, r.command_target) != (command_text(cfg.ref), command_text(cfg.target)):
            raise FFDebugError(
                f"{directory}/hunt.json: round {r.round} ran other commands ({r.command_ref!r}, "
                f"{r.command_target!r}); give the same --ref / --target, or start again without --resume"
            )


def hunt(
    cfg: HuntConfig,
    resume: bool = False,
    on_round: Callable[[Round, bool], None] | None = None,
    max_rounds: int | None = None,
) -> HuntState:
    """Run (or continue) the hunt; `on_round(round, resumed)` is called for every round, kept or
    run. `max_rounds` stops after that many rounds have been run in this call."""
    os.makedirs(cfg.dir, exist_ok=True)
    if resume:
        state = load_state(cfg.dir)
        _check_resumable(cfg, state, cfg.dir)
        state.budget_limit = cfg.budget  # a resumed hunt may raise (or lift) the budget
    else:
        if os.path.exists(os.path.join(cfg.dir, "hunt.json")):
            raise FFDebugError(
                f"{cfg.dir}/hunt.json: a hunt is already there; continue it with --resume or choose another --dir"
            )
        state = HuntState(budget_limit=cfg.budget)
    ran = 0
    for number, run in ROUNDS:
        kept = state.done(number)
        if kept is not None:
            if on_round:
                on_round(kept, True)
            continue
        if state.complete or (number == 0 and cfg.weights is None and not cfg.dump_weights):
            continue
        if max_rounds is not None and ran >= max_rounds:
            break
        if cfg.budget is not None and state.used >= cfg.budget:
            break
        try:
            done = run(cfg, state)
        except BudgetSpent as spent:
            state.notes.append(str(spent))
            break
        state.rounds.append(done)
        state.save(cfg.dir)
        ran += 1
        if on_round:
            on_round(done, False)
    state.save(cfg.dir)
    return state
