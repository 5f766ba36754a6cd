"""The input gate before numerics (docs/architecture.md "The input gate").

Only external inputs are gated, and only on the first call of each step-tag group: token ids
(`embed.input_ids`, `embed.decoder_input_ids`), `embed.pixel_values`, `embed.attention_mask`,
`embed.position_ids`. A mismatch there is exit 3 naming the input; "fix tokenization first" is
said for token ids only. Latents and timesteps are never gated: they are compared as stages. A
floating input of two dtypes (fp32 pixels against the bf16 run's bf16 pixels) is compared in the
lower precision: the same input rounded to the run's dtype is the same input.

Token ids that match at a group's first call and differ at a later one are not a tokenization
error: the generation itself diverged (a decode step chose another token). `gate_inputs` returns
the earliest such call; compare then compares the calls before it and fails.
"""

from __future__ import annotations

from ffdebug.arrays import as_float64, eps, first_difference, is_complex, is_floating, round_to
from ffdebug.capture.inputs import GATED
from ffdebug.comparison.align import MASK_KEY, align, layouts
from ffdebug.errors import FFDebugError, InputIdsMismatch
from ffdebug.results.stages import GenerationDivergence

IDS_KEY = "embed.input_ids"


def _load(rec, label: str):
    """One side's input: NaN / Inf in token ids means a damaged dump."""
    import numpy as np

    t = rec.load()
    if rec.key in (IDS_KEY, "embed.decoder_input_ids") or rec.extra.get("input_ids"):
        values = t if is_complex(t.dtype) else as_float64(t) if is_floating(t.dtype) else None
        if values is not None and not bool(np.isfinite(values).all()):
            raise FFDebugError(
                f"{rec.origin or rec.key}: the {label} side's {rec.key} holds NaN / Inf ({t.dtype}); token ids "
                "are integers — the dump is damaged, re-run it"
            )
    return t


def _gated_records(group) -> dict:
    """key -> record of the gated inputs of one call (token ids, pixels, mask, positions)."""
    out = {}
    if group.input_ids is not None:
        out[IDS_KEY] = group.input_ids
    if group.token_mask is not None:
        out[MASK_KEY] = group.token_mask
    for sk in group.order:
        if sk[0] in GATED and sk[0] not in out:
            out[sk[0]] = group.records[sk]
    return out


def _first_difference(r, t):
    """(position, ref value, target value) of the first element that differs, or a shape sentence."""
    if tuple(r.shape) != tuple(t.shape):
        return f"shape {list(r.shape)} vs {list(t.shape)}"
    if is_floating(r.dtype) and is_floating(t.dtype) and r.dtype != t.dtype:
        # a run in lower precision is fed the same input rounded to its dtype: compared there
        low = r.dtype if eps(r.dtype) > eps(t.dtype) else t.dtype
        r, t = round_to(r, low), round_to(t, low)
    return first_difference(r, t)


def _first_calls(pairs) -> set[int]:
    """ids of the reference groups that are the first call of their step-tag group."""
    first: dict[tuple, object] = {}
    for rg, _ in pairs:
        key = (rg.tags, rg.phase)
        best = first.get(key)
        if best is None or (rg.call or 0) < (best.call or 0):
            first[key] = rg
    return {id(g) for g in first.values()}


def gate_inputs(pairs) -> GenerationDivergence | None:
    """Raise InputIdsMismatch for a gated input that differs at a first call; return the earliest
    later call whose token ids differ (the generation diverged there), else None."""
    firsts = _first_calls(pairs)
    diverged: GenerationDivergence | None = None
    for rg, tg in pairs:
        where = f"call {rg.call}" + (f" {dict(rg.tags)}" if rg.tags else "")
        ref_in, tgt_in = _gated_records(rg), _gated_records(tg)
        first = id(rg) in firsts or rg.warmup
        for key in sorted(set(ref_in) | set(tgt_in), key=lambda k: (k != IDS_KEY, k)):
            spec = GATED.get(key)
            tokens = key == IDS_KEY or (spec is not None and spec.tokens)
            fix = "fix tokenization first" if tokens else f"feed both sides the same {key.split('.', 1)[1]}"
            if key not in ref_in or key not in tgt_in:
                if not tokens or not (first or key == IDS_KEY):
                    continue  # an input dumped by one side only: coverage reports it
                missing = "reference" if key not in ref_in else "target"
                raise InputIdsMismatch(
                    f"{key}: the {missing} side has no {key} for {where}; dump both sides with the same "
                    f"inputs ({fix})"
                )
            if not first and not tokens:
                continue  # later calls' pixels / masks / positions are compared as stages
            r, t = _load(ref_in[key], "reference"), _load(tgt_in[key], "target")
            if key == IDS_KEY and r.shape != t.shape:
                aligned = align(r, t, *layouts(rg, tg))
                if aligned is not None:
                    r, t = aligned[0], aligned[1]
            diff = _first_difference(r, t)
            if diff is None:
                continue
            if not first:  # a later call of a generation: a decode step chose another token
                if diverged is None or (rg.call or 0) < diverged.call:
                    pos, rv, tv = diff if isinstance(diff, tuple) else (None, None, None)
                    diverged = GenerationDivergence(rg.call or 0, dict(rg.tags), key, pos, rv, tv)
                break
            name = f"input ids ({key})" if key == IDS_KEY else key
            if isinstance(diff, str):
                raise InputIdsMismatch(f"{name} differ at {where}: {diff} ({fix})")
            pos, rv, tv = diff
            raise InputIdsMismatch(
                f"{name} differ at {where}, first at position {pos}: ref {rv} vs target {tv} ({fix})"
            )
    return diverged
