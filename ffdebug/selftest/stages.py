"""Where a planted change shows in the reference dump: the block stage that owns a module, the
block stage its output reaches first, the other outputs of a module of several (selftest planning)."""

from __future__ import annotations

import re
from dataclasses import dataclass

BLOCK_STAGE = re.compile(r"^L(\d{3})\.([a-z_]+)$")  # a block stage (attn_out), not a sub-stage
_CHILD_STAGE = re.compile(r"^L\d{3}\.(.+)\.out$")  # an unplaced child's output (`L000.norm1.out`)
_ROLE_PREFIXES = ("attn.", "mlp.", "moe.")  # role sub-stages, not children


def output_stage(key: str, children: bool) -> str | None:
    """The stage a record key names below its layer prefix: a block stage (`attn_out`) or, with
    `children`, an unplaced child's output (`norm1.out`; a role sub-stage is none); else None."""
    m = BLOCK_STAGE.match(key)
    if m:
        return m.group(2)
    child = _CHILD_STAGE.match(key) if children else None
    if child is None or child.group(1).startswith(_ROLE_PREFIXES):
        return None
    return child.group(1) + ".out"


@dataclass(frozen=True)
class Dumped:
    """What the reference dump says about one record: the part the planting reads."""

    key: str
    layer: int | None
    module_path: str | None
    extra: dict
    shape: tuple[int, ...] = ()


class DumpedStages:
    """The stages of one reference dump, by key and in execution order."""

    def __init__(self, records: list[Dumped]) -> None:
        self.records = records
        self.by_key = {r.key: r for r in records}

    def block_stage(self, layer: int, module_path: str | None) -> str | None:
        """The block stage (attn_out, ffn_out, ...) whose module holds `module_path` (an output
        stage: the block's `hidden_in` is what feeds the block, not what one of its modules made)."""
        found = self.owning_stage(layer, module_path, children=False)
        if found and found[0].startswith("hidden_out") and module_path is not None:
            return self._first_stage_after(layer, module_path) or found[0]
        return found[0] if found else None

    def _first_stage_after(self, layer: int, module_path: str) -> str | None:
        """When only the block itself holds `module_path` (zaya's `ffn_out` is a residual scale after
        the MLP, not the MLP), the block stage its output reaches first: the first block output stage
        recorded (execution order) after the module's own records."""
        mine = [
            i
            for i, r in enumerate(self.records)
            if r.layer == layer
            and r.module_path
            and (r.module_path == module_path or r.module_path.startswith(module_path + "."))
        ]
        for r in self.records[mine[-1] + 1 :] if mine else ():
            stage = output_stage(r.key, children=False) if r.layer == layer else None
            if stage is not None and not stage.endswith("_in"):
                return stage
        return None

    def owning_stage(
        self, layer: int, module_path: str | None, children: bool = True
    ) -> tuple[str, str] | None:
        """(stage, its module path) of the most specific output stage of `layer` whose module holds
        `module_path`: a block stage (`attn_out`) or, with `children`, an unplaced child's
        (`norm1.out`, `resnets.0.out`; never a role sub-stage such as `attn.q.out`); input stages
        (`hidden_in`, `encoder_hidden_in`) are what feeds a block, never what one of its modules made."""
        best = None
        for r in self.records:
            stage = output_stage(r.key, children)
            if r.layer != layer or stage is None or not r.module_path or module_path is None:
                continue
            if stage.endswith("_in"):
                continue
            if (module_path == r.module_path or module_path.startswith(r.module_path + ".")) and (
                best is None or len(r.module_path) > len(best[1])
            ):
                best = (stage, r.module_path)
        return best

    def streams(self, layer: int, stage: str | None) -> tuple[str, ...]:
        """When `stage` is one output of several (`attn_out`, `attn_out.1`: a dual-stream attention
        returning the image and the text stream), a module inside it may feed only a later one, which
        reaches the block's outputs without passing `stage`: those later outputs and the block's
        outputs (`hidden_out`, `hidden_out.1`, ...) hold too. Empty for a one-output stage."""
        if stage is None:
            return ()
        prefix = f"L{layer:03d}."
        own = self.by_key.get(prefix + stage)
        if own is None or not own.shape:
            return ()

        def stream(r: Dumped) -> bool:  # hidden states like its own: not attention probabilities
            tail = r.key[len(prefix) + len(stage) + 1 :]
            return tail.isdigit() and len(r.shape) == len(own.shape) and r.shape[-1:] == own.shape[-1:]

        later = [
            r.key[len(prefix) :] for r in self.records if r.key.startswith(f"{prefix}{stage}.") and stream(r)
        ]
        if not later:
            return ()
        outs = [
            r.key[len(prefix) :]
            for r in self.records
            if r.layer == layer and re.fullmatch(rf"{re.escape(prefix)}hidden_out(\.\d+)?", r.key)
        ]
        return tuple(dict.fromkeys(later + outs))

    def sub(self, layer: int, kind: str) -> Dumped | None:
        return self.by_key.get(f"L{layer:03d}.{kind}.out")
