"""`weights_diff(a, b)`: schema first (names, shapes, dtypes, rename suggestions), then float64
numerics per tensor, one tensor pair in memory at a time.

Per-tensor findings (README "Weights first", `finding`):

| finding      | meaning                                                              | severity      |
|--------------|----------------------------------------------------------------------|---------------|
| `equal`      | same dtype, same bytes (or same values: −0.0, NaN payloads)          | ok            |
| `dtype_only` | dtypes differ; the finer side cast to the coarser dtype is bit-equal | ok            |
| `rounding`   | every element within one ulp of the coarser (stored) dtype           | ok; fp8: bands |
| `transposed` | equal to the other side transposed                                   | bands (scramble) |
| `sign_flip`  | cos ≈ −1: the negated tensor                                         | scramble      |
| `scaled`     | cos ≈ 1 but the norms differ: a constant factor (`scale_factor`)     | bands (bug)   |
| `mismatch`   | anything else                                                        | bands; same dtype: ≥ bug |

"bands" = `classify(cos, rel)` of the comparison as loaded (README "Comparing"), with --threshold overrides.
Same dtype on both sides and not dequantized: a difference beyond one ulp is never `ok`. Within one
ulp of bf16 / fp16 (a round trip through it) it is `rounding`, at least `drift`; otherwise the
loader changed the values, `mismatch` at least `bug`, however small cos / rel make it look (a few
embedding rows left at their initialisation change the norm of a large table by 0.1%).
"""

from __future__ import annotations

import fnmatch
import math

from ffdebug import verdict as V
from ffdebug._chunks import CHUNK, iter_chunks
from ffdebug.compare.metrics import compare_tensors
from ffdebug.errors import FFDebugError
from ffdebug.io.record import Record
from ffdebug.results import TensorDiff, WeightsDiffResult
from ffdebug.verdict import Severity
from ffdebug.weights import quant
from ffdebug.weights.names import (
    NameMap,
    StackRule,
    build_name_map,
    parse_fuse,
    parse_stack,
    unused_rules,
)
from ffdebug.weights.schema import apply_hint, stacked_suggestions, suggest_renames
from ffdebug.weights.sources import WeightSource, open_source
from ffdebug.weights.tp import Logical, load_logical, plan_merge
from ffdebug.weights.transforms import apply_transforms, parse_transform

FINDINGS = (
    "equal",
    "rounding",
    "dtype_only",
    "transposed",
    "sign_flip",
    "scaled",
    "swapped",
    "permuted",
    "not_loaded",
    "mismatch",
)
LOADED = ("equal", "dtype_only", "rounding")
UNCORRELATED = 0.05  # |cos| below this: no relation between the two tensors
STABLE_KEYS = (
    "verdict",
    "only_ref",
    "only_target",
    "shape_mismatch",
    "dtype_mismatch",
    "renames",
    "tensors",
)


# ------------------------------------------------------------------------------------------------
# per-tensor numerics


def _int_view(t):
    import torch

    size = t.element_size()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


def bytes_equal(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    if a.is_complex():
        a, b = torch.view_as_real(a).reshape(-1), torch.view_as_real(b).reshape(-1)
    return torch.equal(_int_view(a), _int_view(b))


def _equal_after_cast(fine, coarse) -> bool:
    """`fine` cast to `coarse.dtype` is bit-equal to `coarse` (checked in chunks)."""
    f, c = fine.reshape(-1), coarse.reshape(-1)
    for i in range(0, f.numel(), CHUNK):
        fc = f[i : i + CHUNK].to(coarse.dtype)
        if not bytes_equal(fc, c[i : i + CHUNK]):
            return False
    return True


def _within_rounding(ref, tgt, eps: float) -> bool:
    """Every |t − r| ≤ eps·|r| + eps·2⁻⁸·max|r| (one ulp, with a floor for tiny values)."""
    import torch

    r, t = ref.reshape(-1), tgt.reshape(-1)
    absmax = 0.0
    for c in iter_chunks(r):
        m = float(c.abs().max()) if c.numel() else 0.0
        if not math.isfinite(m):
            return False
        absmax = max(absmax, m)
    floor = eps * 2.0**-8 * absmax
    size = min(CHUNK, max(r.numel(), 1))
    rb = torch.empty(size, dtype=torch.float64)
    tb = torch.empty(size, dtype=torch.float64)
    for i in range(0, r.numel(), CHUNK):
        m = min(CHUNK, r.numel() - i)
        rc, tc = rb[:m], tb[:m]
        rc.copy_(r[i : i + m])
        tc.copy_(t[i : i + m])
        tc.sub_(rc).abs_()
        rc.abs_().mul_(eps).add_(floor)
        if not bool((tc <= rc).all()):
            return False
    return True


def _coarsest(*dtypes: str) -> float | None:
    eps = [quant.ulp(d) for d in dtypes]
    if any(e is None for e in eps):
        return None
    return max(eps)


def compare_pair(
    name: str,
    ref,
    tgt,
    dtype_ref: str,
    dtype_tgt: str,
    thresholds: tuple = (),
    dequantized: bool = False,
) -> TensorDiff | None:
    """One entry of `tensors`; None when the shapes differ and are not a transpose of each other."""
    entry = TensorDiff(
        name=name,
        shape_ref=list(ref.shape),
        shape_target=list(tgt.shape),
        dtype_ref=dtype_ref,
        dtype_target=dtype_tgt,
    )
    if tuple(ref.shape) != tuple(tgt.shape):
        if ref.dim() == 2 and tgt.dim() == 2 and tuple(tgt.shape) == tuple(ref.shape)[::-1]:
            # Never left out: compared after .T, so a transposed and scaled tensor is `scaled`.
            after = compare_pair(
                name, ref, tgt.t().contiguous(), dtype_ref, dtype_tgt, thresholds, dequantized
            )
            after.shape_target = list(tgt.shape)
            after.after_transpose = {"cos": after.cos, "rel": after.rel, "max_abs": after.max_abs}
            if after.finding in ("equal", "dtype_only", "rounding"):
                after.finding = "transposed"
                after.notes = ["stored transposed: the shapes are swapped and the values match after .T"]
            else:
                after.notes.insert(0, "stored transposed (the shapes are swapped); compared after .T")
            after.severity = V.worst(after.severity, Severity.SCRAMBLE)
            return after
        return None
    if not dequantized and bytes_equal(ref, tgt):
        entry.byte_equal, entry.cos, entry.rel, entry.max_abs = True, 1.0, 0.0, 0.0
        return entry
    m = compare_tensors(ref, tgt)
    entry.measured = True
    entry.cos, entry.rel, entry.max_abs, entry.rel_diff = m.cos, m.rel, m.max_abs, m.rel_diff
    entry.norm_ratio, entry.max_abs_at, entry.bit_equal = m.norm_ratio, m.max_abs_at, m.bit_equal
    entry.notes = list(m.notes)
    sev = V.classify(m.cos, m.rel, name, thresholds)
    eps = _coarsest(dtype_ref, dtype_tgt)
    has_fp8 = quant.is_fp8(dtype_ref) or quant.is_fp8(dtype_tgt)
    finding = "mismatch"
    if m.max_abs == 0.0 and not (m.nan_mismatch or m.inf_mismatch) and not dequantized:
        # Equal values, other bits: -0.0 vs 0.0, NaN payloads, or an integer / exact dtype change.
        finding, sev = ("equal" if dtype_ref == dtype_tgt else "dtype_only"), Severity.OK
    elif (
        dtype_ref != dtype_tgt
        and not dequantized
        and eps is not None
        and ref.dtype.is_floating_point
        and tgt.dtype.is_floating_point
    ):
        fine, coarse = (ref, tgt) if quant.ulp(dtype_ref) < quant.ulp(dtype_tgt) else (tgt, ref)
        if _equal_after_cast(fine, coarse):
            finding, sev = "dtype_only", Severity.OK
    if finding == "mismatch" and eps is not None and _within_rounding(ref, tgt, eps):
        finding = "rounding"
        if not has_fp8:
            sev = Severity.OK
    if finding == "mismatch" and m.cos is not None and not V.is_ok(sev):
        # Least-squares factor t ≈ c·r; with fp8 on one side "≈" means within its rounding.
        c = m.cos * m.norm_ratio if m.norm_ratio else 0.0
        if m.cos <= -0.9999 or (eps is not None and m.cos < -0.99 and _within_rounding(-ref, tgt, eps)):
            finding = "sign_flip"
        elif ref.dim() == 2 and ref.shape[0] == ref.shape[1] and ref.shape[0] > 1:
            mt = compare_tensors(ref, tgt.t())
            if V.is_ok(V.classify(mt.cos, mt.rel)):
                finding = "transposed"
                entry.after_transpose = {"cos": mt.cos, "rel": mt.rel, "max_abs": mt.max_abs}
        if (
            finding == "mismatch"
            and c > 0
            and abs(c - 1) > 1e-3
            and (
                m.cos >= 0.9999 or (eps is not None and m.cos > 0.99 and _within_rounding(ref * c, tgt, eps))
            )
        ):
            finding = "scaled"
            entry.scale_factor = c
    if finding == "mismatch" and dtype_ref == dtype_tgt and not dequantized and ref.dtype.is_floating_point:
        finding, raised, note = _same_dtype_change(ref, tgt, dtype_ref)
        sev = V.worst(sev, raised)
        entry.notes.append(note)
    entry.finding = finding
    entry.severity = sev
    return entry


def _same_dtype_change(ref, tgt, dtype: str) -> tuple[str, Severity, str]:
    """(finding, lowest severity, note) for a same-dtype pair that differs beyond one ulp.

    Values within one ulp of a coarser float went through it on the way (a bf16 round trip):
    `rounding`, at least drift. Anything else the loader changed, however small the error looks
    (a few rows left at their initialisation hide in a large tensor's norm): at least a bug."""
    for coarse in ("float16", "bfloat16"):
        eps = quant.ulp(coarse)
        if quant.ulp(dtype) < eps and _within_rounding(ref, tgt, eps):
            note = f"same dtype, but the target's values were rounded through {coarse}"
            return "rounding", Severity.DRIFT, note
    return "mismatch", Severity.BUG, "same dtype, values differ beyond rounding: the loader changed them"


# ------------------------------------------------------------------------------------------------
# the pipeline


def _check_dequant(mode: str) -> str:
    if mode not in ("auto", "always", "none"):
        raise FFDebugError(f"--dequant {mode!r} is invalid: use auto, always or none")
    return mode


def _check_tp_merge(value):
    if value is None or value == "auto":
        return "auto"
    if isinstance(value, int):
        return value
    try:
        return int(value)
    except (TypeError, ValueError):
        raise FFDebugError(f"--tp-merge {value!r} is invalid: use auto or a dim number, e.g. 0") from None


def _group(src: WeightSource, name_map: NameMap, side: str) -> dict[str, list[Record]]:
    """Entries by mapped name (insertion = file order); two names mapped onto one is an error."""
    groups: dict[str, list[Record]] = {}
    origin: dict[tuple[str, int], str] = {}
    for e in src.entries:
        name = name_map.apply(e.key)
        key = (name, e.rank)
        if key in origin and origin[key] != e.key:
            raise FFDebugError(
                f"{src.path}: {side} tensors {origin[key]} and {e.key} both map to {name}; "
                "narrow --strip-prefix / --map"
            )
        origin[key] = e.key
        groups.setdefault(name, []).append(e)
    return groups


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
    ) -> None:
        from ffdebug._env import parse_layers

        if match_content not in ("auto", "off"):
            raise FFDebugError(f"--match-content {match_content!r} is invalid: use auto or off")
        if init_side not in ("ref", "target"):
            raise FFDebugError(f"init_side {init_side!r} is invalid: use ref or target")
        self.match_content = match_content
        self.init_side = init_side
        self._content_cache: tuple = (None, None)
        self.content = None

        self.dequant = _check_dequant(dequant)
        self.tp_merge = _check_tp_merge(tp_merge)
        self.fail_on = V.parse_fail_on(fail_on)
        self.allow_dtype = allow_dtype
        self.thresholds = tuple(V.parse_threshold(t) if isinstance(t, str) else t for t in thresholds or ())
        self.transforms = tuple(parse_transform(t) for t in transforms or ())
        self.fuse_rules = tuple(parse_fuse(f) if isinstance(f, str) else f for f in fuse or ())
        if isinstance(stack, (str, StackRule)):
            stack = (stack,)
        self.stack_rules = tuple(parse_stack(r) if isinstance(r, str) else r for r in stack or ())
        self._stack_cache: tuple = (None, None)
        self.skip = (skip,) if isinstance(skip, str) else tuple(skip or ())
        self.layers = parse_layers(layers) if isinstance(layers, (str, type(None))) else layers
        tgt_map = build_name_map(strip_prefix, add_prefix, maps, alias_file)
        ref_map = NameMap(strip_prefix=tgt_map.strip_prefix)
        self.ref_map, self.tgt_map = ref_map, tgt_map

        self.ref_src = open_source(a, "reference")
        self.tgt_src = open_source(b, "target")
        self.init_src = open_source(init, "--init") if init is not None else None
        self.notes: list[str] = []
        self.warnings: list[str] = []
        ref_groups = _group(self.ref_src, ref_map, "reference")
        tgt_groups = _group(self.tgt_src, tgt_map, "target")
        self.warnings += unused_rules(tgt_map, [e.key for e in self.tgt_src.entries], "target")
        self.skipped: list[str] = []
        ref_groups = self._filter(ref_groups)
        tgt_groups = self._filter(tgt_groups)
        self.restricted: list[dict] = []
        ref_groups = self._restrict_to_dump(ref_groups, "reference", self.tgt_src)
        tgt_groups = self._restrict_to_dump(tgt_groups, "target", self.ref_src)
        rw, tw = self.ref_src.world_size, self.tgt_src.world_size
        if rw > 1 and rw == tw and self.tp_merge == "auto":
            ref_groups, tgt_groups = _split_ranks(ref_groups), _split_ranks(tgt_groups)
            self.notes.append(f"both sides have {rw} ranks: rank r compared with rank r (name@rankR)")
        self.ref = self._logicals(ref_groups, tgt_groups)
        self.tgt = self._logicals(tgt_groups, ref_groups)
        self.dequantized: list[dict] = []
        self._apply_stack(self.stack_rules)
        if auto_stack:
            self._auto_stack()
        self._attach_scales()
        self._apply_fuse()
        self._schema()
        if self.match_content == "auto" and self.only_ref and self.only_target:
            by_name = self.renames
            self._apply_content()
            self._schema()
            # the name suggestions stay (a map to write down), fuse orders as the content has them
            self.renames = _verified_fuse_orders(by_name, self.content) + self.renames

    def ref_name(self, source_name: str) -> str:
        """The name a reference-side tensor is compared under."""
        return self.ref_map.apply(source_name)

    # -- building -------------------------------------------------------------------------------

    def _filter(self, groups: dict[str, list[Record]]) -> dict[str, list[Record]]:
        if not self.skip and self.layers.all:
            return groups
        known = [e[0].layer for e in groups.values() if e[0].layer is not None]
        num_layers = max(known) + 1 if known else None
        out = {}
        for name, entries in groups.items():
            src = entries[0].key
            if any(fnmatch.fnmatchcase(name, g) or fnmatch.fnmatchcase(src, g) for g in self.skip):
                self.skipped.append(name)
                continue
            layer = entries[0].layer
            if layer is not None and not self.layers.contains(layer, num_layers):
                continue
            out[name] = entries
        return out

    def _restrict_to_dump(self, groups: dict, side: str, dump: WeightSource) -> dict:
        """When the other side is a weight dump written with FFDEBUG_WEIGHT_DUMP_LAYERS, leave out
        this side's tensors of layers the dump did not select (it cannot hold them); tensors
        outside blocks are kept, unless the dump holds block tensors only (ATOM's, which also
        skips `never_dumped` names such as experts). Said in `restricted` and a note."""
        from ffdebug._env import parse_layers

        if dump.kind != "weight-dump" or not dump.layer_spec:
            return groups
        try:
            selection = parse_layers(dump.layer_spec, "FFDEBUG_WEIGHT_DUMP_LAYERS")
        except FFDebugError:
            self.notes.append(
                f"{dump.path}: run.json FFDEBUG_WEIGHT_DUMP_LAYERS={dump.layer_spec!r} unreadable"
            )
            return groups
        known = [e[0].layer for e in groups.values() if e[0].layer is not None]
        num_layers = max(known) + 1 if known else None
        kept, left_out = {}, 0
        for name, entries in groups.items():
            layer = entries[0].layer
            skipped = any(part in name for part in dump.never_dumped)
            if skipped or (layer is None and dump.layers_only):  # ATOM: `layers.{L}.` only, no experts
                left_out += 1
                continue
            if layer is not None and not selection.contains(layer, num_layers):
                left_out += 1
                continue
            kept[name] = entries
        if left_out:
            layers = sorted({e[0].layer for e in kept.values() if e[0].layer is not None})
            self.restricted.append(
                {"side": side, "layers": layers, "left_out": left_out, "because": dump.layer_spec}
            )
        return kept

    def _logicals(self, mine: dict, other: dict) -> dict[str, Logical]:
        out = {}
        for name, pieces in mine.items():
            counterpart = other.get(name)
            other_shape = tuple(counterpart[0].shape) if counterpart and len(counterpart) == 1 else None
            fold, shape, note = plan_merge(pieces, other_shape, self.tp_merge)
            first = pieces[0]
            out[name] = Logical(
                name=name,
                source_name=first.key,
                entries=sorted(pieces, key=lambda e: e.rank),
                shape=tuple(shape),
                dtype=first.dtype,
                fold=fold,
                layer=first.layer,
                note=note,
            )
            if note:
                self.notes.append(f"{name}: {note}")
        return out

    def _attach_scales(self) -> None:
        """Pair fp8 tensors with their scale tensors; scales used for dequant leave the schema."""
        if self.dequant == "none":
            return
        for side, mine, other in (("ref", self.ref, self.tgt), ("target", self.tgt, self.ref)):
            by_source = {t.source_name: t for t in mine.values()}
            for name, t in list(mine.items()):
                if not quant.is_fp8(t.dtype):
                    continue
                counterpart = other.get(name)
                if self.dequant == "auto" and (counterpart is None or quant.is_fp8(counterpart.dtype)):
                    continue
                scale = next(
                    (by_source[c] for c in quant.scale_candidates(t.source_name) if c in by_source), None
                )
                t.scale = scale
                if scale is not None and scale.name not in other:
                    mine.pop(scale.name, None)
                self.dequantized.append(
                    {
                        "name": name,
                        "side": side,
                        "dtype": t.dtype,
                        "scale": scale.source_name if scale is not None else None,
                        "scale_shape": list(scale.shape) if scale is not None else None,
                    }
                )
                if scale is None:
                    self.notes.append(
                        f"{name}: no scale tensor found on the {side} side; cast without scaling"
                    )

    def _apply_fuse(self) -> None:
        for rule in self.fuse_rules:
            for name in list(self.tgt):
                parts = rule.part_names(name)
                if not parts or name in self.ref or not all(p in self.ref for p in parts):
                    continue
                if any(p in self.tgt for p in parts):
                    continue
                fused = self.tgt.pop(name)
                sizes = [self.ref[p].shape[rule.dim] if self.ref[p].shape else 0 for p in parts]
                if fused.shape and sum(sizes) != fused.shape[rule.dim]:
                    self.tgt[name] = fused
                    self.notes.append(
                        f"--fuse {rule.spec}: {name} has {fused.shape[rule.dim]} along dim {rule.dim}, "
                        f"the parts {sum(sizes)}"
                    )
                    continue
                cache: dict = {}
                offset = 0
                for p, size in zip(parts, sizes):
                    shape = list(fused.shape)
                    shape[rule.dim] = size
                    self.tgt[p] = Logical(
                        name=p,
                        source_name=f"{fused.source_name}[{offset}:{offset + size}]",
                        entries=fused.entries,
                        shape=tuple(shape),
                        dtype=fused.dtype,
                        layer=fused.layer,
                        scale=fused.scale,
                        build=_split_builder(self, fused, rule.dim, offset, size, cache),
                    )
                    offset += size
            for name in list(self.ref):
                parts = rule.part_names(name)
                if not parts or name in self.tgt or not all(p in self.tgt for p in parts):
                    continue
                if any(p in self.ref for p in parts):
                    continue
                pieces = [self.tgt.pop(p) for p in parts]
                shape = list(pieces[0].shape)
                shape[rule.dim] = sum(p.shape[rule.dim] for p in pieces)
                self.tgt[name] = Logical(
                    name=name,
                    source_name="+".join(p.source_name for p in pieces),
                    entries=pieces[0].entries,
                    shape=tuple(shape),
                    dtype=pieces[0].dtype,
                    layer=pieces[0].layer,
                    build=_cat_builder(self, pieces, rule.dim),
                )

    def _apply_content(self) -> None:
        """Pair what the names left unpaired by content (`weights.content`): each composite is cut
        into the other side's tensors, under their names; the plan is kept in `self.content`."""
        from ffdebug.weights.content import relate

        sides = {"ref": self.ref, "target": self.tgt}
        only = {"ref": self.only_ref, "target": self.only_target}
        from ffdebug._chunks import single_thread

        with single_thread():  # as in run(): chunked ops gain nothing from torch's thread pool
            plan = relate(
                {n: self.ref[n].shape for n in self.only_ref if not quant.is_fp8(self.ref[n].dtype)},
                {n: self.tgt[n].shape for n in self.only_target if not quant.is_fp8(self.tgt[n].dtype)},
                lambda n: self.load(self.ref[n], "ref"),
                lambda n: self.load(self.tgt[n], "target"),
            )
        self.content = plan
        for rel in plan.relations:
            mine = sides[rel.side]
            if rel.composite not in mine or rel.composite not in only[rel.side]:
                continue
            comp = mine.pop(rel.composite)
            found = {s.part: s for s in rel.found or ()}
            for seg in rel.segments:
                mine[seg.part] = Logical(
                    name=seg.part,
                    source_name=comp.source_name
                    + ("" if rel.kind == "whole" and not seg.transposed else seg.where()),
                    entries=comp.entries,
                    shape=_cut_shape(comp.shape, seg),
                    dtype=comp.dtype,
                    layer=comp.layer,
                    build=self._content_view(comp, rel.side, seg),
                    stacked_from=comp.source_name,
                    segment=seg,
                    found=(
                        (found[seg.part], self._content_view(comp, rel.side, found[seg.part]))
                        if seg.part in found
                        else None
                    ),
                    relation=rel,
                )
        self.notes.append(
            f"content matching paired {sum(len(r.segments) for r in plan.relations)} tensor(s) the names "
            f"left unpaired ({plan.seconds:.2f} s)"
        )

    def _content_view(self, comp: Logical, side: str, seg):
        """Builder of one block of a content-matched composite: the composite is loaded once and
        kept while its blocks are compared (they are compared one after the other)."""
        from ffdebug.weights.content import cut

        def build():
            return cut(self._composite(comp, side), seg)

        return build

    def _composite(self, comp: Logical, side: str):
        key = (side, comp.name)
        if self._content_cache[0] != key:
            self._content_cache = (None, None)
            self._content_cache = (key, self.load(comp, side))
        return self._content_cache[1]

    def _apply_stack(self, rules) -> None:
        """Cut each stacked tensor ([E, …], all experts of one MoE layer) into one logical tensor
        per expert and part, under the other side's per-expert names (either side may be stacked)."""
        for rule in rules:
            for side, mine, other in (("target", self.tgt, self.ref), ("ref", self.ref, self.tgt)):
                for name in list(mine):
                    lg = mine[name]
                    if name in other or len(lg.shape) < 2 or rule.split(name) is None:
                        continue
                    experts = rule.expert_parts(name, lg.shape[0], other)
                    if not any(p in other for names in experts for p in names):
                        continue
                    if any(p in mine for names in experts for p in names):
                        continue
                    sizes, problem = _stack_sizes(rule, lg, experts, other)
                    if problem:
                        self.notes.append(f"--stack {rule.spec}: {name} {problem}")
                        continue
                    parts: dict[str, Logical] = {}
                    d = rule.dim % (len(lg.shape) - 1)
                    for e, names in enumerate(experts):
                        offset = 0
                        for part, size in zip(names, sizes):
                            shape = list(lg.shape[1:])
                            shape[d] = size
                            index = [str(e)] + [":"] * d + [f"{offset}:{offset + size}"]
                            parts[part] = Logical(
                                name=part,
                                source_name=f"{lg.source_name}[{', '.join(index if len(names) > 1 else index[:1])}]",
                                entries=lg.entries,
                                shape=tuple(shape),
                                dtype=lg.dtype,
                                layer=lg.layer,
                                build=self._stack_view(lg, side, e, d, offset, size, len(names) > 1),
                                stacked_from=lg.source_name,
                            )
                            offset += size
                    items = list(mine.items())
                    mine.clear()
                    for n, t in items:  # the parts take the stacked tensor's place
                        mine.update(parts if n == name else {n: t})

    def _stack_view(self, lg: Logical, side: str, expert: int, dim: int, offset: int, size: int, cut: bool):
        """Builder of one expert's part: the stacked tensor is loaded once and kept while its
        parts are compared (the comparison order keeps them together), then replaced."""

        def build():
            key = (side, lg.name)
            if self._stack_cache[0] != key:
                self._stack_cache = (None, None)
                self._stack_cache = (key, self._load_raw(lg, side))
            x = self._stack_cache[1][expert]
            return x.narrow(dim, offset, size).contiguous() if cut else x.contiguous()

        return build

    def _auto_stack(self) -> None:
        """Apply stacking the only-in lists show by name and shape (load-audit: layout only;
        every expert's values are still compared)."""
        found = stacked_suggestions(
            {n: t.shape for n, t in self.ref.items() if n not in self.tgt},
            {n: t.shape for n, t in self.tgt.items() if n not in self.ref},
        )
        rules = [parse_stack(s["apply"].split(" ", 1)[1].strip("'")) for s in found]
        if rules:
            self._apply_stack(rules)
            for s in found:
                self.notes.append(f"paired {s['matches']} stacked expert tensor(s) by shape: {s['apply']}")

    def _schema(self) -> None:
        self.only_ref = [n for n in self.ref if n not in self.tgt]
        self.only_target = [n for n in self.tgt if n not in self.ref]
        self.buffers_not_in_checkpoint = []
        for side, src, other, only in (
            ("ref", self.ref_src, self.tgt_src, self.only_ref),
            ("target", self.tgt_src, self.ref_src, self.only_target),
        ):
            if src.kind != "weight-dump" or other.kind == "weight-dump":
                continue
            mine = self.ref if side == "ref" else self.tgt
            for n in [n for n in only if _non_persistent(mine[n])]:
                only.remove(n)
                self.buffers_not_in_checkpoint.append({"name": n, "side": side})
        self.shape_mismatch = []
        self.dtype_mismatch = []
        self.common = [n for n in self.ref if n in self.tgt]
        for n in self.common:
            r, t = self.ref[n], self.tgt[n]
            after = (
                _shape_after(self.transforms, "ref", n, r.shape),
                _shape_after(self.transforms, "target", n, t.shape),
            )
            if r.shape != t.shape and after[0] is not None and after[0] == after[1]:
                self.notes.append(f"{n}: shapes {list(r.shape)} vs {list(t.shape)} agree after --transform")
            elif r.shape != t.shape:
                item = {"name": n, "shape_ref": list(r.shape), "shape_target": list(t.shape)}
                if len(r.shape) == 2 and t.shape == r.shape[::-1]:
                    item["note"] = "transposed shape"
                if t.note or r.note:
                    item["note"] = t.note or r.note
                self.shape_mismatch.append(item)
            if r.dtype != t.dtype:
                item = {"name": n, "dtype_ref": r.dtype, "dtype_target": t.dtype}
                if (
                    r.scale is not None
                    or t.scale is not None
                    or any(d["name"] == n for d in self.dequantized)
                ):
                    item["dequantized"] = True
                self.dtype_mismatch.append(item)
        self.renames = []
        if self.only_ref and self.only_target:
            self.renames = suggest_renames(
                {n: self.ref[n].shape for n in self.only_ref},
                {n: self.tgt[n].shape for n in self.only_target},
            )

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
        return apply_transforms(self.transforms, side, t.name, self._load_raw(t, side))

    def _load_raw(self, t: Logical, side: str):
        """Merged and dequantised, before any --transform."""
        x = load_logical(t, _dequant_piece if t.scale is not None or self._wants_cast(t, side) else None)
        if quant.is_fp8(t.dtype) and self._wants_cast(t, side) and t.scale is None:
            x = x.float()
        return x

    def _wants_cast(self, t: Logical, side: str) -> bool:
        return any(d["name"] == t.name and d["side"] == side for d in self.dequantized)

    def run(self, on_tensor=None) -> WeightsDiffResult:
        """Numerics for every paired tensor, one pair in memory at a time.

        Runs single-threaded: the 64 Ki-element chunk ops gain nothing from torch's thread pool,
        and with a busy core its spin-waits made a 2 × 2 GiB diff 8× slower on a 2-core machine.
        """
        from ffdebug._chunks import single_thread

        try:
            with single_thread():
                return self._run(on_tensor)
        finally:
            self._stack_cache = (None, None)

    def _order(self) -> list[str]:
        """Common names in reference order, except that the parts cut from one stacked tensor are
        compared one after the other (the stacked tensor is in memory once)."""
        first: dict = {}
        keyed = []
        for i, n in enumerate(self.common):
            r, t = self.ref[n], self.tgt[n]
            key = (
                ("ref", r.stacked_from)
                if r.stacked_from
                else ("target", t.stacked_from)
                if t.stacked_from
                else n
            )
            keyed.append((first.setdefault(key, i), i, n))
        return [n for *_, n in sorted(keyed)]

    def _explain(self, entry: TensorDiff, r: Logical, t: Logical) -> None:
        """Name a difference in the port's terms: a block content matching found elsewhere in its
        composite (a swapped fused part, a permuted expert), or a tensor equal to the port's own
        initialisation (`--init`: never loaded)."""
        from ffdebug.compare.metrics import compare_tensors

        if r.source_name != entry.name or t.source_name != entry.name:
            entry.origin = {"ref": r.source_name, "target": t.source_name}
        if entry.finding in LOADED:
            return
        for lg, other, other_side in ((r, t, "target"), (t, r, "ref")):
            if lg.found is None:
                continue
            seg, build = lg.found
            m = compare_tensors(self.load(other, other_side), build())
            if V.is_ok(V.classify(m.cos, m.rel)):
                entry.notes = [n for n in entry.notes if not n.startswith("same dtype, values differ")]
                entry.finding = "permuted" if lg.relation.kind == "stacked" else "swapped"
                entry.severity = V.worst(entry.severity, Severity.SCRAMBLE)
                entry.layout = {
                    "tensor": lg.stacked_from,
                    "compared_at": lg.segment.where(),
                    "found_at": seg.where(),
                    "cos": m.cos,
                    "rel": m.rel,
                }
                entry.notes.append(
                    f"{entry.name} is stored at {lg.stacked_from}{seg.where()}, where the port's other "
                    f"tensors of this kind hold it at {lg.segment.where()}"
                )
                return
        side = self.init_side
        lg = r if side == "ref" else t
        x0 = self._init_tensor(lg)
        if x0 is not None:
            x = self.load(lg, side)
            if tuple(x0.shape) == tuple(x.shape) and bytes_equal(x0.to(x.dtype), x):
                entry.notes = [n for n in entry.notes if not n.startswith("same dtype, values differ")]
                entry.finding = "not_loaded"
                entry.severity = V.worst(entry.severity, Severity.BUG)
                entry.notes.append(
                    f"{lg.source_name} equals the port's own initialisation (--init): never loaded"
                )
                return
        if entry.finding == "mismatch" and entry.cos is not None and abs(entry.cos) < UNCORRELATED:
            entry.notes.append(
                f"uncorrelated with the other side (cos {entry.cos:.3f}): never loaded, or loaded from "
                "another tensor; --init ENTRY (the port built without loading) tells which"
            )

    def _init_tensor(self, lg: Logical):
        """The port's initial value of `lg` (its block, for a content-matched composite), else None."""
        if self.init_src is None:
            return None
        if not hasattr(self, "_init_by_name"):
            self._init_by_name = {e.key: e for e in self.init_src.entries}
        rec = self._init_by_name.get(lg.stacked_from or lg.source_name)
        if rec is None:
            return None
        x = rec.load()
        if lg.segment is not None:
            from ffdebug.weights.content import cut

            if x.dim() != len(lg.relation.shape):
                return None
            x = cut(x, lg.segment)
        return x

    def _run(self, on_tensor) -> WeightsDiffResult:
        tensors = []
        replica = []
        deq = {d["name"] for d in self.dequantized}
        for name in self._order():
            r, t = self.ref[name], self.tgt[name]
            rs, ts = (
                _shape_after(self.transforms, "ref", name, r.shape),
                _shape_after(self.transforms, "target", name, t.shape),
            )
            transposable = rs is not None and ts is not None and len(rs) == 2 and ts == rs[::-1]
            if rs is not None and ts is not None and rs != ts and not transposable:
                continue
            rt = self.load(r, "ref")
            tt = self.load(t, "target")
            transformed = any(tr.matches(name) for tr in self.transforms)
            entry = compare_pair(name, rt, tt, r.dtype, t.dtype, self.thresholds, dequantized=name in deq)
            del rt, tt
            for side, lg in (("ref", r), ("target", t)):
                if lg.replica_mismatch:
                    replica.append({"name": name, "side": side, "ranks": list(lg.replica_mismatch)})
            if entry is None:
                continue
            self._explain(entry, r, t)
            entry.transformed = transformed
            entry.layer = r.layer
            entry.dequantized = name in deq
            if t.plan in ("concat", "replicated") or r.plan in ("concat", "replicated"):
                entry.tp = {"ref": r.plan, "target": t.plan, "dim": t.dim if t.dim is not None else r.dim}
            tensors.append(entry)
            if on_tensor is not None:
                on_tensor(entry)
        return self.result(tensors, replica)


# Buffers models register with persistent=False: in a weight dump (named_buffers), never in a
# checkpoint or a state_dict(). Used when the dump record does not say `persistent` itself.
NON_PERSISTENT_BUFFERS = frozenset(
    {
        "inv_freq",
        "original_inv_freq",
        "cos_cached",
        "sin_cached",
        "_cos_cached",
        "_sin_cached",
        "cos_sin_cache",
        "position_ids",
    }
)


def _non_persistent(t: Logical) -> bool:
    flags = {e.persistent for e in t.entries}
    if flags == {False}:
        return True
    return None in flags and t.source_name.rsplit(".", 1)[-1] in NON_PERSISTENT_BUFFERS


def _stack_sizes(rule: StackRule, lg: Logical, experts: list[list[str]], other: dict) -> tuple:
    """(sizes of the parts along the rule's dim, None) or (None, why the stacked tensor does not
    hold the other side's parts); one part's size may be inferred as the remainder."""
    expert_shape = tuple(lg.shape[1:])
    nd = len(expert_shape)
    if not -nd <= rule.dim < nd:
        return None, f"dim {rule.dim} is out of range for an expert of shape {list(expert_shape)}"
    d = rule.dim % nd
    shapes = []
    for i in range(len(rule.parts)):
        shapes.append(next((tuple(other[n[i]].shape) for n in experts if n[i] in other), None))
    for s in shapes:
        if s is not None and (len(s) != nd or s[:d] + s[d + 1 :] != expert_shape[:d] + expert_shape[d + 1 :]):
            return None, (
                f"{list(lg.shape)}: one expert {list(expert_shape)} does not hold parts of shape "
                f"{[list(x) for x in shapes if x is not None]} along dim {d}"
            )
    known = sum(s[d] for s in shapes if s is not None)
    missing = [i for i, s in enumerate(shapes) if s is None]
    if len(missing) > 1 or (not missing and known != expert_shape[d]) or known > expert_shape[d]:
        return None, (
            f"{list(lg.shape)}: the parts add up to {known} along dim {d}, one expert holds {expert_shape[d]}"
        )
    sizes = [s[d] if s is not None else expert_shape[d] - known for s in shapes]
    if any(x <= 0 for x in sizes):
        return None, f"{list(lg.shape)}: no room for part {rule.parts[missing[0]]}"
    return sizes, None


def _shape_after(transforms, side: str, name: str, shape: tuple) -> tuple | None:
    """The shape after the built-in `transpose` transforms; None when a Python transform applies
    (its output shape is known only once it ran)."""
    from ffdebug.weights.transforms import transpose

    for tr in transforms:
        if tr.side == side and tr.matches(name):
            if tr.fn is not transpose or len(shape) < 2:
                return None
            shape = tuple(shape[:-2]) + (shape[-1], shape[-2])
    return tuple(shape)


def _verified_fuse_orders(renames: list[dict], plan) -> list[dict]:
    """Fuse suggestions (named parts in the order the names suggest) checked against the
    content: a composite content matching related gets its parts in the order compared (the
    port's convention, verified numerically); one it could not relate is marked unverified."""
    import re

    by_comp = {r.composite: r for r in plan.relations if r.how == "content"}
    by_part = {p: r for r in plan.relations if r.how == "content" for p in r.parts}
    out = []
    for s in renames:
        if s["kind"] != "fused":
            out.append(s)
            continue
        fused = s["from"] if isinstance(s["from"], str) else s["to"]
        parts = s["to"] if isinstance(s["from"], str) else s["from"]
        rel = by_comp.get(fused) or by_part.get(parts[0])
        m = re.fullmatch(r"--fuse (\S+)=(\S+)", s["apply"])
        if rel is None or m is None:
            out.append(dict(s, verified=False))
            continue
        order = [p for p in rel.parts if p in parts] if fused == rel.composite else list(parts)
        comps = m.group(2).split("+")
        named = dict(zip(parts, comps))
        if set(order) != set(parts):
            out.append(dict(s, verified=False))
            continue
        new = dict(s, verified=True, apply=f"--fuse {m.group(1)}={'+'.join(named[p] for p in order)}")
        new["to" if isinstance(s["from"], str) else "from"] = order
        out.append(new)
    return out


def _cut_shape(shape, seg) -> tuple:
    from ffdebug.weights.content import cut_shape

    return cut_shape(tuple(shape), seg)


def _dequant_piece(x, scale, name):
    return quant.dequantize(x, scale, name)


def _split_builder(diff: WeightsDiff, fused: Logical, dim: int, offset: int, size: int, cache: dict):
    def build():
        if "t" not in cache:
            cache.clear()
            cache["t"] = diff.load(fused, "target")
        out = cache["t"].narrow(dim, offset, size).contiguous()
        if offset + size >= cache["t"].shape[dim]:
            cache.clear()
        return out

    return build


def _cat_builder(diff: WeightsDiff, pieces: list[Logical], dim: int):
    def build():
        import torch

        return torch.cat([diff.load(p, "target") for p in pieces], dim=dim)

    return build


def _split_ranks(groups: dict[str, list[Record]]) -> dict[str, list[Record]]:
    out = {}
    for name, entries in groups.items():
        if len(entries) == 1:
            out[name] = entries
            continue
        for e in entries:
            out[f"{name}@rank{e.rank}"] = [e]
    return out


def weights_diff(a, b, **opts) -> WeightsDiffResult:
    """Compare two checkpoints (any kind `open_source` reads, or modules / state dicts).

    Options: strip_prefix, add_prefix, maps, alias_file, fuse, stack, skip, layers, transforms, dequant
    ("auto" | "always" | "none"), tp_merge ("auto" | dim), thresholds, fail_on, allow_dtype,
    schema_only. The result is truthy when the sides match; `.to_json()` has the README's keys.
    """
    schema_only = opts.pop("schema_only", False)
    diff = WeightsDiff(a, b, **opts)
    return diff.schema_result() if schema_only else diff.run()
