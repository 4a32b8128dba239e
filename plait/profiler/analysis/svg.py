"""Hand-written inline SVG charts for the report: no plotting library, nothing fetched at view time.

    gantt(lanes, spans, t0, t1)          one row per lane, a bar per span, gaps are idle time
    stacked_bars(xs, series)             one bar per x, one colour per series (stage)
    lines(xs, series, unit)              one polyline per series
    area(series, bands, t0)              memory over time, stage spans as bands underneath

Each returns an <svg> string; colours are fixed per stage name (the same in every report), axes have
round ticks (1, 2, 2.5 or 5 x 10^k apart) and a title inside the drawing, with a legend where there are
several, wrapped onto as many rows as its names need. A value that is not a finite number is not drawn.
"""

from __future__ import annotations

import html
import math
import zlib
from typing import Optional

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac", "#1f3b73", "#a0cbe8", "#ffbe7d", "#8cd17d", "#b6992d", "#499894",
           "#86bcb6", "#d37295", "#fabfd2", "#79706e", "#7b4173"]
W = 900
# plait's stage names, each its own colour in every report; any other name (a metric, an
# unknown stage) gets one from a hash of its name, so it too is the same in every report.
STAGE_COLOURS = {name: PALETTE[i] for i, name in enumerate((
    "gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights",
    "testing", "save_checkpoint", "wait_rollout", "param_sync", "all_reduce", "resume", "wait_capacity",
    "wait_sync", "validate", "step", "startup", "teacher"))}
LEGEND_ROW = 16


def colour(name: str) -> str:
    """A stage's colour, the same in every report (a role prefix "actor/" is not part of the stage)."""
    stage = str(name).rsplit("/", 1)[-1]
    return STAGE_COLOURS.get(stage) or PALETTE[zlib.crc32(str(name).encode()) % len(PALETTE)]


def colours(names: list[str]) -> dict[str, str]:
    """Colours of the series of one chart: each stage its own; any other name its hashed colour, or
    the next one free in this chart when that is taken (the same names give the same colours)."""
    out = {n: colour(n) for n in names if str(n).rsplit("/", 1)[-1] in STAGE_COLOURS}
    for name in names:
        if name in out:
            continue
        i = PALETTE.index(colour(name))
        while PALETTE[i] in out.values() and len(set(out.values())) < len(PALETTE):
            i = (i + 1) % len(PALETTE)
        out[name] = PALETTE[i]
    return out


MAX_TEXT = 120  # characters of a name or tooltip drawn: the page must not grow with a crafted name


def _esc(text) -> str:
    return html.escape(str(text)[:MAX_TEXT])


def finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _legend_places(names: list[str]) -> list[tuple[float, int]]:
    """(x, row) of each name: left to right, a new row when the next would pass the chart's width."""
    out, x, row = [], 10.0, 0
    for name in names:
        width = 24 + 7 * min(len(str(name)), MAX_TEXT)
        if x > 10 and x + width > W - 10:
            x, row = 10.0, row + 1
        out.append((x, row))
        x += width
    return out


def legend_height(names: list[str]) -> int:
    """The height the legend of `names` takes (its rows)."""
    places = _legend_places(names)
    return (places[-1][1] + 1) * LEGEND_ROW if places else 0


def legend(names: list[str], y: float, fill: Optional[dict[str, str]] = None) -> str:
    """`fill`: the colours of the chart the legend keys (its bars' own); None: colours(names)."""
    out, fill = [], fill or colours(names)
    for name, (x, row) in zip(names, _legend_places(names)):
        top = y + row * LEGEND_ROW
        out.append(f'<rect x="{x:.0f}" y="{top:.0f}" width="10" height="10" fill="{fill[name]}"/>'
                   f'<text x="{x + 14:.0f}" y="{top + 9:.0f}" font-size="11">{_esc(name)}</text>')
    return "".join(out)


def nice_top(top: float) -> float:
    """The smallest 1, 2, 2.5 or 5 x 10^k at or above `top`: the axis ends on a round number."""
    if top <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(top))
    return next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= top * (1 - 1e-9))


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round tick values (a 1, 2, 2.5 or 5 x 10^k step) from a multiple at or below `lo` to
    one at or above `hi`: the axis runs from the first to the last."""
    if not hi > lo:
        hi = lo + 1.0
    step = nice_top((hi - lo) / n)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def label(v: float) -> str:
    """A tick label: no float noise (0.30000000000000004), no trailing zeros."""
    return f"{v:.6g}" if abs(v) >= 1e-12 else "0"


def y_axis(left: float, y0: float, y1: float, ticks: list[float], title: str) -> str:
    """Grid lines and labels at `ticks` (first at y0, the bottom; last at y1); `title` above the axis."""
    lo, hi = ticks[0], ticks[-1]
    out = [f'<line x1="{left}" y1="{y1}" x2="{left}" y2="{y0}" stroke="#999"/>']
    for v in ticks:
        y = y0 - (y0 - y1) * (v - lo) / (hi - lo)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{W - 20}" y2="{y:.1f}" stroke="#eee"/>'
                   f'<text x="{left - 4}" y="{y + 3:.1f}" font-size="10" text-anchor="end">{label(v)}</text>')
    out.append(f'<text x="{left}" y="{y1 - 6}" font-size="10" font-weight="bold">{_esc(title)}</text>')
    return "".join(out)


def x_axis(left: float, right: float, y: float, ticks: list[float], title: str, origin: float = 0.0) -> str:
    """Tick marks and labels at `ticks` (shown relative to `origin`) from `left` to `right`; `title` under them."""
    lo, hi = ticks[0], ticks[-1]
    out = [f'<line x1="{left}" y1="{y}" x2="{right}" y2="{y}" stroke="#999"/>']
    for v in ticks:
        x = left + (right - left) * (v - lo) / (hi - lo)
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#999"/>'
                   f'<text x="{x:.1f}" y="{y + 14}" font-size="10" text-anchor="middle">{label(v - origin)}</text>')
    out.append(f'<text x="{(left + right) / 2:.1f}" y="{y + 27}" font-size="10" font-weight="bold" '
               f'text-anchor="middle">{_esc(title)}</text>')
    return "".join(out)


def key(names: list[str], fill: Optional[dict[str, str]] = None) -> str:
    """A legend on its own, on as many rows as it needs, in the colours `fill` of the charts it keys."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{legend_height(names) + 2}">'
            f'{legend(names, 2, fill)}</svg>')


def gantt(lanes: list[str], spans: list[tuple[str, str, float, float, str]], t0: float, t1: float,
          fill: Optional[dict[str, str]] = None) -> str:
    """spans: (lane, stage, start, end, tooltip) in seconds; drawn from t0 to the round tick at or after t1, each
    stage in `fill`'s colour (the key's: several charts share one), else colours() of the stages drawn."""
    fill = fill or colours(sorted({s[1] for s in spans}))
    left, row, width = 170, 22, W - 190
    ticks = nice_ticks(0.0, max(t1 - t0, 1e-9) if finite(t1 - t0) else 1.0)
    scale = width / ticks[-1]
    height = row * len(lanes) + 44
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{height}" class="gantt">']
    for i, lane in enumerate(lanes):
        y = 4 + i * row
        out.append(f'<text x="4" y="{y + 14}" font-size="11">{_esc(lane)}</text>'
                   f'<rect x="{left}" y="{y}" width="{(t1 - t0) * scale:.1f}" height="{row - 4}" fill="#f3f3f3"/>')
    index = {lane: i for i, lane in enumerate(lanes)}
    for lane, stage, start, end, tip in spans:
        s, e = max(start, t0), min(end, t1)
        if not (finite(s) and finite(e)) or e <= s or lane not in index:
            continue
        y = 4 + index[lane] * row
        x, w = left + (s - t0) * scale, max((e - s) * scale, 0.5)
        out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 4}" fill="{fill.get(stage) or colour(stage)}">'
                   f'<title>{_esc(tip)}</title></rect>')
        if w > 7 * len(stage):
            out.append(f'<text x="{x + 2:.1f}" y="{y + 13}" font-size="10" fill="#fff">{_esc(stage)}</text>')
    out.append(x_axis(left, left + width, 4 + len(lanes) * row, ticks, "s from the step's start"))
    return "".join(out) + "</svg>"


def stacked_bars(xs: list, series: dict[str, list[float]], unit: str = "s") -> str:
    left, top_y, plot_h = 50, 20, 190
    series = {k: [v if finite(v) and v > 0 else 0.0 for v in vs] for k, vs in series.items()}
    totals = [sum(v[i] for v in series.values()) for i in range(len(xs))]
    ticks = nice_ticks(0.0, max(totals, default=0.0) or 1.0)
    top = ticks[-1]
    bw = (W - left - 20) / max(len(xs), 1)
    base, fill = top_y + plot_h, colours(list(series))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{base + 38 + legend_height(list(series))}" '
           'class="stacked">',
           y_axis(left, base, top_y, ticks, unit)]
    for i, x in enumerate(xs):
        y = base
        for name, values in series.items():
            h = values[i] / top * plot_h
            y -= h
            out.append(f'<rect x="{left + i * bw:.1f}" y="{y:.1f}" width="{max(bw - 1, 0.5):.1f}" height="{h:.1f}" '
                       f'fill="{fill[name]}"><title>step {x} {_esc(name)}: {values[i]:.4g} {unit}</title></rect>')
        if len(xs) <= 30 or i % (len(xs) // 15 + 1) == 0:
            out.append(f'<text x="{left + (i + 0.5) * bw:.1f}" y="{base + 14}" font-size="10" '
                       f'text-anchor="middle">{x}</text>')
    out.append(f'<text x="{(left + W - 20) / 2:.0f}" y="{base + 28}" font-size="10" font-weight="bold" '
               'text-anchor="middle">step</text>')
    out.append(legend(list(series), base + 36))
    return "".join(out) + "</svg>"


def lines(xs: list, series: dict[str, list[float]], unit: str = "") -> str:
    """One polyline per series over integer steps `xs`; the y axis from 0 (or below, for negatives)."""
    left, top_y, plot_h = 60, 20, 170
    series = {k: [v if finite(v) else float("nan") for v in vs] for k, vs in series.items()}
    values = [v for vs in series.values() for v in vs if v == v]
    lo, hi = min(min(values, default=0.0), 0.0), max(values, default=1.0)  # from 0: a flat 0.5 is no swing
    y_ticks = nice_ticks(lo, hi if hi > lo else lo + 1.0, 4)
    x0, x1 = (xs[0], xs[-1]) if xs else (0, 1)
    x_ticks = [t for t in nice_ticks(x0, max(x1, x0 + 1), 6) if t == int(t)] or [x0, x1]
    x_ticks = [int(t) for t in x_ticks]
    lo, hi, xa, xb = y_ticks[0], y_ticks[-1], x_ticks[0], x_ticks[-1]
    base = top_y + plot_h
    sx = lambda x: left + (x - xa) / max(xb - xa, 1) * (W - left - 20)  # noqa: E731
    sy = lambda v: base - (v - lo) / (hi - lo) * plot_h  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{base + 38 + legend_height(list(series))}" '
           'class="lines">',
           y_axis(left, base, top_y, y_ticks, unit)]
    fill = colours(list(series))
    for name, vs in series.items():
        pts = " ".join(f"{sx(x):.1f},{sy(v):.1f}" for x, v in zip(xs, vs) if v == v)
        out.append(f'<polyline fill="none" stroke="{fill[name]}" stroke-width="2" points="{pts}">'
                   f'<title>{_esc(name)}</title></polyline>')
    out.append(x_axis(left, W - 20, base, x_ticks, "step"))
    out.append(legend(list(series), base + 36))
    return "".join(out) + "</svg>"


def area(series: list[tuple[float, int]], bands: list[tuple[str, float, float]], max_points: int = 1500) -> str:
    """Memory (bytes) over wall time with stage bands (name, start, end) behind it."""
    left, top_y, plot_h, band_h = 60, 20, 170, 12
    series = [(t, b) for t, b in series if finite(t) and finite(b)]
    bands = [(n, s, e) for n, s, e in bands if finite(s) and finite(e)]
    if not series:
        return "<p>(no memory events)</p>"
    t0 = series[0][0]
    x_ticks = nice_ticks(0.0, max(series[-1][0] - t0, 1e-6))
    t1 = t0 + x_ticks[-1]
    step = max(len(series) // max_points, 1)
    points = [max(series[i:i + step], key=lambda p: p[1]) for i in range(0, len(series), step)]  # keep peaks
    y_ticks = nice_ticks(0.0, max(b for _, b in series) / 2**20 or 1.0, 4)
    top = y_ticks[-1] * 2**20
    base = top_y + plot_h
    sx = lambda t: left + (t - t0) / (t1 - t0) * (W - left - 20)  # noqa: E731
    sy = lambda b: base - b / top * plot_h  # noqa: E731
    names = sorted({b[0] for b in bands})
    fill = colours(names)  # the bands' and the legend's: one mapping, so the key says what each band is
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{base + band_h + 46 + legend_height(names)}" '
           'class="memory">']
    for name, s, e in bands:
        s, e = max(s, t0), min(e, t1)
        if e > s:
            out.append(f'<rect x="{sx(s):.1f}" y="{top_y}" width="{max(sx(e) - sx(s), 0.5):.1f}" '
                       f'height="{plot_h}" fill="{fill[name]}" opacity="0.18"><title>{_esc(name)}</title></rect>'
                       f'<rect x="{sx(s):.1f}" y="{base + 2}" width="{max(sx(e) - sx(s), 0.5):.1f}" '
                       f'height="{band_h - 2}" fill="{fill[name]}"><title>{_esc(name)}</title></rect>')
    pts = " ".join(f"{sx(t):.1f},{sy(b):.1f}" for t, b in points)
    out.append(f'<polyline fill="none" stroke="#222" stroke-width="1.5" points="{pts}"/>')
    out.append(y_axis(left, base, top_y, y_ticks, "MiB"))
    out.append(x_axis(left, W - 20, base + band_h, x_ticks, "s from the window's first event"))
    out.append(legend(names, base + band_h + 44, fill))
    return "".join(out) + "</svg>"


def histogram(values: list[float], unit: str, title: str, bins: int = 20) -> str:
    """How many values fall in each of about `bins` equal, round bins from 0 (latencies)."""
    values = [v for v in values if finite(v) and v >= 0]
    if not values:
        return "<p>(no values)</p>"
    left, top_y, plot_h = 60, 20, 150
    edges = nice_ticks(0.0, max(values) or 1.0, bins)
    width = edges[1] - edges[0]
    counts = [0] * (len(edges) - 1)
    for v in values:
        counts[min(int(v / width), len(counts) - 1)] += 1
    y_ticks = [t for t in nice_ticks(0.0, max(counts), 4) if t == int(t)] or [0, max(counts)]
    base, span = top_y + plot_h, W - left - 20
    bw = span / len(counts)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{base + 40}" class="histogram">',
           y_axis(left, base, top_y, y_ticks, "samples")]
    for i, c in enumerate(counts):
        h = c / y_ticks[-1] * plot_h
        out.append(f'<rect x="{left + i * bw:.1f}" y="{base - h:.1f}" width="{max(bw - 1, 0.5):.1f}" height="{h:.1f}" '
                   f'fill="#4e79a7"><title>{label(edges[i])}-{label(edges[i + 1])} {_esc(unit)}: {c}</title></rect>')
    out.append(x_axis(left, left + span, base, edges, f"{title} ({unit})"))
    return "".join(out) + "</svg>"
