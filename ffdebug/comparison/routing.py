"""Routing flips: rounding that sends a token to another expert is precision, not a bug.

In a mixture-of-experts layer a token whose router scores hold two nearly equal values takes a
different expert on the two sides as soon as rounding moves the scores by more than their gap.
That token's branch output then differs by tens of percent, and everything downstream carries the
difference, while nothing is wrong: the zoo's MoE architectures in bf16 against fp32 all show it
(docs/bisect.md, "Calibration"). What tells a flip from a routing bug is in the scores themselves,
so the rule reads them; no stage or module name is consulted.

Per paired call, in execution order:

- a *score stage* is a floating stage inside a layer with one row of E values per token (2 <= E
  <= `MAX_SCORES`, E at most a quarter of the width of the layer's hidden stages);
- a token *can flip* at it when two of its scores next to each other in the reference's ranking,
  within the top half, are closer than the two sides' movements of them together: the sides may
  order them either way, or tie them (`topk` breaks ties as it likes), while the score stage
  itself agrees on the other tokens (rel within the drift band);
- a flip is *confirmed* by a later stage of the same layer outside the ok band: the token rows
  whose error stands out there (`HOT` x the median row's) that flipped are left out, and that must
  bring the stage below diverge, with at most `MAX_FLIPPED` of the tokens left out in all (a router
  that is wrong moves many tokens, an expert that is wrong leaves tokens that did not flip);
- from the first flip on, every later stage of the call with one row per token is measured on the
  rows of tokens that never flipped: cos / rel / elem / max_abs are those of the kept rows, the
  whole-tensor numbers go into a note, `flipped_tokens` lists the rows left out, and the stage is
  graded again by the bands and the element-wise rule (the noise rules of `--noise` are not
  applied again to these numbers).

A bug in an expert (the scores agree, no token flips) or in the router (its scores disagree
beyond the drift band, or many tokens flip) is left as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ffdebug import verdict as V
from ffdebug.arrays import as_float64, is_floating
from ffdebug.results import StageResult

MAX_SCORES = 1024  # a score stage has at most this many values per token (the expert count)
MAX_FLIPPED = 0.25  # and no more than this share of the tokens flips at it
HOT = 10.0  # a token row whose error is this many times the median row's carries a flip


def _rows(shape, n_tokens: int) -> bool:
    """The tensor holds one row per token: some of its leading dims multiply to `n_tokens`
    (`[B, S, H]`, `[B, S, heads, head_dim]`, `[B·S, H]`)."""
    return bool(shape) and any(math.prod(shape[:k]) == n_tokens for k in range(1, len(shape)))


def flipped_rows(ref, target, skip: set[int]) -> tuple[list[int], float | None]:
    """Tokens (rows of `[N, E]` scores) whose choice of experts the two sides' difference can
    change, and the rel of the scores over the rows neither flipped nor in `skip`.

    A token can flip when two scores next to each other in the reference's ranking, within its
    top half, are closer than the two sides' movements of them together (r_a - r_b <=
    |t_a - r_a| + |t_b - r_b|): the sides may order them either way, or tie them, which `topk`
    breaks as it likes."""
    import numpy as np

    r, t = as_float64(ref), as_float64(target)
    n, e = r.shape
    top = min(max(1, e // 2), e - 1)
    # descending, a NaN first (as torch's sort ranks it), ties in column order
    order = np.argsort(np.where(np.isnan(r), -np.inf, -r), axis=-1, kind="stable")
    moved = np.abs(t - r)
    above, below = order[:, :top], order[:, 1 : top + 1]
    gap = np.take_along_axis(r, above, 1) - np.take_along_axis(r, below, 1)
    reach = np.take_along_axis(moved, above, 1) + np.take_along_axis(moved, below, 1)
    near = (gap <= reach).any(-1)
    out = [row for row in np.flatnonzero(near).tolist() if row not in skip]
    keep = [i for i in range(n) if i not in skip and i not in out]
    if not keep:
        return out, None
    kr, kt = r[keep], t[keep]
    norm = _norm(kr)
    return out, (_norm(kt - kr) / norm if norm > 0 else None)


def _norm(x) -> float:
    """‖x‖ of a float64 array (all its elements)."""
    import numpy as np

    flat = x.reshape(-1)
    return math.sqrt(float(np.dot(flat, flat)))


def explain(
    stages: list[StageResult],
    records: list[tuple],
    thresholds: tuple[V.Threshold, ...],
    load: Callable,
) -> None:
    """Apply the rule (module doc) to the stages of every call, in place."""
    calls: dict[tuple, list[int]] = {}
    for i, e in enumerate(stages):
        step = tuple(sorted((str(k), str(v)) for k, v in e.step.items()))
        calls.setdefault((step, e.phase, e.call, e.rank), []).append(i)
    import numpy as np

    with np.errstate(all="ignore"):  # -inf scores (masked experts) make NaN gaps: compared as such
        for idx in calls.values():
            _explain_call([stages[i] for i in idx], [records[i] for i in idx], thresholds, load)


def _hidden_width(stages: list[StageResult]) -> dict[int, tuple[int, int]]:
    """Per layer: (tokens, width) of its hidden stages (`hidden_in` / `hidden_out`)."""
    out = {}
    for e in stages:
        if e.layer is not None and e.stage in ("hidden_in", "hidden_out") and e.ref.shape:
            shape = e.ref.shape
            out.setdefault(e.layer, (math.prod(shape[:-1]), shape[-1]))
    return out


def _usable(e: StageResult, pair: tuple) -> bool:
    r, t = pair
    return (
        not e.per_rank
        and e.ref.shape is not None
        and e.ref.shape == e.target.shape
        and r.has_payload
        and t.has_payload
        and e.rel is not None
    )


def hot_rows(ref, target, n_tokens: int, skip: set[int]) -> set[int]:
    """Token rows whose error stands out: more than `HOT` x the median row's (rows in `skip` left
    out), measured against the rms row norm of the reference."""
    import numpy as np

    r, t = as_float64(ref).reshape(n_tokens, -1), as_float64(target).reshape(n_tokens, -1)
    rows = [i for i in range(n_tokens) if i not in skip]
    if len(rows) < 2:
        return set()
    scale = _norm(r[rows]) / math.sqrt(len(rows))
    if scale == 0.0:
        return set()
    d = t - r
    err = np.sqrt(np.einsum("ij,ij->i", d, d)) / scale
    kept = err[rows]
    if np.isnan(kept).any():
        return set()  # a row without a number has no median to stand out from
    kept = np.sort(kept)
    median = float(kept[(len(kept) - 1) // 2])  # the lower median of an even count
    return {i for i in rows if float(err[i]) > HOT * median and float(err[i]) > 0.0}


def _explain_call(stages, records, thresholds, load) -> None:
    widths = _hidden_width(stages)
    if not widths:
        return
    n_tokens = next(iter(widths.values()))[0]
    depth_after = max(widths) + 2
    confirmed: set[int] = set()
    pending: dict[int, dict[int, StageResult]] = {}  # layer -> {token row: the score stage it flipped at}
    flipped_at: dict[int, tuple[StageResult, set[int]]] = {}  # the score stages tokens flipped at
    for e, pair in zip(stages, records):
        if not _usable(e, pair) or not _rows(e.ref.shape, n_tokens):
            continue
        candidates = pending.get(e.layer, {}) if e.layer is not None else {}
        if not (confirmed or candidates or _score_stage(e, widths, n_tokens)):
            continue
        r, t = (load(x) for x in pair)  # read once: every measure below is of this pair
        graded = (
            _measure(e, r, t, sorted(confirmed), n_tokens, thresholds, depth_after) if confirmed else None
        )
        if candidates and (graded[1] if graded is not None else e.severity) is not V.Severity.OK:
            hot = hot_rows(r, t, n_tokens, confirmed) & set(candidates)
            trial = sorted(confirmed | hot)
            if hot and len(trial) <= MAX_FLIPPED * n_tokens:
                tried = _measure(e, r, t, trial, n_tokens, thresholds, depth_after)
                if tried is not None and not tried[1].at_least(V.Severity.DIVERGE):
                    confirmed |= hot
                    graded = tried
                    for at in {id(candidates[i]): candidates[i] for i in hot}.values():
                        mine = {i for i in hot if candidates[i] is at} | flipped_at.get(
                            id(at), (None, set())
                        )[1]
                        flipped_at[id(at)] = (at, mine)
        if graded is not None:
            _regrade(e, graded, sorted(confirmed))
        if _score_stage(e, widths, n_tokens):
            scores = e.ref.shape[-1]
            rows, kept_rel = flipped_rows(r.reshape(n_tokens, scores), t.reshape(n_tokens, scores), confirmed)
            if rows and kept_rel is not None and not V.rel_band(kept_rel).at_least(V.Severity.DIVERGE):
                pending.setdefault(e.layer, {}).update({i: e for i in rows})
    _gathered_after_flip(stages, flipped_at, n_tokens)
    for at, tokens in flipped_at.values():
        rows = ", ".join(map(str, sorted(tokens)))
        at.notes.append(
            f"routing flip: token row(s) {rows} order near-tied scores differently on the two "
            "sides (their gap is within the sides' difference) and carry the error after it: "
            "later stages are measured on the other tokens"
        )


def _gathered_after_flip(stages: list[StageResult], flipped_at: dict, n_tokens: int) -> None:
    """Stages after the first confirmed flip whose rows are not one per token (an expert's
    gathered rows where the record does not say which token each is, `align.by_routed_tokens`):
    the two sides gathered other tokens there, so their rows are not comparable; one outside the
    ok band is left at drift with a note (the tokens' routing is judged at the score stage)."""
    if not flipped_at:
        return
    index = {id(e): i for i, e in enumerate(stages)}
    start = min(index[id(at)] for at, _ in flipped_at.values())
    tokens = sorted({t for _, rows in flipped_at.values() for t in rows})
    for e in stages[start + 1 :]:
        shapes = (e.ref.shape, e.target.shape)
        if e.ok or e.layer is None or any(not sh or _rows(sh, n_tokens) for sh in shapes):
            continue
        if e.finding not in (None, "shape_mismatch"):
            continue
        e.severity = V.Severity.DRIFT
        e.notes.append(
            f"rows gathered by a routing that flipped (token row(s) {', '.join(map(str, tokens))}): the "
            "two sides hold other tokens' rows here, so they are not compared row by row"
        )


def may_explain(stages: list[StageResult]) -> bool:
    """Whether `explain` can act on these stages of one call (rank by rank): some stage holds one
    row of expert scores per token. Reads only shapes and dtypes (a compare across nodes keeps
    such a call on one process, `ffdebug.across.run.plan`)."""
    widths = _hidden_width(stages)
    if not widths:
        return False
    n_tokens = next(iter(widths.values()))[0]
    return any(_score_stage(e, widths, n_tokens) for e in stages)


def _score_stage(e: StageResult, widths: dict[int, tuple[int, int]], n_tokens: int) -> bool:
    """One row of E scores per token, E from 2 to `MAX_SCORES` and at most a quarter of the layer's
    hidden width (a router's expert scores, not a projection's output), of a floating dtype (the
    expert ids a top-k picks are no scores)."""
    if e.layer is None or e.layer not in widths or math.prod(e.ref.shape[:-1]) != n_tokens:
        return False
    if "float" not in (e.dtype_ref or ""):
        return False
    scores = e.ref.shape[-1]
    return 2 <= scores <= MAX_SCORES and 4 * scores <= widths[e.layer][1]


def _measure(e: StageResult, r, t, flipped: list[int], n_tokens: int, thresholds, depth_after: int):
    """`e`'s metrics (tensors `r`, `t`) over the token rows outside `flipped`, the grade they give
    (bands, the element-wise rule: what confirms a flip) and the grade they are reported with
    (the amplified-precision rule applied too), or None when there is nothing left to measure."""
    import numpy as np

    from ffdebug.comparison.metrics import compare_tensors

    if not (is_floating(r.dtype) and is_floating(t.dtype)):
        return None
    r2, t2 = r.reshape(n_tokens, -1), t.reshape(n_tokens, -1)
    keep = np.ones(n_tokens, dtype=bool)
    keep[flipped] = False
    if not bool(keep.any()):
        return None
    m = compare_tensors(r2[keep], t2[keep])
    if m.rel is None:
        return None
    depth = e.layer + 1 if e.layer is not None else (0 if e.key.startswith("embed.") else depth_after)
    scale = V.elem_scale(depth, *e.judged_dtypes)
    severity = V.classify(m.cos, m.rel, e.key, thresholds, m.elem, m.max_abs, scale)
    amplified = V.matching_threshold(e.key, thresholds) is None and V.amplified_precision(
        severity, m.cos, m.rel, m.norm_ratio, *e.judged_dtypes
    )
    reported = V.Severity.DRIFT if amplified else severity
    return tuple([m] + [V.nonfinite(g, m.nan_mismatch, m.inf_mismatch) for g in (severity, reported)])


def _regrade(e: StageResult, graded: tuple, flipped: list[int]) -> None:
    """`e` measured on the token rows outside `flipped` (`_measure`), and graded again (module doc)."""
    m, _, severity = graded
    if e.flipped_tokens is None:
        whole = f"rel {e.rel:.3g}" + (f", cos {e.cos:.6g}" if e.cos is not None else "")
        e.notes.append(
            "measured without the token row(s) that took another expert (routing flip); "
            f"whole tensor: {whole}"
        )
    e.cos, e.rel, e.rel_diff, e.max_abs, e.elem = m.cos, m.rel, m.rel_diff, m.max_abs, m.elem
    e.norm_ratio = m.norm_ratio
    e.severity = severity
    e.flipped_tokens = list(flipped)
