"""Layer numbers in execution order for blocks from several lists (docs/dumping.md "Stage names by role").

A UNet registers its down blocks, then its up blocks, then its mid block, but runs down, mid, up.
When the blocks come from more than one list (or a lone block beside them) and carry no index
attribute of their own, their layer numbers are the order in which the root's first call entered
them. Until that call returns every capture is held; then the numbers are known and the held
captures are written, in order, under `L{NNN}` prefixes that follow execution. Blocks the first
call did not enter keep their registration order after the entered ones. Later calls are renamed
at once.
"""

from __future__ import annotations

import re

_PREFIX = re.compile(r"^L(\d+)\.")


def mixed_positional(blocks) -> bool:
    """Blocks from two or more containers, numbered by position (no index attribute of their own)."""
    containers = {b.path.rsplit(".", 1)[0] if "." in b.path else "" for b in blocks}
    return len(containers) > 1 and [b.layer for b in blocks] == list(range(len(blocks)))


class ExecutionOrder:
    """Renumbers blocks by first entry; holds captures of the first call until it is known."""

    def __init__(self, blocks) -> None:
        self.blocks = list(blocks)
        self.active = mixed_positional(self.blocks)
        self.mapping: dict[int, int] = {}
        self.entered: list[int] = []
        self._held: list = []

    @property
    def pending(self) -> bool:
        return self.active and not self.mapping

    def enter(self, layer: int) -> None:
        if self.pending and layer not in self.entered:
            self.entered.append(layer)

    def hold(self, replay) -> None:
        self._held.append(replay)

    def decide(self) -> list:
        """At the first root call's end: the numbering, and the held replays to run (in order)."""
        if not self.pending:
            return []
        rest = [b.layer for b in self.blocks if b.layer not in self.entered]
        self.mapping = {old: new for new, old in enumerate(self.entered + rest)}
        for b in self.blocks:
            b.layer = self.mapping[b.layer]
        held, self._held = self._held, []
        return held

    def rename(self, key: str, meta: dict) -> tuple[str, dict]:
        """`key` and `meta` with the old layer number replaced by the execution-order one."""
        if not self.mapping:
            return key, meta
        layer = meta.get("layer")
        if isinstance(layer, int) and layer in self.mapping:
            meta = dict(meta, layer=self.mapping[layer])
        key = self._renamed(key)
        extra = meta.get("extra")
        if isinstance(extra, dict) and isinstance(extra.get("inputs"), list):  # the keys a stage reads
            meta = dict(meta, extra=dict(extra, inputs=[self._renamed(k) for k in extra["inputs"]]))
        return key, meta

    def _renamed(self, key: str) -> str:
        m = _PREFIX.match(key)
        if m and int(m.group(1)) in self.mapping:
            return f"L{self.mapping[int(m.group(1))]:03d}.{key[m.end() :]}"
        return key
