"""`SideStore`: every record of one side (a dump store, an imported dump or a tensor file)."""

from __future__ import annotations

import os
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
