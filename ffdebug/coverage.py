"""Coverage: what a comparison compared, and what it left out (docs/comparing.md "Coverage").

Every verdict carries one. A comparison whose coverage has anything in `missing` is *incomplete*:
exit 4 unless `--allow-partial`, even when every stage it did compare is ok. What blocks (each a
sentence in `missing`):

- a stage kind (a key without its `L{NNN}.` prefix) present on one side only; in stores without
  block stages (trainers, free taps) every key present on one side only; stages of a kind both
  sides have that one side dumped for fewer layers / invocations;
- a side without a clean finish (a rank without `status.json`, a manifest line cut short), or with
  captures over its byte budget; a rank that the world size promises but that wrote nothing;
- target ranks not compared;
- calls present on one side only (warm-up calls the target tagged or that look like one are set
  aside, not missing);
- final outputs (`final.logits` / `final.out`) dumped by neither side of a model dump, when no
  stage selection excluded them;
- stages compared on statistics only;
- dump selections (`FFDEBUG_FWD_DUMP_LAYERS` / `_STAGES` / `_CALLS` / `_RANKS`) that differ
  between the sides.

Reported, not blocking: `unified_shapes`, the stages whose shapes differed by size-1 dims only
and were compared on the reference's shape; `selected_out`: the same dump selection on both sides, and compare's own
`--layers` / `--stages` / `--step` / `--rank`. Formats that record no finish (imported dumps,
tensor files) have `finished: null`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ffdebug.io.side import SideStore

_LAYER_PREFIX = re.compile(r"^L\d+\.")
SELECTION_VARS = ("LAYERS", "STAGES", "CALLS", "RANKS")
_ATOM_SELECTION = {"LAYERS": "ATOM_FWD_DUMP_LAYERS", "CALLS": "ATOM_FWD_DUMP_ONE_SHOT"}


def is_final_output(key: str) -> bool:
    """The model's own output: `final.logits` or `final.out` (and the parts `final.out.N`), not
    the final norm or the top-k extras."""
    return key in ("final.logits", "final.out") or key.startswith("final.out.")


def kind_of(key: str) -> str:
    """A stage kind: the key without its `L{NNN}.` layer prefix."""
    return _LAYER_PREFIX.sub("", key, count=1)


@dataclass
class KindCount:
    """How many stages of one kind each side had, and how many were paired."""

    kind: str
    ref: int = 0
    target: int = 0
    paired: int = 0

    def to_json(self) -> dict:
        return {"kind": self.kind, "ref": self.ref, "target": self.target, "paired": self.paired}


@dataclass
class SideCoverage:
    """One side: did it finish cleanly, which ranks it has, captures over its byte budget."""

    finished: bool | None
    ranks: list[int]
    over_budget: int = 0
    expected_ranks: list[int] = field(default_factory=list)
    unfinished_ranks: list[int] = field(default_factory=list)
    cut_lines: int = 0
    problems: list[str] = field(default_factory=list)  # an imported dump's (`SideStore.problems`)

    @property
    def missing_ranks(self) -> list[int]:
        return [r for r in self.expected_ranks if r not in self.ranks]

    def to_json(self) -> dict:
        return {
            "finished": self.finished,
            "ranks": self.ranks,
            "over_budget": self.over_budget,
            "problems": self.problems,
        }


def side_coverage(store: SideStore) -> SideCoverage:
    """Finish, ranks and byte-budget overruns of one side, from its status files and records."""
    ranks = sorted({r.rank for r in store.records})
    sizes = {r.world_size for r in store.records if r.world_size}
    expected = list(range(max(sizes))) if sizes else []
    over = sum(1 for r in store.records if r.over_budget)
    problems = list(store.problems)
    if store.kind != "store" or store.run.get("imported"):
        # imported dumps and tensor files record no finish (docs/peer-dumps.md "Peer dumps")
        return SideCoverage(
            finished=None, ranks=ranks, over_budget=over, expected_ranks=expected, problems=problems
        )
    unfinished = [r for r in ranks if not _rank_finished(store, r)]
    over = max(
        over, sum(int(s.get("over_budget") or 0) for s in store.status.values() if isinstance(s, dict))
    )
    finished = not unfinished and not store.incomplete_lines and bool(ranks)
    return SideCoverage(
        finished=finished,
        ranks=ranks,
        over_budget=over,
        expected_ranks=expected,
        unfinished_ranks=unfinished,
        cut_lines=store.incomplete_lines,
        problems=problems,
    )


def _rank_finished(store: SideStore, rank: int) -> bool:
    status = store.status.get(f"rank{rank:03d}")
    return isinstance(status, dict) and status.get("complete") is True


def dump_selection(store: SideStore) -> dict[str, str]:
    """The dump-time stage selection recorded in run.json (`FFDEBUG_FWD_DUMP_*` or ATOM's)."""
    env = store.run.get("env") if isinstance(store.run.get("env"), dict) else {}
    out = {}
    for name in SELECTION_VARS:
        value = env.get(f"FFDEBUG_FWD_DUMP_{name}")
        if value is None and name in _ATOM_SELECTION and _ATOM_SELECTION[name] in env:
            value = f"{_ATOM_SELECTION[name]}={env[_ATOM_SELECTION[name]]}"
        if value not in (None, "", "all"):
            out[f"FFDEBUG_FWD_DUMP_{name}"] = str(value)
    return out


@dataclass
class Coverage:
    """What one comparison compared and what it left out; `missing` blocks exit 0."""

    paired: int = 0
    kinds: list[KindCount] = field(default_factory=list)
    only_ref: list[str] = field(default_factory=list)  # kinds
    only_target: list[str] = field(default_factory=list)
    final_compared: bool = False
    sides: dict[str, SideCoverage] = field(default_factory=dict)
    ranks_compared: list[int] = field(default_factory=list)
    ranks_missing: list[int] = field(default_factory=list)
    calls_only_ref: list[dict] = field(default_factory=list)
    calls_only_target: list[dict] = field(default_factory=list)
    stats_only: int = 0
    selected_out: list[str] = field(default_factory=list)
    unified_shapes: list[dict] = field(default_factory=list)  # {"key", "shape_ref", "shape_target"}
    missing: list[str] = field(default_factory=list)
    stages_only_ref: list[str] = field(default_factory=list)  # keys of paired calls' one-sided stages
    stages_only_target: list[str] = field(default_factory=list)  # (in `missing`; not a JSON key)
    keys_only_ref: list[str] = field(
        default_factory=list
    )  # every one-sided reference key (bisect's `missing_inside`)

    @property
    def complete(self) -> bool:
        return not self.missing

    def to_json(self) -> dict:
        return {
            "paired": self.paired,
            "kinds": [k.to_json() for k in self.kinds],
            "only_ref": self.only_ref,
            "only_target": self.only_target,
            "final_compared": self.final_compared,
            "sides": {name: s.to_json() for name, s in self.sides.items()},
            "ranks": {"compared": self.ranks_compared, "missing": self.ranks_missing},
            "calls": {"only_ref": self.calls_only_ref, "only_target": self.calls_only_target},
            "stats_only": self.stats_only,
            "selected_out": self.selected_out,
            "unified_shapes": self.unified_shapes,
            "missing": self.missing,
        }


def _names(items: list[str], limit: int = 8) -> str:
    """A list for a sentence: every item up to `limit`, then a count (JSON keeps them all)."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def side_sentences(label: str, side: SideCoverage) -> list[str]:
    """Blocking sentences about one side's own completeness."""
    out = []
    if side.finished is False:
        why = []
        if side.unfinished_ranks:
            why.append(f"rank(s) {_names([str(r) for r in side.unfinished_ranks])} wrote no status.json")
        if side.cut_lines:
            why.append(f"{side.cut_lines} manifest line(s) cut short")
        out.append(f"the {label} side did not finish cleanly ({'; '.join(why) or 'no rank finished'})")
    if side.missing_ranks:
        ranks = _names([str(r) for r in side.missing_ranks])
        out.append(f"{label} rank(s) {ranks} wrote nothing (world size {max(side.expected_ranks) + 1})")
    out.extend(f"the {label} side: {p}" for p in side.problems)
    if side.over_budget:
        out.append(
            f"{side.over_budget} capture(s) of the {label} side were over its byte budget "
            "(FFDEBUG_FWD_DUMP_MAX_BYTES): only their statistics were written"
        )
    return out


def selection_sentences(ref: SideStore, target: SideStore) -> tuple[list[str], list[str]]:
    """(selected_out, missing) from the dump selections both sides recorded."""
    a, b = dump_selection(ref), dump_selection(target)
    if a == b:
        return ([f"both sides dumped with {k}={v}" for k, v in a.items()], [])
    diffs = [
        f"{k}: ref {a.get(k, 'all')!s} vs target {b.get(k, 'all')!s}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
    ]
    return ([], [f"the sides were dumped with different selections ({'; '.join(diffs)})"])


def filter_sentences(layers, stages, step, rank) -> list[str]:
    """compare's own selection, reported (never blocking)."""
    out = []
    if layers is not None:
        out.append(f"--layers {getattr(layers, 'spec', layers)}")
    if stages:
        out.append(f"--stages {' '.join(stages)}")
    if step:
        out.append("--step " + " ".join(f"{k}={v}" for k, v in step.items()))
    if rank is not None:
        out.append(f"--rank {rank}")
    return out


@dataclass
class CoverageInput:
    """What a comparison paired and left over, handed to `assess`."""

    pairs: list  # (ref CallGroup, target CallGroup)
    results: list  # StageResult
    only_ref: list  # Record: stages of paired calls without a counterpart
    only_target: list
    unpaired_ref: list  # CallGroup: calls without a counterpart (warm-up set aside already)
    unpaired_target: list
    compared_ranks: set[int]
    filters: list[str]  # compare's own selection, as sentences
    stage_filter: bool = False
    rank_filter: int | None = None
    aliases: dict = field(default_factory=dict)  # (target key, invocation) -> the ref keys it paired as


def _kind_counts(inp: CoverageInput) -> list[KindCount]:
    counts: dict[str, KindCount] = {}

    def count(key: str, attr: str, n: int = 1) -> None:
        k = counts.setdefault(kind_of(key), KindCount(kind_of(key)))
        setattr(k, attr, getattr(k, attr) + n)

    by_key = {k: v for (k, _), v in inp.aliases.items()}  # a record's repeats share its alias
    for rg, tg in inp.pairs:
        for group, attr in ((rg, "ref"), (tg, "target")):
            for key, inv in {(sk[0], sk[1]) for sk in group.order}:
                if attr == "ref":
                    count(key, attr)
                    continue
                for alias in inp.aliases.get((key, inv), by_key.get(key, [key])):  # a fused one: each
                    count(alias, attr)
    paired = {
        (e.key, str(e.invocation), e.call, tuple(sorted((str(k), str(v)) for k, v in e.step.items())))
        for e in inp.results
    }
    for key, *_ in paired:
        count(key, "paired")
    return sorted(counts.values(), key=lambda k: k.kind)


def assess(ref: SideStore, target: SideStore, inp: CoverageInput) -> Coverage:
    """The coverage of one comparison: what was compared and every reason it is incomplete."""
    cov = Coverage(paired=len(inp.results))
    cov.kinds = _kind_counts(inp)
    cov.only_ref = [k.kind for k in cov.kinds if k.ref and not k.target]
    cov.only_target = [k.kind for k in cov.kinds if k.target and not k.ref]
    excused, excused_kinds = _form_excuses(ref, target, cov)
    cov.final_compared = any(is_final_output(e.key) for e in inp.results)
    cov.sides = {"ref": side_coverage(ref), "target": side_coverage(target)}
    cov.stats_only = sum(1 for e in inp.results if e.stats_only)
    cov.unified_shapes = [
        {"key": e.key, "shape_ref": e.ref.shape, "shape_target": e.target.shape}
        for e in inp.results
        if e.unified_shape
    ]
    cov.calls_only_ref = [{"call": g.call, "step": dict(g.tags)} for g in inp.unpaired_ref]
    cov.calls_only_target = [{"call": g.call, "step": dict(g.tags)} for g in inp.unpaired_target]
    selected, differing = selection_sentences(ref, target)
    cov.selected_out = selected + inp.filters + _unplaced_sentences(ref, target) + excused
    if cov.unified_shapes:
        shown = [
            f"{u['key']} (ref {u['shape_ref']} vs target {u['shape_target']})" for u in cov.unified_shapes
        ]
        cov.selected_out.append(
            f"shapes unified (size-1 dims, or a token's features grouped otherwise): {_names(shown, 4)}"
        )
    missing: list[str] = []
    for label, side in (("reference", cov.sides["ref"]), ("target", cov.sides["target"])):
        missing.extend(side_sentences(label, side))
    missing.extend(differing)
    if cov.only_ref:
        missing.append(f"stage kinds dumped by the reference only: {_names(cov.only_ref)}")
    if cov.only_target:
        missing.append(f"stage kinds dumped by the target only: {_names(cov.only_target)}")
    one_sided_kinds = set(cov.only_ref) | set(cov.only_target) | excused_kinds
    cov.keys_only_ref = [
        k for k in dict.fromkeys(r.key for r in inp.only_ref) if kind_of(k) not in excused_kinds
    ]
    for label, records in (("reference", inp.only_ref), ("target", inp.only_target)):
        extra = sorted({r.key for r in records if kind_of(r.key) not in one_sided_kinds})
        setattr(cov, "stages_only_ref" if label == "reference" else "stages_only_target", extra)
        if extra:
            missing.append(f"{len(extra)} stage(s) dumped by the {label} only: {_names(extra)}")
    _ranks(cov, target, inp, missing)
    if cov.calls_only_ref:
        missing.append(
            f"{len(cov.calls_only_ref)} reference call(s) have no target counterpart: {_calls(cov.calls_only_ref)}"
        )
    if cov.calls_only_target:
        missing.append(
            f"{len(cov.calls_only_target)} target call(s) have no reference counterpart: {_calls(cov.calls_only_target)}"
        )
    if _needs_final(ref, target, inp) and not any(is_final_output(k.kind) for k in cov.kinds):
        missing.append(
            "final outputs (final.logits / final.out) were dumped by neither side: the model's output "
            "was never compared"
        )
    if cov.stats_only:
        missing.append(
            f"{cov.stats_only} stage(s) compared on statistics only (a rotation or permutation is "
            "invisible there): dump with FFDEBUG_FWD_DUMP_MODE=full"
        )
    cov.missing = missing
    return cov


def _form_excuses(ref: SideStore, target: SideStore, cov: Coverage) -> tuple[list[str], set[str]]:
    """Kinds one side holds or lacks because of a branch form it declared in run.json's
    `form_stages` (an absorbed MLA attention: `models/mla_roles.py`): taken off `only_ref` /
    `only_target` and said as one sentence per form; returns the sentences and those kinds."""
    out: list[str] = []
    kinds: set[str] = set()
    for label, store, other_only, own_only in (
        ("reference", ref, "only_target", "only_ref"),
        ("target", target, "only_ref", "only_target"),
    ):
        forms = store.run.get("form_stages")
        if not isinstance(forms, dict):
            continue
        for branch, form in sorted(forms.items()):
            if not isinstance(form, dict):
                continue
            lacks = {k for k in form.get("lacks", []) if k in getattr(cov, other_only)}
            adds = {k for k in form.get("adds", []) if k in getattr(cov, own_only)}
            if not lacks and not adds:
                continue
            kinds |= lacks | adds
            setattr(cov, other_only, [k for k in getattr(cov, other_only) if k not in lacks])
            setattr(cov, own_only, [k for k in getattr(cov, own_only) if k not in adds])
            out.append(
                f"{label}: {branch} is an {form.get('form')}: it holds {_names(sorted(adds)) or 'nothing more'} "
                f'instead of {_names(sorted(lacks)) or "nothing"} (docs/dumping.md "Role sub-stages")'
            )
    return out, kinds


def _unplaced_sentences(ref: SideStore, target: SideStore) -> list[str]:
    """Block children that role detection could not name on a side (dumped by attribute name)."""
    out = []
    for label, store in (("reference", ref), ("target", target)):
        unplaced = store.run.get("unplaced_stages")
        if isinstance(unplaced, dict):
            for cls, children in sorted(unplaced.items()):
                names = ", ".join(str(c) for c in children) if isinstance(children, list) else str(children)
                out.append(f"{label}: {cls} children without a role, dumped by attribute name: {names}")
        whole = store.run.get("compared_whole")
        if isinstance(whole, dict):
            for branch, why in sorted(whole.items()):
                out.append(f"{label}: {branch} is {why}")
    return out


def _calls(calls: list[dict]) -> str:
    return _names([f"call {c['call']}" + (f" {c['step']}" if c["step"] else "") for c in calls], 4)


def _ranks(cov: Coverage, target: SideStore, inp: CoverageInput, missing: list[str]) -> None:
    present = {r.rank for r in target.records}
    if inp.rank_filter is not None:
        present = {inp.rank_filter} & present
    cov.ranks_compared = sorted(inp.compared_ranks & present)
    not_compared = sorted(present - inp.compared_ranks)
    cov.ranks_missing = sorted(set(not_compared) | set(cov.sides["target"].missing_ranks))
    if not_compared:
        missing.append(f"target rank(s) {_names([str(r) for r in not_compared])} were not compared")
    if inp.rank_filter is not None:
        others = sorted({r.rank for r in target.records} - {inp.rank_filter})
        if others:
            cov.selected_out.append(f"target rank(s) {_names([str(r) for r in others])} left out by --rank")


def _needs_final(ref: SideStore, target: SideStore, inp: CoverageInput) -> bool:
    """A model dump (block stages captured by ffdebug's module hooks, not free taps) whose final
    outputs no selection excluded."""
    if inp.stage_filter or any("FFDEBUG_FWD_DUMP_STAGES" in dump_selection(s) for s in (ref, target)):
        return False
    return any(
        rec.layer is not None and rec.module_path is not None
        for pair in inp.pairs
        for group in pair
        for rec in group.records.values()
    )
