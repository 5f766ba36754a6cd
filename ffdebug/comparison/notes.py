"""The sentences of a comparison: its result notes (warm-ups set aside, statistics-only stages,
stages a noise run was not comparable at, undeclared shards, byte budgets, unused stage-map rules, a diverged generation) and the one-line
errors when nothing could be compared."""

from __future__ import annotations

from dataclasses import dataclass, field

from ffdebug.comparison.noise import NOT_COMPARABLE
from ffdebug.comparison.pairing import Filters
from ffdebug.errors import FFDebugError
from ffdebug.io.record import Record
from ffdebug.io.side import SideStore
from ffdebug.results import StageResult


@dataclass
class UnitsRun:
    """What comparing the stage units gave: results, their record pairs, and shard readings."""

    stages: list[StageResult] = field(default_factory=list)
    records: list[tuple] = field(default_factory=list)
    readings: list[dict] = field(default_factory=list)


def result_notes(pairing, run: UnitsRun, stage_map, generation) -> list[str]:
    """The notes of a CompareResult, in their fixed order."""
    notes: list[str] = []
    if pairing.warmup_skipped:
        notes.append(f"{len(pairing.warmup_skipped)} warm-up call(s) on the target side were set aside")
    if pairing.warmup_skipped_ref:
        notes.append(
            f"{len(pairing.warmup_skipped_ref)} warm-up call(s) on the reference side were set aside"
        )
    if any(e.stats_only for e in run.stages):
        notes.append("some stages were dumped as statistics only and compared on their stats")
    noise_note = not_comparable_note(run.stages)
    if noise_note is not None:
        notes.append(noise_note)
    if any(r["matches"] and not r["declared"] for r in run.readings):
        notes.append(
            "some target stages are per-rank pieces of the reference's tensor (see shards); tag them "
            "with reduction='partial' or shard={dim,index,count} so they are folded automatically"
        )
    notes.extend(budget_notes(run.records))
    notes.extend(f"stage map rule {spec!r} renamed nothing on either side" for spec in stage_map.unused())
    if generation is not None:
        notes.append(f"{generation.sentence()}; calls from {generation.call} on were not compared")
    return notes


def not_comparable_note(stages: list[StageResult]) -> str | None:
    """The result's note naming the stages a noise run was given for but not comparable at."""
    keys = sorted({e.key for e in stages if e.noise_given and not e.noise_measured})
    if not keys:
        return None
    shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
    return f"{NOT_COMPARABLE} at {len(keys)} stage(s) ({shown}): judged without the noise run"


def excluded_sentences(exclude: tuple[str, ...]) -> list[str]:
    """`--exclude` as a selection sentence of the coverage (selected out, never silent)."""
    return [f"--exclude {' '.join(exclude)}"] if exclude else []


def nothing_paired(ref: SideStore, tgt: SideStore, pairing, filters: Filters) -> str:
    """The one-line error when no stage (besides input ids) is on both sides."""
    if filters.stages or filters.layers is not None:
        why = "no stage matches --stages / --layers on both sides"
    elif pairing.unpaired_ref or pairing.unpaired_target:
        tags = sorted({str(dict(g.tags)) for g in pairing.unpaired_ref})[:3]
        other = sorted({str(dict(g.tags)) for g in pairing.unpaired_target})[:3]
        why = f"the calls do not pair: reference step tags {', '.join(tags) or '-'} vs target {', '.join(other) or '-'}"
    else:
        why = "the two sides share no stage key"
    return (
        f"{ref.path} and {tgt.path}: nothing to compare ({why}); dump both sides with the same stages and "
        "ffdebug.step(...) tags, or loosen --stages / --layers / --step"
    )


def check_layer_selected(layers, store: SideStore) -> None:
    """`--layers` that names none of the dumped layers is a usage error, not a pass."""
    dumped = sorted({r.layer for r in store.records if r.layer is not None})
    if dumped:
        raise FFDebugError(
            f"--layers {layers.spec!r} selects none of the dumped layers ({dumped[0]}-{dumped[-1]} in "
            f"{store.path}); pick layers in that range"
        )


def budget_notes(pairs: list[tuple[Record, Record]]) -> list[str]:
    """Say which side's FFDEBUG_FWD_DUMP_MAX_BYTES budget turned stages into statistics-only ones."""
    notes = []
    for i, side in enumerate(("reference", "target")):
        n = sum(1 for pair in pairs if pair[i].over_budget)
        if n:
            notes.append(
                f"{n} stage(s) were over the {side}'s byte budget (FFDEBUG_FWD_DUMP_MAX_BYTES): "
                "only their statistics were written and compared"
            )
    return notes
