"""Per-layer error budget and the pattern of a divergence (DESIGN §5).

For every layer L with a block input and output dumped on both sides (rel against the reference):

    rel_in(L)  = rel of L's hidden_in          (error the layer inherits)
    rel_out(L) = rel of L's hidden_out         (error it passes on)
    added(L)   = rel_out(L) - rel_in(L)        (error it adds; DESIGN: error out - error in)

A layer *introduces* error when `added` is beyond noise: above k x the noise run's added error
(k = 2 for fp32, 3 for bf16/fp16) when a noise run is given, else above 0, and in both cases above
10% of what the layer inherits (a healthy layer fed a slightly wrong input passes the error on
roughly unchanged; the residual stream usually dilutes it). When attribution re-ran the layers on
the reference's inputs, its verdict (local / inherited) replaces this estimate.

Pattern, in this order:
  match       no layer introduces error;
  layer_class two or more layers introduce error, all of one class, while the layers of the other
              classes stay at noise (needs two classes or more);
  jump        one layer introduces far more than the rest (10x the next), or it is the first to
              show any error after an exactly equal prefix in the same dtype;
  drift       otherwise: error present from the first layer, growing smoothly.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

LOW_PRECISION = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
INHERIT_SHARE = 0.1  # a layer must add more than this share of the error it inherits
JUMP_RATIO = 10.0  # one layer adds this many times more than any other: a jump

_LAYER_KEY = re.compile(r"^L(\d+)\.(hidden_in|hidden_out)$")


@dataclass
class LayerRow:
    """One layer's error budget."""

    layer: int
    layer_class: str | None
    rel_in: float | None = None
    rel_out: float | None = None
    cos_in: float | None = None
    cos_out: float | None = None
    added: float | None = None
    severity: str = "ok"  # of hidden_out (bands, after noise)
    exact_in: bool = False  # hidden_in bit-equal, same dtype on both sides
    exact_out: bool = False
    noise_added: float | None = None
    noise_rel_out: float | None = None
    local: str | None = None  # attribution verdict: "local" | "inherited" | None (not run)
    introduces: bool = False
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def noise_factor(stage: dict) -> float:
    dtypes = (stage.get("dtype_ref"), stage.get("dtype_target"))
    return 3.0 if any(d in LOW_PRECISION for d in dtypes) else 2.0


def is_exact(e: dict | None) -> bool:
    """Bit-equal and of the same dtype on both sides."""
    return (
        e is not None
        and e.get("bit_equal") == 1.0
        and e.get("dtype_ref") == e.get("dtype_target")
        and e.get("severity") == "ok"
    )


def layer_rows(stages: list[dict]) -> list[LayerRow]:
    """Layer error budgets from the stage entries of one paired call (execution order)."""
    ins: dict[int, dict] = {}
    outs: dict[int, dict] = {}
    for e in stages:
        m = _LAYER_KEY.match(e["key"])
        if not m or (e.get("invocation") or 0) != 0:
            continue
        target = ins if m.group(2) == "hidden_in" else outs
        target.setdefault(int(m.group(1)), e)
    rows: list[LayerRow] = []
    prev_out: dict | None = next((e for e in stages if e["key"] == "embed.out"), None)
    for layer in sorted(set(ins) | set(outs)):
        e_in, e_out = ins.get(layer, prev_out), outs.get(layer)
        cls = (e_out or e_in or {}).get("layer_class")
        row = LayerRow(layer=layer, layer_class=cls)
        if e_in is not None:
            row.rel_in, row.cos_in, row.exact_in = e_in.get("rel"), e_in.get("cos"), is_exact(e_in)
        elif not rows:
            row.rel_in, row.cos_in, row.exact_in = 0.0, 1.0, True
            row.notes.append("no block input dumped: assumed exact")
        if e_out is not None:
            row.rel_out, row.cos_out = e_out.get("rel"), e_out.get("cos")
            row.severity, row.exact_out = e_out["severity"], is_exact(e_out)
            if e_out.get("noise_rel") is not None:
                row.noise_rel_out = e_out["noise_rel"]
                n_in = (e_in or {}).get("noise_rel") or 0.0
                row.noise_added = e_out["noise_rel"] - n_in
        if row.rel_in is not None and row.rel_out is not None:
            row.added = row.rel_out - row.rel_in
        rows.append(row)
        prev_out = e_out
    return rows


def mark_introducing(rows: list[LayerRow], stages_by_key: dict[str, dict]) -> None:
    """Set `row.introduces` from attribution where it ran, else from the error budget."""
    for row in rows:
        if row.local is not None:
            row.introduces = row.local == "local"
            continue
        if row.added is None:
            row.introduces = row.severity != "ok"
            continue
        out = stages_by_key.get(f"L{row.layer:03d}.hidden_out") or {}
        k = noise_factor(out)
        floor = 0.0
        if row.noise_added is not None:
            floor = k * max(row.noise_added, 0.0)
            if row.rel_out is not None and row.noise_rel_out is not None:
                if row.rel_out <= k * row.noise_rel_out:
                    row.introduces = False
                    continue
        row.introduces = row.added > max(floor, INHERIT_SHARE * (row.rel_in or 0.0))


@dataclass
class Pattern:
    name: str  # match | layer_class | jump | drift
    focus: LayerRow | None  # the layer the pattern points at
    introducing: list[int]
    reason: str
    clean_prefix: bool = False  # every earlier layer exactly equal, same dtype


def decide(rows: list[LayerRow]) -> Pattern:
    """The pattern of the error budget, in DESIGN order: match, layer_class, jump, drift."""
    intro = [r for r in rows if r.introduces]
    if not intro:
        return Pattern("match", None, [], "no layer introduces error beyond noise")
    first = intro[0]
    clean = first.exact_in and first is not rows[0]
    classes = {r.layer_class for r in rows}
    intro_classes = {r.layer_class for r in intro}
    if len(intro) >= 2 and len(classes) >= 2 and len(intro_classes) == 1:
        cls = first.layer_class
        n_cls = sum(1 for r in rows if r.layer_class == cls)
        return Pattern(
            "layer_class",
            first,
            [r.layer for r in intro],
            f"{len(intro)} of the {n_cls} {cls} layers introduce error while the other classes stay at noise",
            clean,
        )
    added = sorted(((r.added or 0.0), r.layer) for r in intro)
    top_added, top_layer = added[-1]
    others = [max(r.added or 0.0, 0.0) for r in rows if r.layer != top_layer]
    top = next(r for r in rows if r.layer == top_layer)
    if clean:
        return Pattern(
            "jump",
            first,
            [r.layer for r in intro],
            "error appears from exactly equal inputs (same dtype) at this layer",
            True,
        )
    if len(intro) == 1 or top_added >= JUMP_RATIO * max(others or [0.0]):
        ratio = top_added / max(others) if others and max(others) > 0 else float("inf")
        why = "the only layer that introduces error" if len(intro) == 1 else f"adds {ratio:.3g}x the next"
        return Pattern("jump", top, [r.layer for r in intro], why)
    return Pattern(
        "drift",
        first,
        [r.layer for r in intro],
        f"{len(intro)} layers add comparable error from layer {first.layer} on",
    )
