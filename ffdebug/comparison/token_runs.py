"""Which sequences and tokens of a layer stage are wrong, in the reference's coordinates (docs/comparing.md
"Comparing", token runs).

A token's error is taken over everything it holds at the stage (channels, heads):

    rel[b, s] = ‖t[b, s] − r[b, s]‖ / ‖r[b, s]‖

and its state is `exact` (bit-equal), `within` (rel within the ok band, `verdict.REL_BANDS`: 1%) or
`wrong`. A packed side's rows are put back where the padded reference holds them (the token mask
that aligned the two, `comparison/align.py`), so `sequence` is the reference's batch row and
`tokens` its positions, whichever side is packed. Consecutive tokens of one sequence in one state
are one run `{"sequence": b, "tokens": [first, last], "state": ...}`; at most `CAP` runs are kept
(`token_runs_left_out` counts the rest). The sentence names the wrong runs and the sequences with
no wrong token: "sequence 1, tokens 0-6 wrong; sequence 0 exact".
"""

from __future__ import annotations

from ffdebug import verdict as V

CAP = 32
EXACT, WITHIN, WRONG = "exact", "within", "wrong"


def states(d2, r2) -> list[str]:
    """The state of each token from its Σ(t − r)² and Σ r² (float64 tensors of one shape)."""
    ok_rel = V.REL_BANDS[0][0]
    out = []
    for d, r in zip(d2.reshape(-1).tolist(), r2.reshape(-1).tolist()):
        if d == 0.0:
            out.append(EXACT)
        else:
            out.append(WITHIN if r > 0 and (d / r) ** 0.5 <= ok_rel else WRONG)
    return out


def runs(cells: list[tuple[int, int, str]]) -> list[dict]:
    """Runs of (sequence, token, state) cells, each sequence's tokens in order."""
    out: list[dict] = []
    for b, s, state in sorted(cells):
        last = out[-1] if out else None
        if last and last["sequence"] == b and last["state"] == state and last["tokens"][1] == s - 1:
            last["tokens"][1] = s
        else:
            out.append({"sequence": b, "tokens": [s, s], "state": state})
    return out


def of_padded(d2, r2) -> list[dict]:
    """Runs of a `[batch, token]` pair of row sums (every position a token)."""
    batch, seq = d2.shape[0], d2.shape[1]
    st = states(d2, r2)
    return runs([(b, s, st[b * seq + s]) for b in range(batch) for s in range(seq)])


def of_packed(d2, r2, coords) -> list[dict]:
    """Runs of a packed `[T]` pair of row sums; `coords[i]` is row i's (sequence, token)."""
    st = states(d2, r2)
    return runs([(int(b), int(s), state) for (b, s), state in zip(coords.tolist(), st)])


def capped(all_runs: list[dict]) -> tuple[list[dict], int]:
    return all_runs[:CAP], max(0, len(all_runs) - CAP)


def sentence(token_runs: list[dict] | None) -> str | None:
    """`sequence 1, tokens 0-6 wrong; sequence 0 exact`, or None when no sequence is wrong or
    every token is (the stage's numbers say that already)."""
    if not token_runs:
        return None
    by_seq: dict[int, list[dict]] = {}
    for r in token_runs:
        by_seq.setdefault(r["sequence"], []).append(r)
    wrong = [r for r in token_runs if r["state"] == WRONG]
    if not wrong or all(r["state"] == WRONG for r in token_runs):
        return None
    parts = []
    for b, rs in by_seq.items():
        bad = [r for r in rs if r["state"] == WRONG]
        if bad:
            spans = ", ".join(_span(r["tokens"]) for r in bad[:4]) + (" …" if len(bad) > 4 else "")
            parts.append(
                f"sequence {b}, token{'s' if len(bad) > 1 or bad[0]['tokens'][0] != bad[0]['tokens'][1] else ''} {spans} wrong"
            )
    for b, rs in by_seq.items():
        if not any(r["state"] == WRONG for r in rs):
            kinds = {r["state"] for r in rs}
            parts.append(f"sequence {b} {'exact' if kinds == {EXACT} else 'within 1%'}")
    return "; ".join(parts)


def _span(tokens: list[int]) -> str:
    lo, hi = tokens
    return f"{lo}" if lo == hi else f"{lo}-{hi}"
