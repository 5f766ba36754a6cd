"""A self-contained HTML page for a bisect result: per-layer cos / rel curves per layer class
(inline SVG), the layer table, the stage table of the first bad layer, and the conclusion.

No scripts, no stylesheets or fonts from elsewhere, no external URL: the file opens offline and
can be attached to an issue. Takes the result's JSON dict (no torch).
"""

from __future__ import annotations

import html
import math

from ffdebug.verdict import Severity

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
SEV_COLOUR = {
    Severity.OK: "#2ca02c",
    Severity.DRIFT: "#c9a400",
    Severity.DIVERGE: "#ff7f0e",
    Severity.BUG: "#d62728",
    Severity.SCRAMBLE: "#9467bd",
}
W, H, ML, MR, MT, MB = 680, 260, 70, 150, 30, 40
REL_FLOOR = 1e-9


def _esc(x) -> str:
    return html.escape("" if x is None else str(x))


def _num(x, spec=".6f") -> str:
    if x is None:
        return "-"
    if spec == "%":
        return f"{x * 100:.3g}%"
    return format(x, spec)


def _plot(title: str, series: dict[str, list[tuple[int, float]]], log: bool, y_label: str, marks=()) -> str:
    """One SVG line plot; `series` maps a class to (layer, value) points."""
    pts = [p for s in series.values() for p in s if p[1] is not None]
    if not pts:
        return f'<p class="empty">{_esc(title)}: no data</p>'
    xs = [p[0] for p in pts]
    x0, x1 = min(xs), max(xs)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1

    def fy(v):
        return math.log10(max(v, REL_FLOOR)) if log else v

    ys = [fy(p[1]) for p in pts]
    y0, y1 = min(ys), max(ys)
    if y1 - y0 < 1e-12:
        y0, y1 = y0 - (1 if log else 1e-4), y1 + (1 if log else 1e-4)
    pw, ph = W - ML - MR, H - MT - MB

    def sx(x):
        return ML + (x - x0) / (x1 - x0) * pw

    def sy(v):
        return MT + (1 - (fy(v) - y0) / (y1 - y0)) * ph

    out = [
        f'<svg class="plot" width="{W}" height="{H}" viewBox="0 0 {W} {H}" role="img" '
        f'aria-label="{_esc(title)}">',
        f'<text x="{ML}" y="18" class="title">{_esc(title)}</text>',
        f'<rect x="{ML}" y="{MT}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>',
    ]
    for i in range(5):  # y ticks
        v = y0 + (y1 - y0) * i / 4
        y = MT + (1 - i / 4) * ph
        label = f"{10**v:.0e}" if log else f"{v:.5f}"
        out.append(f'<line x1="{ML - 4}" y1="{y:.1f}" x2="{ML}" y2="{y:.1f}" stroke="#999"/>')
        out.append(f'<text x="{ML - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{label}</text>')
    layers = sorted(set(xs))
    step = max(1, len(layers) // 12)
    for x in layers[::step]:
        out.append(f'<text x="{sx(x):.1f}" y="{H - MB + 16}" text-anchor="middle" class="tick">{x}</text>')
    out.append(f'<text x="{ML + pw / 2}" y="{H - 6}" text-anchor="middle" class="tick">layer</text>')
    out.append(
        f'<text x="14" y="{MT + ph / 2}" transform="rotate(-90 14 {MT + ph / 2})" '
        f'text-anchor="middle" class="tick">{_esc(y_label)}</text>'
    )
    for layer in marks:
        out.append(
            f'<line x1="{sx(layer):.1f}" y1="{MT}" x2="{sx(layer):.1f}" y2="{MT + ph}" '
            'stroke="#d62728" stroke-dasharray="4 3"/>'
        )
    legend = distinct_labels(list(series), LEGEND_WIDTH)
    for i, (cls, s) in enumerate(series.items()):
        colour = PALETTE[i % len(PALETTE)]
        s = [p for p in s if p[1] is not None]
        if not s:
            continue
        path = " ".join(f"{sx(x):.1f},{sy(v):.1f}" for x, v in s)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for x, v in s:
            out.append(
                f'<circle cx="{sx(x):.1f}" cy="{sy(v):.1f}" r="3.5" fill="{colour}">'
                f"<title>{_esc(cls)} layer {x}: {v:.6g}</title></circle>"
            )
        ly = MT + 14 + 18 * i
        out.append(f'<rect x="{W - MR + 12}" y="{ly - 9}" width="12" height="12" fill="{colour}"/>')
        out.append(
            f'<text x="{W - MR + 30}" y="{ly + 1}" class="legend"><title>{_esc(cls)}</title>'
            f"{_esc(legend[cls])}</text>"
        )
    out.append("</svg>")
    return "\n".join(out)


LEGEND_WIDTH = 18  # characters a legend entry has room for


def distinct_labels(names: list[str], width: int) -> dict[str, str]:
    """Each name cut to `width` characters, keeping its head and tail around an ellipsis, so that
    names that differ only at the end (`JointTransformerBlock[norm1_context=AdaLayerNormZero]` and
    `…Continuous]`) still differ; the tail grows until they do."""
    out: dict[str, str] = {}
    for tail in range(width // 2, width):
        head = width - tail - 1
        out = {n: n if len(n) <= width else f"{n[:head]}…{n[-tail:]}" for n in names}
        if len(set(out.values())) == len(set(names)):
            return out
    return {n: f"{i}:{out[n]}" for i, n in enumerate(names)}


def _table(headers: tuple[str, ...], rows: list[tuple[str, list]]) -> str:
    """An HTML table; each row is (severity, cells), the severity drawn in its colour first."""
    out = ["<table><tr><th></th>" + "".join(f"<th>{h}</th>" for h in headers) + "</tr>"]
    for sev, cells in rows:
        out.append(
            f'<tr><td style="color:{SEV_COLOUR.get(sev, "#000")}">{_esc(sev)}</td>'
            + "".join(f"<td>{c}</td>" for c in cells)
            + "</tr>"
        )
    out.append("</table>")
    return "\n".join(out)


def _stage_table(stages: list[dict]) -> str:
    rows = [
        (
            e["severity"],
            [
                _esc(e.get("layer")),
                _esc(e.get("layer_class")),
                _esc(e.get("stage") or e.get("key")),
                _num(e.get("cos")),
                _num(e.get("rel"), "%"),
                _num(e.get("max_abs"), ".3g"),
            ],
        )
        for e in stages
    ]
    return _table(("layer", "class", "stage", "cos", "rel", "max_abs"), rows)


def _layer_table(layers: list[dict]) -> str:
    rows = [
        (
            r["severity"],
            [
                str(r["layer"]),
                _esc(r.get("layer_class")),
                _num(r.get("cos_out")),
                _num(r.get("rel_in"), "%"),
                _num(r.get("rel_out"), "%"),
                _num(r.get("added"), "%"),
                "yes" if r.get("introduces") else "",
                _esc(r.get("local") or ""),
            ],
        )
        for r in layers
    ]
    headers = ("layer", "class", "cos out", "rel in", "rel out", "added", "introduces", "attribution")
    return _table(headers, rows)


CSS = """
body { font-family: sans-serif; margin: 24px; color: #222; max-width: 1100px; }
h1 { font-size: 20px; } h2 { font-size: 16px; margin-top: 28px; }
.conclusion { font-size: 15px; padding: 10px 14px; border-left: 5px solid #888; background: #f6f6f6; }
.FAILED { border-color: #d62728; } .PASSED { border-color: #2ca02c; }
table { border-collapse: collapse; font-size: 13px; } td, th { padding: 3px 9px; border-bottom: 1px solid #ddd; }
th { text-align: left; } td { font-family: monospace; }
svg .title { font-size: 13px; font-weight: bold; } svg .tick { font-size: 11px; fill: #444; }
svg .legend { font-size: 12px; }
"""


def bisect_html(data: dict) -> str:
    """The page for `BisectResult.to_json()`."""
    series_cos: dict[str, list] = {}
    series_rel: dict[str, list] = {}
    for r in data.get("layers", []):
        cls = r.get("layer_class") or "?"
        series_cos.setdefault(cls, []).append((r["layer"], r.get("cos_out")))
        series_rel.setdefault(cls, []).append((r["layer"], r.get("rel_out")))
    first = data.get("first_divergence") or {}
    marks = [first["layer"]] if first.get("layer") is not None else []
    word = "PASSED" if data.get("passed") else "FAILED"
    focus = [
        e
        for e in data.get("stages", [])
        if first.get("layer") is not None and e.get("layer") == first["layer"]
    ]
    per_class = "".join(
        f"<li><b>{_esc(c['layer_class'])}</b>: layers {_esc(c['layers'])}; first bad layer "
        f"{_esc(c['first_bad_layer'])}; introducing {_esc(c.get('introducing'))}</li>"
        for c in data.get("per_class", [])
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>ffdebug bisect</title>',
        f"<style>{CSS}</style></head><body>",
        "<h1>ffdebug bisect</h1>",
        f"<p>reference <code>{_esc(data.get('ref'))}</code> vs target <code>{_esc(data.get('target'))}</code>"
        f" &middot; verdict <b>{_esc(data.get('verdict'))}</b> &middot; judgement <b>{_esc(data.get('judgement'))}</b>"
        f" &middot; pattern <b>{_esc(data.get('pattern'))}</b></p>",
        f'<p class="conclusion {word}" id="conclusion">{_esc(data.get("conclusion"))}</p>',
        "<h2>Per-layer error of the block output, per layer class</h2>",
        '<div class="plots">',
        _plot("cos(hidden_out) per layer", series_cos, log=False, y_label="cos", marks=marks),
        _plot("rel(hidden_out) per layer (log scale)", series_rel, log=True, y_label="rel", marks=marks),
        "</div>",
        f"<h2>Layer classes</h2><ul>{per_class}</ul>",
        "<h2>Layers</h2>",
        _layer_table(data.get("layers", [])),
    ]
    if focus:
        parts += [f"<h2>Inside layer {first['layer']} (execution order)</h2>", _stage_table(focus)]
    parts += ["<h2>All stages</h2>", _stage_table(data.get("stages", []))]
    if data.get("notes"):
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{_esc(n)}</li>" for n in data["notes"]) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_bisect_html(data: dict, path: str) -> None:
    from ffdebug.report.output import write_output_file

    write_output_file(path, bisect_html(data), "--html")
