"""Hand-written inline SVG charts for the report: no plotting library, nothing fetched at view time.

    gantt(lanes, spans, t0, t1)          one row per lane, a bar per span, gaps are idle time
    stacked_bars(xs, series)             one bar per x, one colour per series (stage)
    lines(xs, series, unit)              one polyline per series
    area(series, bands, t0)              memory over time, stage spans as bands underneath

Each returns an <svg> string; colours are stable per name, with a legend where there are several.
"""

from __future__ import annotations

import html
import math

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac", "#1f3b73", "#a0cbe8", "#ffbe7d", "#8cd17d", "#b6992d", "#499894",
           "#86bcb6", "#d37295", "#fabfd2", "#79706e"]
W = 900
_ASSIGNED: dict[str, str] = {}  # name -> colour, in order of first use: one colour per stage on a page


def colour(name: str) -> str:
    if name not in _ASSIGNED:
        _ASSIGNED[name] = PALETTE[len(_ASSIGNED) % len(PALETTE)]
    return _ASSIGNED[name]


def _esc(text) -> str:
    return html.escape(str(text))


def legend(names: list[str], y: float) -> str:
    out, x = [], 10.0
    for name in names:
        out.append(f'<rect x="{x:.0f}" y="{y:.0f}" width="10" height="10" fill="{colour(name)}"/>'
                   f'<text x="{x + 14:.0f}" y="{y + 9:.0f}" font-size="11">{_esc(name)}</text>')
        x += 24 + 7 * len(name)
    return "".join(out)


def nice_top(top: float) -> float:
    """The smallest 1, 2, 2.5 or 5 x 10^k at or above `top`: the axis ends on a round number."""
    if top <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(top))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= top * (1 - 1e-9))


def y_axis(left: float, y0: float, y1: float, lo: float, hi: float, unit: str, n: int = 4) -> str:
    """Ticks and grid lines from lo (at y0, the bottom) to hi (at y1), labelled with `unit`."""
    out = [f'<line x1="{left}" y1="{y1}" x2="{left}" y2="{y0}" stroke="#999"/>']
    for i in range(n + 1):
        v = lo + (hi - lo) * i / n
        y = y0 - (y0 - y1) * i / n
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{W - 20}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{left - 4}" y="{y + 3:.1f}" font-size="10" text-anchor="end">{v:.3g}</text>')
    out.append(f'<text x="4" y="{y1 - 4}" font-size="10">{_esc(unit)}</text>')
    return "".join(out)


def x_ticks(left: float, right: float, y: float, t0: float, t1: float, unit: str, n: int = 5) -> str:
    """Ticks along x from t0 to t1 (shown from 0), every 1/n of the width."""
    out = [f'<line x1="{left}" y1="{y}" x2="{right}" y2="{y}" stroke="#999"/>']
    for i in range(n + 1):
        x = left + (right - left) * i / n
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#999"/>'
                   f'<text x="{x:.1f}" y="{y + 14}" font-size="10" text-anchor="middle">{(t1 - t0) * i / n:.3g}</text>')
    out.append(f'<text x="{right:.1f}" y="{y + 26}" font-size="10" text-anchor="end">{_esc(unit)}</text>')
    return "".join(out)


def key(names: list[str]) -> str:
    """A legend on its own line."""
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="16">{legend(names, 2)}</svg>'


def gantt(lanes: list[str], spans: list[tuple[str, str, float, float, str]], t0: float, t1: float) -> str:
    """spans: (lane, stage, start, end, tooltip) in seconds; drawn over [t0, t1]."""
    left, row, width = 170, 22, W - 190
    scale = width / max(t1 - t0, 1e-9)
    height = row * len(lanes) + 42
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" class="gantt">']
    for i, lane in enumerate(lanes):
        y = 4 + i * row
        out.append(f'<text x="4" y="{y + 14}" font-size="11">{_esc(lane)}</text>'
                   f'<rect x="{left}" y="{y}" width="{width}" height="{row - 4}" fill="#f3f3f3"/>')
    for lane, stage, start, end, tip in spans:
        s, e = max(start, t0), min(end, t1)
        if e <= s or lane not in lanes:
            continue
        y = 4 + lanes.index(lane) * row
        x, w = left + (s - t0) * scale, max((e - s) * scale, 0.5)
        out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 4}" fill="{colour(stage)}">'
                   f'<title>{_esc(tip)}</title></rect>')
        if w > 7 * len(stage):
            out.append(f'<text x="{x + 2:.1f}" y="{y + 13}" font-size="10" fill="#fff">{_esc(stage)}</text>')
    out.append(x_ticks(left, left + width, 4 + len(lanes) * row, t0, t1, "s from the step's start"))
    return "".join(out) + "</svg>"


def stacked_bars(xs: list, series: dict[str, list[float]], unit: str = "s") -> str:
    height, left, bottom = 240, 50, 30
    totals = [sum(v[i] for v in series.values()) for i in range(len(xs))]
    top = nice_top(max(totals, default=0))
    bw = (W - left - 20) / max(len(xs), 1)
    plot_h = height - bottom - 20
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height + 20}" class="stacked">',
           y_axis(left, 20 + plot_h, 20, 0.0, top, unit)]
    for i, x in enumerate(xs):
        y = 20 + plot_h
        for name, values in series.items():
            h = values[i] / top * plot_h
            y -= h
            out.append(f'<rect x="{left + i * bw:.1f}" y="{y:.1f}" width="{max(bw - 1, 0.5):.1f}" height="{h:.1f}" '
                       f'fill="{colour(name)}"><title>step {x} {_esc(name)}: {values[i]:.4g} {unit}</title></rect>')
        if len(xs) <= 30 or i % (len(xs) // 15 + 1) == 0:
            out.append(f'<text x="{left + i * bw:.1f}" y="{height - bottom + 22}" font-size="10">{x}</text>')
    out.append(f'<text x="{W - 60}" y="{height - bottom + 22}" font-size="10">step</text>')
    out.append(legend(list(series), height))
    return "".join(out) + "</svg>"


def lines(xs: list, series: dict[str, list[float]], unit: str = "") -> str:
    height, left = 200, 60
    values = [v for vs in series.values() for v in vs if v == v]
    lo, hi = min(values, default=0.0), max(values, default=1.0)
    lo = min(lo, 0.0)  # from 0, so a flat line near 0.5 does not look like a swing; negatives kept
    hi = nice_top(hi) if hi > 0 else 0.0
    hi = hi if hi > lo else lo + 1.0
    x0, x1 = (xs[0], xs[-1]) if xs else (0, 1)
    span_x = max(x1 - x0, 1)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height + 20}" class="lines">',
           y_axis(left, 10 + (height - 30), 10, lo, hi, unit)]
    for name, vs in series.items():
        pts = " ".join(f"{left + (x - x0) / span_x * (W - left - 20):.1f},{10 + (1 - (v - lo) / (hi - lo)) * (height - 30):.1f}"
                       for x, v in zip(xs, vs) if v == v)
        out.append(f'<polyline fill="none" stroke="{colour(name)}" stroke-width="2" points="{pts}">'
                   f'<title>{_esc(name)}</title></polyline>')
    out.append(f'<text x="{left}" y="{height}" font-size="10">step {x0}</text>'
               f'<text x="{W - 80}" y="{height}" font-size="10">step {x1}</text>')
    out.append(legend(list(series), height + 6))
    return "".join(out) + "</svg>"


def area(series: list[tuple[float, int]], bands: list[tuple[str, float, float]], max_points: int = 1500) -> str:
    """Memory (bytes) over wall time with stage bands (name, start, end) behind it."""
    height, left, band_h = 220, 60, 16
    if not series:
        return "<p>(no memory events)</p>"
    t0, t1 = series[0][0], series[-1][0]
    t1 = t1 if t1 > t0 else t0 + 1e-6
    step = max(len(series) // max_points, 1)
    points = [max(series[i:i + step], key=lambda p: p[1]) for i in range(0, len(series), step)]  # keep peaks
    top = nice_top(max(b for _, b in series) / 2**20) * 2**20
    sx = lambda t: left + (t - t0) / (t1 - t0) * (W - left - 20)  # noqa: E731
    sy = lambda b: 10 + (1 - b / top) * (height - 30 - band_h)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height + 40}" class="memory">']
    for name, s, e in bands:
        s, e = max(s, t0), min(e, t1)
        if e > s:
            out.append(f'<rect x="{sx(s):.1f}" y="10" width="{max(sx(e) - sx(s), 0.5):.1f}" '
                       f'height="{height - 30:.0f}" fill="{colour(name)}" opacity="0.18"><title>{_esc(name)}</title></rect>'
                       f'<rect x="{sx(s):.1f}" y="{height - 20 - band_h + 6}" width="{max(sx(e) - sx(s), 0.5):.1f}" '
                       f'height="{band_h - 4}" fill="{colour(name)}"><title>{_esc(name)}</title></rect>')
    pts = " ".join(f"{sx(t):.1f},{sy(b):.1f}" for t, b in points)
    out.append(f'<polyline fill="none" stroke="#222" stroke-width="1.5" points="{pts}"/>')
    out.append(y_axis(left, sy(0), sy(top), 0.0, top / 2**20, "MiB"))
    out.append(x_ticks(left, W - 20, height - 20 + 6 + band_h - 4, t0, t1, "s from the window's first event"))
    out.append(legend(sorted({b[0] for b in bands}), height + 24))
    return "".join(out) + "</svg>"
