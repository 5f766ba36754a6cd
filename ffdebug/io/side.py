"""`SideStore`: every record of one side (a dump store, an imported dump or a tensor file)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ffdebug.io.record import Record


@dataclass
class SideStore:
    """All records of one side, in capture order per rank."""

    path: str
    records: list[Record]
    run: dict = field(default_factory=dict)
    status: dict = field(default_factory=dict)  # rank -> status.json (absent for killed runs)
    kind: str = "store"  # store | atom | safetensors | a checkpoint kind
    incomplete_lines: int = 0
    # what an importer could not take in as it is (files refused by a weights-only load, a gap in
    # SGLang's dump_index, replicas that differ, dims that do not fit): each blocks exit 0
    problems: list[str] = field(default_factory=list)

    @property
    def side(self) -> str:
        return self.run.get("side") or os.path.basename(os.path.normpath(self.path))

    def keys(self) -> list[str]:
        return [r.key for r in self.records]

    def inputs_of(self, record: Record) -> list[Record]:
        """The records holding what `record`'s stage read, in argument order (docs/dumping.md "Role
        sub-stages", inputs): the keys its `extra["inputs"]` names (role sub-stages), else
        `<stage>.in`, `<stage>.in.1`, ... for a `<stage>.out` key (module-path sub-stages), else
        the block's `L{NNN}.hidden_in` for a block stage; from the same rank, call, invocation
        and step. Raises FFDebugError naming an input the side does not hold."""
        from ffdebug.errors import FFDebugError

        def same_call(r: Record) -> bool:
            return (r.rank, r.call, r.invocation, r.step) == (
                record.rank, record.call, record.invocation, record.step
            )  # fmt: skip

        held = {r.key: r for r in self.records if same_call(r)}
        keys = list(record.extra.get("inputs") or ())
        stage = re.match(r"^(.+)\.out$", record.key)
        layer = re.match(r"^(L\d+)\.", record.key)
        if not keys and stage:
            base = f"{stage.group(1)}.in"
            more = sorted(
                (k for k in held if re.fullmatch(re.escape(base) + r"\.\d+", k)),
                key=lambda k: int(k.rsplit(".", 1)[1]),
            )
            keys = [base, *more]
        elif not keys and layer:
            keys = [f"{layer.group(1)}.hidden_in"]
        missing = [k for k in keys if k not in held]
        if missing or not keys:
            raise FFDebugError(
                f"{self.path}: no input record {', '.join(missing) or '(none named)'} for {record.key} "
                f"(call {record.call}, invocation {record.invocation}); dump with full sub-stages "
                "(FFDEBUG_FWD_DUMP_SUBSTAGES=1) to record stage inputs"
            )
        return [held[k] for k in keys]
