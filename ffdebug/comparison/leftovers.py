"""Records the keys left unpaired on one side each, paired by what else says they are one stage
(`comparison.pairing.pair_stages` runs these after pairing by key):

- `by_module_path`: one module on both sides (the same path), named differently by role naming;
- `by_position`: inside one layer, a fused projection's output against the projections it fuses
  (`_fused_parts`: each reference output with its columns of the fused one), then the rest when
  they align whole in both capture orders, one side at least named after its modules (two
  codebases whose children role naming could not place by name on one side or both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ffdebug.comparison.pairing import CallGroup, StagePairing, StageUnit
from ffdebug.io.record import Record

INPUT_REL = 0.5  # a fused projection's input against its parts': further apart, they are not its parts


def by_module_path(rg: CallGroup, sp: StagePairing) -> StagePairing:
    """Records left on one side each that one module wrote on both (the same module path, layer,
    invocation, rank and shape, one record per side) are one stage under two names: role naming
    read the module's behaviour, and a target whose norm is broken past recognition keeps its
    module path (`L000.input_layernorm.out`) where the reference says `L000.attn_norm_out`. They
    are paired, in the reference's order, and the pair's note says so; a module path written more
    than once on either side stays unpaired."""

    def ident(r: Record) -> tuple | None:
        if not r.module_path:
            return None
        return (r.module_path, r.layer, r.invocation or 0, r.rank or 0, tuple(r.shape or ()), r.io)

    def unique(records: list[Record]) -> dict[tuple, Record]:
        seen: dict[tuple, list[Record]] = {}
        for r in records:
            if (k := ident(r)) is not None:
                seen.setdefault(k, []).append(r)
        return {k: v[0] for k, v in seen.items() if len(v) == 1}

    refs, tgts = unique(sp.only_ref), unique(sp.only_target)
    both = set(refs) & set(tgts)
    pairs = [
        (refs[k], tgts[k], f"paired by module path {refs[k].module_path}: target {tgts[k].key}") for k in both
    ]
    return _with_pairs(rg, sp, pairs)


def whole_of(t: Record) -> Record:
    """The record a target record stands for: a fused record's, for its columns (`_Part`)."""
    return getattr(t.source, "whole", t)


def _with_pairs(rg: CallGroup, sp: StagePairing, pairs: list[tuple[Record, Record, str]]) -> StagePairing:
    """`sp` with `pairs` (reference record, target record, note) as units, in the reference's
    order, and neither side's paired records left over (a fused record's columns take it)."""
    if not pairs:
        return sp
    at = {id(rec): sk for sk, rec in rg.records.items()}
    units = list(sp.units) + [StageUnit(rg, at[id(r)], r, t, note=note) for r, t, note in pairs]
    position = {sk: i for i, sk in enumerate(rg.order)}
    units.sort(key=lambda u: position.get(u.sk, len(position)))
    paired_r = {id(r) for r, _, _ in pairs}
    paired_t = {id(whole_of(t)) for _, t, _ in pairs}
    return StagePairing(
        units,
        [r for r in sp.only_ref if id(r) not in paired_r],
        [t for t in sp.only_target if id(t) not in paired_t],
    )


def _by_path(r: Record) -> bool:
    """A record named after its module (role naming placed nothing there: `a0.s1.q0.out`,
    `intermediate.out`), not a role's stage (`attn.q.out`, `attn_out`)."""
    kind = r.key.split(".", 1)[1] if r.key.startswith("L") and "." in r.key else r.key
    parts = kind.split(".")
    if len(parts) > 2 and parts[-1].isdigit() and parts[-2] in ("in", "out"):
        parts.pop()  # a module's second output (`out.1`); a list member's index (`norm.0.out`) stays
    if parts and parts[-1] in ("in", "out"):
        parts.pop()
    stem = ".".join(parts)
    return (
        bool(stem) and bool(r.module_path) and (r.module_path == stem or r.module_path.endswith("." + stem))
    )


def _fits(r: Record, t: Record) -> bool:
    """Two records that can hold one tensor: at least one named after its module (a side that had
    no reading of the block meets the other's; role stages on both sides are two readings of the
    block, never paired by position: two readings that differ stay unpaired), the same io, shape
    (or, for a packed side, the same element count and last dim, or token blocks: `_token_blocks`),
    invocation and rank."""
    if not (_by_path(r) or _by_path(t)):
        return False
    rs, ts = tuple(r.shape or ()), tuple(t.shape or ())
    same = rs == ts or (bool(rs) and bool(ts) and rs[-1] == ts[-1] and math.prod(rs) == math.prod(ts))
    return (
        (same or _token_blocks(rs, ts))
        and r.io == t.io
        and (r.invocation or 0) == (t.invocation or 0)
        and (r.rank or 0) == (t.rank or 0)
    )


def _token_blocks(rs: tuple, ts: tuple) -> bool:
    """A token-by-token stage of a padded `[B, …, S, S]` and a packed `[1, …, T, T]` side (attention
    probabilities: compared on each sequence's diagonal block) with T = B·S tokens."""
    return (
        len(rs) == len(ts) >= 3
        and rs[-1] == rs[-2]
        and ts[-1] == ts[-2]
        and ts[0] == 1
        and rs[1:-2] == ts[1:-2]
        and rs[0] * rs[-1] == ts[-1]
    )


def _common_order(refs: list[Record], tgts: list[Record]) -> list[tuple[Record, Record]]:
    """The longest sequence of fitting pairs in both sides' capture order (LCS)."""
    n, m = len(refs), len(tgts)
    best = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            best[i][j] = (
                best[i + 1][j + 1] + 1 if _fits(refs[i], tgts[j]) else max(best[i + 1][j], best[i][j + 1])
            )
    out, i, j = [], 0, 0
    while i < n and j < m:
        if _fits(refs[i], tgts[j]) and best[i][j] == best[i + 1][j + 1] + 1:
            out.append((refs[i], tgts[j]))
            i, j = i + 1, j + 1
        elif best[i + 1][j] >= best[i][j + 1]:
            i += 1
        else:
            j += 1
    return out


@dataclass(frozen=True)
class _Part:
    """A source standing for columns `lo:hi` of a fused target record (`whole`)."""

    whole: Record
    lo: int
    hi: int

    @property
    def origin(self) -> str:
        return self.whole.origin

    @property
    def parts(self) -> tuple:
        return ()

    def load(self):
        return self.whole.load()[..., self.lo : self.hi]

    def verify(self) -> None:
        self.whole.verify()


def _input_of(r: Record, ref_ins: dict) -> Record | None:
    """The `.in` record of the projection whose output `r` is: the input its reader names
    (`extra["inputs"]`, a group's `attn.qkv.in`), else the same key's `.in`; None when there is none
    left (an activation's output, `mlp.act.out`, is no projection's)."""
    named = (r.extra or {}).get("inputs")
    if isinstance(named, list) and named:
        return ref_ins.get(named[0])
    return ref_ins.get(r.key[: -len(".out")] + ".in") if r.key.endswith(".out") else None


def _one_input(run: list[Record], ref_ins: dict) -> bool:
    """The reference projections of `run` are siblings (one parent module) that read one tensor:
    what an engine fuses into one projection (q / k / v of one input, gate / up)."""

    parents = {(r.module_path or "").rsplit(".", 1)[0] for r in run}
    if len(parents) != 1:
        return False
    ins = [_input_of(r, ref_ins) for r in run]
    if not all(x.has_payload for x in ins):
        return False
    first = ins[0].load()
    return all(_same_values(first, x.load()) for x in ins[1:])


def _same_values(a, b) -> bool:
    """One shape, one dtype, equal values (NaN never equal)."""
    import numpy as np

    return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))


def _same_tokens(rs: tuple, ts: tuple, packed: bool) -> bool:
    """Leading (token) dims of a reference and a target record that hold the same tokens: equal, or,
    when a token layout relates the two sides (`packed`), a packed target's `[T]` / `[1, T]` rows
    of at most the padded reference's `B · S`."""
    if rs[:-1] == ts[:-1]:
        return True
    lead = ts[1:-1] if len(ts) == 3 and ts[0] == 1 else ts[:-1]
    return packed and len(rs) >= 3 and len(lead) == 1 and lead[0] <= math.prod(rs[:-1])


def _runs(outs: list[Record], t: Record, t_in: Record, ref_ins: dict, packed: bool) -> list[list[Record]]:
    """Every run of reference projection outputs in capture order whose widths add up to `t`'s, of
    its tokens (`_same_tokens`), each reading an input of `t_in`'s, siblings reading one tensor;
    projections of another input between them are passed over (an up-projection the reference
    calls between the two down-projections an engine fuses)."""
    ts, found = tuple(t.shape or ()), []
    t_in_shape = tuple(t_in.shape or ())
    for i in range(len(outs)):
        run, width = [], 0
        for r in outs[i:]:
            rs, r_in = tuple(r.shape or ()), _input_of(r, ref_ins)
            if not rs or not _same_tokens(rs, ts, packed) or r_in is None:
                break  # a role's projection counts too: the target's fused one has no role split
            r_in_shape = tuple(r_in.shape or ())
            if (
                not r_in_shape
                or r_in_shape[-1:] != t_in_shape[-1:]
                or not _same_tokens(r_in_shape, t_in_shape, packed)
            ):
                continue  # a projection of another input between the fused ones (q_b between q_a, kv_a)
            run.append(r)
            width += rs[-1]
            if width >= ts[-1]:
                break
        if len(run) >= 2 and width == ts[-1] and _one_input(run, ref_ins):
            found.append(run)
    return found


def _input_gap(run: list[Record], t_x, ref_ins: dict, layouts: tuple) -> float:
    """How far the run's one input is from the fused projection's (`t_x`, rel, through the token
    layouts where one side is packed), to choose among runs."""
    from ffdebug.comparison.align import align
    from ffdebug.comparison.metrics import compare_tensors

    r_x = _input_of(run[0], ref_ins).load()
    if tuple(r_x.shape) != tuple(t_x.shape):
        aligned = align(r_x, t_x, *layouts)
        if aligned is None:
            return float("inf")
        r_x, t_x = aligned[0], aligned[1]
    m = compare_tensors(r_x, t_x)
    return m.rel if m.rel is not None else float("inf")


def _writes(records: list[Record]) -> tuple[list[Record], dict[int, list[Record]]]:
    """The first record of each key (of one shape and io), and the later ones that write it again
    (a child's output and its projection's: one tensor), by id of the first."""
    firsts: list[Record] = []
    again: dict[int, list[Record]] = {}
    for r in records:
        first = next((o for o in firsts if o.key == r.key and o.shape == r.shape and o.io == r.io), None)
        if first is None:
            firsts.append(r)
        else:
            again.setdefault(id(first), []).append(r)
    return firsts, again


def _own_columns(run: list[Record], width: int) -> list[tuple[int, int]] | None:
    """The columns of a fused output of `width` each record of `run` stands for: one after the other
    in capture order for separate projections; the columns a role split took (`split`) when the
    records are pieces of one projection of that width (a SwiGLU's gate is its second half, read
    first); None when such a piece holds several runs of columns (`split_cols`)."""
    extras = [r.extra or {} for r in run]
    if any("split_cols" in e for e in extras):
        return None
    splits = [e.get("split") for e in extras]
    whole = [(e.get("orig_shape") or [None])[-1] for e in extras]
    if all(isinstance(x, list) and len(x) == 2 for x in splits) and set(whole) == {width}:
        return [(int(x[0]), int(x[1])) for x in splits]
    out, lo = [], 0
    for r in run:
        out.append((lo, lo + r.shape[-1]))
        lo += r.shape[-1]
    return out


def _fused_parts(
    refs: list[Record], tgts: list[Record], layer_tgts: list[Record], layouts: tuple
) -> list[tuple[Record, Record]]:
    """A target projection's output (a fused one no role split: its input was dumped too) whose
    last dim is the sum of those of consecutive reference projections' outputs (siblings reading
    one tensor of the fused one's input shape: the projections it fuses, in capture order); of
    several such runs, the one whose input is nearest the fused projection's, within `INPUT_REL`.
    Each reference output is paired with its columns of the fused one, and each of their inputs
    with its one input (`layer_tgts`: the layer's target records, paired or not; `layouts`: the
    call's token layouts, `comparison.align.layouts`). Of two fused outputs that could take one
    run, the one whose input is nearer it takes it."""
    packed = any(layouts)
    outs, repeats = _writes([r for r in refs if r.io == "out"])
    ref_ins = {r.key: r for r in refs if r.io == "in"}
    firsts, t_repeats = _writes(tgts)  # the target's k-th write meets the reference's k-th
    position = {id(r): i for i, r in enumerate(outs)}
    options = []  # (input gap, capture position, target output, its input, run)
    for at, t in enumerate(firsts):
        ts = tuple(t.shape or ())
        if t.io != "out" or len(ts) < 2 or (t.extra or {}).get("sketch") is not None or not _by_path(t):
            continue
        t_in = next((x for x in layer_tgts if x.io == "in" and x.module_path == t.module_path), None)
        if t_in is None or not t_in.has_payload:
            continue  # no projection (its input was not dumped): nothing says what it fuses
        candidates = _runs(outs, t, t_in, ref_ins, packed)
        t_x = t_in.load() if candidates else None
        for run in candidates:
            if (g := _input_gap(run, t_x, ref_ins, layouts)) <= INPUT_REL:
                options.append((g, _partial(run, outs), at, position[id(run[0])], t, t_in, run))
    # nearest inputs claim first: a fused q / k / v reads what its parts read (gap ~0), where an
    # MLP's up-projection of the same width meets another layer's q / k only roughly; at equal
    # gaps (layers that leave their input unchanged) a run of all its parent's projections first,
    # then capture order
    out, taken, done = [], set(), set()
    for *_, at, _, t, t_in, run in sorted(options, key=lambda o: o[:4]):
        if at in done or any(id(r) in taken for r in run):
            continue
        cols = _own_columns(run, tuple(t.shape)[-1])
        if cols is None:
            continue  # pieces of one projection in a layout of their own (per-head runs): not guessed
        done.add(at)
        out += _columns_of(t, t_in, run, cols, repeats, t_repeats.get(id(t), []), ref_ins, taken, packed)
    return out


def _partial(run: list[Record], outs: list[Record]) -> bool:
    """Whether `run` leaves out projections of its parent module (q / k of a q / k / v)."""
    parent = (run[0].module_path or "").rsplit(".", 1)[0]
    return len(run) < sum((r.module_path or "").rsplit(".", 1)[0] == parent for r in outs)


def _columns_of(t, t_in, run, cols, repeats, t_writes, ref_ins, taken: set, packed: bool) -> list:
    """Each reference output of `run` with its columns `cols` of the fused target output `t` (every
    write of it with the reference's own repeat), and their inputs with `t_in`; marks them taken."""
    import dataclasses

    out = []
    ts = tuple(t.shape)
    writes = [t, *t_writes]
    for r, (lo, hi) in zip(run, cols):
        for i, same in enumerate([r, *repeats.get(id(r), [])]):
            w = writes[min(i, len(writes) - 1)]
            part = dataclasses.replace(
                w, key=f"{w.key}[{lo}:{hi}]", shape=(*ts[:-1], hi - lo), stats=None, source=_Part(w, lo, hi)
            )
            out.append((same, part))
            taken.add(id(same))
    for r in {id(x): x for x in (_input_of(r, ref_ins) for r in run)}.values():
        if id(r) not in taken and _same_tokens(tuple(r.shape or ()), tuple(t_in.shape or ()), packed):
            out.append((r, t_in))
            taken.add(id(r))
    return out


def by_position(rg: CallGroup, tg: CallGroup, sp: StagePairing) -> StagePairing:
    """Records still left on both sides inside one layer, paired by where they were captured: a
    fused projection's output first, column by column with the projections it fuses
    (`_fused_parts`); then the rest, when the longest run of records that fit each other (`_fits`)
    in both capture orders is all of them. Two codebases whose children role naming could not
    place by name still write the same tensors in the same order; the pair's note names the
    target's key."""
    from ffdebug.comparison.align import layouts

    token_layouts = layouts(rg, tg)
    by_layer: dict[int, tuple[list[Record], list[Record]]] = {}
    layer_tgts: dict[int, list[Record]] = {}
    for t in [u.target for u in sp.units] + list(sp.only_target):
        if t.layer is not None:
            layer_tgts.setdefault(t.layer, []).append(t)
    for side, records in enumerate((sp.only_ref, sp.only_target)):
        for r in {id(r): r for r in records}.values():  # a record listed twice is one record
            if r.layer is not None and r.has_payload:
                by_layer.setdefault(r.layer, ([], []))[side].append(r)
    pairs = []
    for layer, (refs, tgts) in by_layer.items():
        if refs and tgts:
            # fused outputs first: their parts' shapes would otherwise pair with look-alikes
            found = _fused_parts(refs, tgts, layer_tgts.get(layer, []), token_layouts)
            used_r, used_t = {id(r) for r, _ in found}, {id(whole_of(t)) for _, t in found}
            left_r = [r for r in refs if id(r) not in used_r]
            left_t = [t for t in tgts if id(t) not in used_t]
            common = _common_order(left_r, left_t)
            # only a whole alignment: the two layers' leftovers are one sequence of like records
            # (a partial one pairs look-alikes where the two sides read the block differently)
            whole = len(common) == len(left_r) == len(left_t)
            pairs += found + (common if whole else [])
    return _with_pairs(
        rg, sp, [(r, t, f"paired by position in layer {r.layer}: target {t.key}") for r, t in pairs]
    )
