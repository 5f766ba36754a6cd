"""The state of one hunt, written to `D/hunt.json` after every round so that `hunt --resume`
continues without redoing finished rounds (docs/hunt.md "Hunt: from symptom to root cause").

JSON: `{"rounds": [{"round", "env", "command_ref", "command_target", "bytes", "decision",
"evidence"}], "layer", "layer_class", "sub_stage", "local", "budget": {"limit", "used"},
"complete"}`. `env` holds, per side, the `FFDEBUG_*` variables the round set; with the command it
reproduces the round (`reproduce`).
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field

from ffdebug.errors import FFDebugError

STATE_FILE = "hunt.json"


@dataclass
class Round:
    """One finished round: what ran, what it wrote, what it decided and why."""

    round: int
    env: dict[str, dict[str, str]]  # side -> FFDEBUG_* variables set for that side's command
    command_ref: str
    command_target: str
    bytes: int  # bytes written under the round's directory (every side)
    decision: str
    evidence: list[str] = field(default_factory=list)

    def reproduce(self, side: str, noise_command: str | None = None) -> str:
        """The shell line that re-runs this round's `side` command (the noise side's command is
        the hunt's `--noise`, not kept in the round)."""
        commands = {"ref": self.command_ref, "target": self.command_target}
        command = commands.get(side, noise_command or "<the --noise command>")
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.get(side, {}).items()))
        return f"{env} {command}".strip()

    def to_json(self) -> dict:
        return {
            "round": self.round,
            "env": self.env,
            "command_ref": self.command_ref,
            "command_target": self.command_target,
            "bytes": self.bytes,
            "decision": self.decision,
            "evidence": list(self.evidence),
        }

    @classmethod
    def from_json(cls, obj: dict, where: str) -> Round:
        try:
            return cls(
                round=int(obj["round"]),
                env={str(s): {str(k): str(v) for k, v in e.items()} for s, e in obj["env"].items()},
                command_ref=str(obj["command_ref"]),
                command_target=str(obj["command_target"]),
                bytes=int(obj["bytes"]),
                decision=str(obj["decision"]),
                evidence=[str(x) for x in obj["evidence"]],
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise FFDebugError(
                f"{where}: a round is malformed ({err}); start again without --resume"
            ) from None


@dataclass
class HuntState:
    """Every round so far and the conclusion they reached."""

    rounds: list[Round] = field(default_factory=list)
    layer: int | None = None
    layer_class: str | None = None
    sub_stage: str | None = None
    local: bool | None = None
    budget_limit: int | None = None
    complete: bool = False
    notes: list[str] = field(default_factory=list)  # this run's stops (budget), printed, not saved

    @property
    def used(self) -> int:
        return sum(r.bytes for r in self.rounds)

    def done(self, number: int) -> Round | None:
        return next((r for r in self.rounds if r.round == number), None)

    def to_json(self) -> dict:
        return {
            "rounds": [r.to_json() for r in self.rounds],
            "layer": self.layer,
            "layer_class": self.layer_class,
            "sub_stage": self.sub_stage,
            "local": self.local,
            "budget": {"limit": self.budget_limit, "used": self.used},
            "complete": self.complete,
        }

    def save(self, directory: str) -> None:
        from ffdebug.store.writer import atomic_write_json

        atomic_write_json(os.path.join(directory, STATE_FILE), self.to_json())


def load_state(directory: str) -> HuntState:
    """The state `hunt --resume` continues from (one line, exit 2, when it is missing or bad)."""
    path = os.path.join(directory, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except FileNotFoundError:
        raise FFDebugError(f"{path}: no hunt to resume; run ffdebug hunt without --resume first") from None
    except (OSError, ValueError) as err:
        raise FFDebugError(f"{path}: unreadable ({err}); start again without --resume") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("rounds"), list):
        raise FFDebugError(f"{path}: not a hunt state (no 'rounds' list); start again without --resume")
    budget = obj.get("budget") if isinstance(obj.get("budget"), dict) else {}
    return HuntState(
        rounds=[Round.from_json(r, path) for r in obj["rounds"] if isinstance(r, dict)],
        layer=obj.get("layer"),
        layer_class=obj.get("layer_class"),
        sub_stage=obj.get("sub_stage"),
        local=obj.get("local"),
        budget_limit=budget.get("limit"),
        complete=bool(obj.get("complete")),
    )
