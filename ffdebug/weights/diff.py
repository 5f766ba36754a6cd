"""`weights_diff(a, b)`: schema first (names, shapes, dtypes, rename suggestions), then float64
numerics per tensor, one tensor pair in memory at a time (docs/weights-diff.md).

`WeightsDiff` runs the pipeline; each step is its own module:

| step | module |
|------|--------|
| names mapped, `--skip` / `--layers`, a layer-selected dump, ranks, TP merge | `weights.plan` |
| stacked experts, `--fuse`, fp8 scales | `weights.layout` |
| schema lists and rename suggestions | `weights.schema_diff` |
| what the names left unpaired, by content | `weights.by_content` |
| loading (merged, dequantised, transformed; views of one stored tensor) | `weights.loading` |
| the finding of one pair (first-match rules, docs/weights-diff.md "Weights first") | `weights.findings` |
| swapped / permuted / not loaded | `weights.explain` |
"""

from __future__ import annotations

from ffdebug import verdict as V
from ffdebug.comparison.forked import ForkPool, fork_usable
from ffdebug.errors import FFDebugError
from ffdebug.progress_hook import ProgressHook
from ffdebug.results import TensorDiff, WeightsDiffResult
from ffdebug.verdict import Severity
from ffdebug.weights import plan
from ffdebug.weights.by_content import pair_by_content
from ffdebug.weights.explain import InitTensors, explain
from ffdebug.weights.findings import FINDINGS, LOADED, compare_pair  # noqa: F401 (the public names)
from ffdebug.weights.layout import Sides, attach_scales, auto_stack, fuse, stack
from ffdebug.weights.loading import TensorLoader
from ffdebug.weights.names import (
    FuseRule,
    NameMap,
    StackRule,
    build_name_map,
    parse_fuse,
    parse_stack,
    unused_rules,
)
from ffdebug.weights.numerics import bytes_equal  # noqa: F401 (the public name)
from ffdebug.weights.schema import apply_hint
from ffdebug.weights.schema_diff import Schema, schema_of, shape_after
from ffdebug.weights.sources import WeightSource, open_source
from ffdebug.weights.tp import Logical
from ffdebug.weights.transforms import parse_transform

WORKER_BUDGET_BYTES = 512 << 20  # stored bytes the workers hold at once (peak RSS < 1 GiB at 2 x 2 GiB)

STABLE_KEYS = (
    "verdict",
    "only_ref",
    "only_target",
    "shape_mismatch",
    "dtype_mismatch",
    "renames",
    "tensors",
)


def _check_choice(flag: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise FFDebugError(f"{flag} {value!r} is invalid: use {', '.join(choices[:-1])} or {choices[-1]}")
    return value


def _check_tp_merge(value):
    if value is None or value == "auto":
        return "auto"
    if isinstance(value, int):
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        raise FFDebugError(f"--tp-merge {value!r} is invalid: use auto or a dim number, e.g. 0") from None


def _rules(values, parse, kind) -> tuple:
    if isinstance(values, (str, kind)):
        values = (values,)
    return tuple(parse(v) if isinstance(v, str) else v for v in values or ())


class WeightsDiff:
    """A prepared diff: the schema is known after construction; `run()` does the numerics."""

    def __init__(
        self,
        a,
        b,
        *,
        strip_prefix=(),
        add_prefix: str | None = None,
        maps=(),
        alias_file: str | None = None,
        fuse=(),
        stack=(),
        auto_stack: bool = False,
        skip=(),
        layers=None,
        transforms=(),
        dequant: str = "auto",
        tp_merge="auto",
        thresholds=(),
        fail_on: Severity | str = Severity.DIVERGE,
        allow_dtype: bool = False,
        match_content: str = "auto",
        init=None,
        init_side: str = "target",
        workers: int | None = None,
    ) -> None:
        from ffdebug._env import parse_layers

        if workers is not None and (type(workers) is not int or workers < 1):
            raise FFDebugError(f"--workers {workers!r}: give a whole number of at least 1")
        self.workers = workers
        self.match_content = _check_choice("--match-content", match_content, ("auto", "off"))
        self.init_side = _check_choice("init_side", init_side, ("ref", "target"))
        self.dequant = _check_choice("--dequant", dequant, ("auto", "always", "none"))
        self.tp_merge = _check_tp_merge(tp_merge)
        self.fail_on = V.parse_fail_on(fail_on)
        self.allow_dtype = allow_dtype
        self.thresholds = tuple(V.parse_threshold(t) if isinstance(t, str) else t for t in thresholds or ())
        self.transforms = tuple(parse_transform(t) for t in transforms or ())
        self.fuse_rules = _rules(fuse, parse_fuse, FuseRule)
        self.stack_rules = _rules(stack, parse_stack, StackRule)
        self.skip = (skip,) if isinstance(skip, str) else tuple(skip or ())
        self.layers = parse_layers(layers) if isinstance(layers, (str, type(None))) else layers
        self.tgt_map = build_name_map(strip_prefix, add_prefix, maps, alias_file)
        self.ref_map = NameMap(strip_prefix=self.tgt_map.strip_prefix)
        self.ref_src = open_source(a, "reference")
        self.tgt_src = open_source(b, "target")
        self.init = InitTensors(open_source(init, "--init") if init is not None else None)
        self.loader = TensorLoader(self.transforms)
        self.notes: list[str] = []
        self.warnings = unused_rules(self.tgt_map, [e.key for e in self.tgt_src.entries], "target")
        self.content = None
        sides = self._layout(*self._groups(), auto_stack)
        self.ref, self.tgt = sides.ref, sides.tgt
        schema = self._schema()
        if self.match_content == "auto" and schema.only_ref and schema.only_target:
            schema = self._pair_by_content(schema)
        self._set_schema(schema)

    def ref_name(self, source_name: str) -> str:
        """The name a reference-side tensor is compared under."""
        return self.ref_map.apply(source_name)

    # -- planning -------------------------------------------------------------------------------

    def _groups(self) -> tuple[plan.Groups, plan.Groups]:
        """Both sides' pieces by name: mapped, filtered, restricted to a dump's layers, per rank."""
        ref = plan.group(self.ref_src, self.ref_map, "reference")
        tgt = plan.group(self.tgt_src, self.tgt_map, "target")
        num_layers = plan.layer_count(ref, tgt)
        ref, skipped_ref = plan.filter_groups(ref, self.skip, self.layers, num_layers)
        tgt, skipped_tgt = plan.filter_groups(tgt, self.skip, self.layers, num_layers)
        self.skipped = skipped_ref + skipped_tgt
        self.restricted: list[dict] = []
        for side, dump in (("reference", self.tgt_src), ("target", self.ref_src)):
            r = plan.restrict_to_dump(ref if side == "reference" else tgt, side, dump, num_layers)
            self.notes += [r.note] if r.note else []
            self.restricted += [r.restricted] if r.restricted else []
            ref, tgt = (r.groups, tgt) if side == "reference" else (ref, r.groups)
        rw, tw = self.ref_src.world_size, self.tgt_src.world_size
        if rw > 1 and rw == tw and self.tp_merge == "auto":
            self.notes.append(f"both sides have {rw} ranks: rank r compared with rank r (name@rankR)")
            return plan.split_ranks(ref), plan.split_ranks(tgt)
        return ref, tgt

    def _layout(self, ref_groups: plan.Groups, tgt_groups: plan.Groups, auto: bool) -> Sides:
        """Logical tensors, then stacked experts, fp8 scales and fused tensors (in that order)."""
        ref, ref_notes = plan.logicals(ref_groups, tgt_groups, self.tp_merge)
        tgt, tgt_notes = plan.logicals(tgt_groups, ref_groups, self.tp_merge)
        self.notes += ref_notes + tgt_notes
        sides = stack(Sides(ref, tgt), self.stack_rules, self.loader)
        self.notes += sides.notes
        if auto:
            sides = auto_stack(sides, self.loader)
            self.notes += sides.notes
        scaled = attach_scales(sides, self.dequant)
        self.notes += scaled.notes
        self.dequantized = scaled.dequantized
        self.loader.cast = {(d["name"], d["side"]) for d in self.dequantized}
        fused = fuse(scaled, self.fuse_rules, self.loader)
        self.notes += fused.notes
        return fused

    def _schema(self) -> Schema:
        return schema_of(self.ref, self.tgt, self.ref_src, self.tgt_src, self.transforms, self.dequantized)

    def _set_schema(self, schema: Schema) -> None:
        self.notes += schema.notes
        self.only_ref, self.only_target, self.common = schema.only_ref, schema.only_target, schema.common
        self.shape_mismatch, self.dtype_mismatch = schema.shape_mismatch, schema.dtype_mismatch
        self.buffers_not_in_checkpoint, self.renames = schema.buffers_not_in_checkpoint, schema.renames

    def _pair_by_content(self, by_name: Schema) -> Schema:
        """Relate what the names left unpaired and redo the schema: rename / fuse / stack
        suggestions are made for what content matching left unpaired only (what it related is
        in `content.rules`, the map it applied)."""
        related = pair_by_content(
            Sides(self.ref, self.tgt), by_name.only_ref, by_name.only_target, self.loader
        )
        self.ref, self.tgt, self.content = related.ref, related.tgt, related.plan
        self.notes += related.notes
        return self._schema()

    # -- results --------------------------------------------------------------------------------

    def _side_info(self, src: WeightSource, logicals: dict) -> dict:
        return {"path": src.path, "kind": src.kind, "world_size": src.world_size, "tensors": len(logicals)}

    def result(
        self, tensors: list[TensorDiff] | None = None, replica: list[dict] | None = None
    ) -> WeightsDiffResult:
        schema_only = tensors is None
        tensors = tensors or []
        return WeightsDiffResult(
            verdict=V.worst(*(t.severity for t in tensors)),
            only_ref=list(self.only_ref),
            only_target=list(self.only_target),
            shape_mismatch=list(self.shape_mismatch),
            dtype_mismatch=list(self.dtype_mismatch),
            renames=list(self.renames),
            tensors=tensors,
            ref=self._side_info(self.ref_src, self.ref),
            target=self._side_info(self.tgt_src, self.tgt),
            fail_on=self.fail_on,
            allow_dtype=self.allow_dtype,
            schema_only=schema_only,
            skipped=list(self.skipped),
            dequantized=list(self.dequantized),
            replica_mismatch=list(replica or []),
            notes=list(self.notes),
            buffers_not_in_checkpoint=list(self.buffers_not_in_checkpoint),
            restricted=list(self.restricted),
            apply=apply_hint(self.renames) if self.renames else None,
            content=self.content.to_json() if self.content is not None else None,
            warnings=list(self.warnings),
        )

    def schema_result(self) -> WeightsDiffResult:
        return self.result()

    def load(self, t: Logical, side: str):
        """One logical tensor as compared (merged, dequantised, transformed)."""
        return self.loader.load(t, side)

    # -- numerics -------------------------------------------------------------------------------

    def run(self, on_tensor=None, progress: ProgressHook | None = None) -> WeightsDiffResult:
        """Numerics for every paired tensor, one pair in memory at a time per worker; `progress`
        hears the number of pairs and their stored bytes, then each pair as it is done.

        Workers are forked processes, as compare's (`workers`, else one per free core from 64 MiB
        of tensors on; `ffdebug.comparison.forked`); the result is the same at any worker count.
        Each worker's chunk loops run on one BLAS thread: the CLI sets `OPENBLAS_NUM_THREADS=1`
        (`ffdebug._chunks`), as a busy core made a thread team's spin-waits slow a 2 × 2 GiB diff
        8× on a 2-core machine.
        """
        try:
            return self._run(on_tensor, progress)
        finally:
            self.loader.release()

    def order(self) -> list[str]:
        """Common names in reference order, except that the parts cut from one stacked tensor are
        compared one after the other (the stacked tensor is in memory once)."""
        first: dict = {}
        keyed = []
        for i, n in enumerate(self.common):
            r, t = self.ref[n], self.tgt[n]
            if r.stacked_from:
                key = ("ref", r.stacked_from)
            elif t.stacked_from:
                key = ("target", t.stacked_from)
            else:
                key = n
            keyed.append((first.setdefault(key, i), i, n))
        return [n for *_, n in sorted(keyed)]

    def _comparable(self, name: str, r: Logical, t: Logical) -> bool:
        """Equal shapes after the built-in transforms, or a 2-D transpose (unknown: try it)."""
        rs = shape_after(self.transforms, "ref", name, r.shape)
        ts = shape_after(self.transforms, "target", name, t.shape)
        if rs is None or ts is None or rs == ts:
            return True
        return len(rs) == 2 and ts == rs[::-1]

    def _compare(self, name: str, r: Logical, t: Logical) -> TensorDiff | None:
        cast = any(d["name"] == name for d in self.dequantized)
        rt, tt = self.load(r, "ref"), self.load(t, "target")
        entry = compare_pair(name, rt, tt, r.dtype, t.dtype, self.thresholds, dequantized=cast)
        del rt, tt
        if entry is None:
            return None
        if entry.finding == "dtype_kind":  # complex vs real: nothing to explain by content
            entry.layer = r.layer
            return entry
        explain(entry, r, t, self.loader, self.init, self.init_side)
        entry.transformed = any(tr.matches(name) for tr in self.transforms)
        entry.layer = r.layer
        entry.dequantized = cast
        if t.plan in ("concat", "replicated") or r.plan in ("concat", "replicated"):
            entry.tp = {"ref": r.plan, "target": t.plan, "dim": t.dim if t.dim is not None else r.dim}
        return entry

    def _run(self, on_tensor, progress: ProgressHook | None = None) -> WeightsDiffResult:
        tensors, replica = [], []
        names = self.order()
        sizes = {n: _stored_bytes(self.ref[n]) + _stored_bytes(self.tgt[n]) for n in names}
        comparable = {n: self._comparable(n, self.ref[n], self.tgt[n]) for n in names}
        jobs = self._jobs(names)
        n = self._worker_count(jobs, sizes)
        forked = n > 1 and fork_usable()  # before progress starts its thread
        pool = (
            ForkPool(lambda j: [self._one(x, comparable[x]) for x in jobs[j]], n, lambda j: repr(jobs[j][0]))
            if forked
            else None
        )
        try:
            if progress is not None:
                progress.begin(len(names), sum(sizes.values()))

            def advance(j: int) -> None:
                if progress is not None:
                    for x in jobs[j]:
                        progress.advance(sizes[x] if comparable[x] else 0)

            if pool is not None:
                done = pool.map(len(jobs), advance)
            else:
                done = []
                for j, job in enumerate(jobs):
                    done.append([self._one(x, comparable[x]) for x in job])
                    advance(j)
        finally:
            if pool is not None:
                pool.close()
        for entry, rows in (x for job in done for x in job):
            replica.extend(rows)
            if entry is None:
                continue
            tensors.append(entry)
            if on_tensor is not None:
                on_tensor(entry)
        return self.result(tensors, replica)

    def _one(self, name: str, comparable: bool) -> tuple[TensorDiff | None, list[dict]]:
        """The numerics of one paired name (none when not `comparable`), and its sides' replicas
        that differ across ranks."""
        r, t = self.ref[name], self.tgt[name]
        if not comparable:
            return None, []
        entry = self._compare(name, r, t)
        rows = [
            {"name": name, "side": side, "ranks": list(lg.replica_mismatch)}
            for side, lg in (("ref", r), ("target", t))
            if lg.replica_mismatch
        ]
        return entry, rows

    def _jobs(self, names: list[str]) -> list[list[str]]:
        """`names` (in `order()`) cut into runs for the workers: a cut falls only between two plain
        tensors, so the parts of one stacked, fused or content-matched tensor stay on the worker
        that holds it in memory (`TensorLoader` keeps one of each)."""
        jobs: list[list[str]] = []
        for name in names:
            if jobs and not (
                _plain(self.ref[jobs[-1][-1]], self.tgt[jobs[-1][-1]])
                and _plain(self.ref[name], self.tgt[name])
            ):
                jobs[-1].append(name)
            else:
                jobs.append([name])
        return jobs

    def _worker_count(self, jobs: list[list[str]], sizes: dict[str, int]) -> int:
        """`workers`, else compare's rule (`ffdebug.comparison.parallel.worker_count`) with
        `WORKER_BUDGET_BYTES` of stored bytes held at once."""
        from ffdebug.comparison import parallel

        if self.workers is not None:
            return min(self.workers, max(1, len(jobs)))
        return parallel.worker_count([sum(sizes[x] for x in job) for job in jobs], WORKER_BUDGET_BYTES)


def _plain(r: Logical, t: Logical) -> bool:
    """Neither side is built from a tensor another name shares (stacked, fused, content-matched)."""
    return all(lg.build is None and lg.stacked_from is None and lg.relation is None for lg in (r, t))


def _stored_bytes(t: Logical) -> int:
    """The bytes a logical tensor's pieces hold as stored (shape x element size of each record)."""
    from ffdebug.io.prefetch import record_bytes

    return sum(record_bytes(r) for r in t.entries)


def weights_diff(a, b, **opts) -> WeightsDiffResult:
    """Compare two checkpoints (any kind `open_source` reads, or modules / state dicts).

    Options: strip_prefix, add_prefix, maps, alias_file, fuse, stack, skip, layers, transforms, dequant
    ("auto" | "always" | "none"), tp_merge ("auto" | dim), thresholds, fail_on, allow_dtype,
    schema_only. The result is truthy when the sides match; `.to_json()` has the keys of docs/weights-diff.md "JSON".
    """
    schema_only = opts.pop("schema_only", False)
    diff = WeightsDiff(a, b, **opts)
    return diff.schema_result() if schema_only else diff.run()
