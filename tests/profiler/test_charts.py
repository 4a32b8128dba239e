"""The report's charts: round ticks (more than the ends), axis titles inside the drawing, a stage's colour
the same in every report; top operators of an update under its mini-batch ranges, and across stages."""

import re

from plait.profiler.analysis import svg
from plait.profiler.analysis.traces import Trace, op_totals, top_ops, top_ops_overall


def texts(drawing: str) -> list[tuple[float, float, str]]:
    return [(float(x), float(y), t) for x, y, t in re.findall(r'<text x="([-\d.]+)" y="([-\d.]+)"[^>]*>([^<]*)</text>', drawing)]


def test_ticks_are_round_and_cover_the_range():
    assert svg.nice_ticks(0, 0.0735) == [0.0, 0.02, 0.04, 0.06, 0.08]
    assert svg.nice_ticks(0, 150) == [0, 50, 100, 150]
    assert svg.nice_ticks(-0.3, 0.8)[0] <= -0.3 and svg.nice_ticks(-0.3, 0.8)[-1] >= 0.8
    assert svg.label(0.1 + 0.2) == "0.3" and svg.label(2500.0) == "2500"


def test_axes_have_several_round_labels_and_titles_inside_the_drawing():
    drawing = svg.lines([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], {"perf/time_per_step": [0.1234, 0.2, 0.31, 0.28, 0.3, 0.27, 0.26, 0.3, 0.29, 0.3]}, "s")
    height = float(re.search(r'height="([\d.]+)"', drawing).group(1))
    labels = [t for _, _, t in texts(drawing)]
    assert {"0", "0.1", "0.2", "0.3"} <= set(labels) and {"2", "4", "6", "8", "10"} <= set(labels), labels
    assert "step" in labels and "s" in labels  # both axis titles
    assert all(0 < y <= height and 0 <= x <= svg.W for x, y, _ in texts(drawing))  # nothing clipped
    gantt = svg.gantt(["trainer (MainThread)"], [("trainer (MainThread)", "gen", 0.0, 0.05, "")], 0.0, 0.0735)
    labels = [t for _, _, t in texts(gantt)]
    assert labels.count("0.02") == 1 and "0.08" in labels and "0.0735" not in labels, labels
    height = float(re.search(r'height="([\d.]+)"', gantt).group(1))
    assert all(0 < y <= height for _, y, _ in texts(gantt))
    bars = svg.stacked_bars([1, 2], {"gen": [1.3, 1.1], "update_actor": [2.2, 2.0]})
    height = float(re.search(r'height="([\d.]+)"', bars).group(1))
    assert {"0", "1", "2", "3", "4"} <= {t for _, _, t in texts(bars)} and all(0 < y <= height for _, y, _ in texts(bars))


def test_a_stage_has_one_colour_whatever_the_order_of_drawing():
    first = [svg.colour(s) for s in ("update_actor", "gen", "reward")]
    svg.colour("something_else")
    assert [svg.colour(s) for s in ("reward", "gen", "update_actor")] == first[::-1]
    assert svg.colour("actor/update_actor") == svg.colour("update_actor")
    stages = list(svg.STAGE_COLOURS)
    assert len({svg.colour(s) for s in stages}) == len(stages)  # plait's stages: all different
    assert svg.colour("my_metric") == svg.colour("my_metric")


def x(cat, name, ts, dur, tid=1):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}


def test_an_updates_work_under_its_mini_batch_ranges_counts_in_the_update():
    events = [x("user_annotation", "actor/update_actor", 0, 1000),
              x("user_annotation", "actor/mini_batch0", 10, 400), x("cpu_op", "aten::mm", 20, 300),
              x("user_annotation", "actor/mini_batch1", 500, 400), x("cpu_op", "aten::mm", 510, 300),
              x("cpu_op", "aten::zero_", 950, 2),
              x("user_annotation", "actor/mini_batch2", 2000, 100), x("cpu_op", "aten::addmm", 2010, 50),  # no update around
              x("user_annotation", "rollout/gen", 3000, 500), x("cpu_op", "aten::mm", 3010, 100),
              x("cpu_op", "aten::softmax", 3200, 200)]
    totals = op_totals(Trace({"role": "actor", "rank": 0}, events, "actor rank 0"))
    ops = top_ops(totals)
    assert ops["actor/update_actor"][:2] == [("aten::mm", 600, 2), ("aten::addmm", 50, 1)]
    assert not any("mini_batch" in stage for stage in ops)
    overall = top_ops_overall(totals)
    assert overall[0] == ("aten::mm", 700, 3, "actor/update_actor")
    assert [op for op, *_ in overall][:2] == ["aten::mm", "aten::softmax"]


def test_the_series_of_one_chart_never_share_a_colour():
    names = ["trainer/idle_ratio", "rollouter/idle_ratio", "training/staleness/mean", "training/staleness/max", "gen"]
    fill = svg.colours(names)
    assert len(set(fill.values())) == len(names) and fill["gen"] == svg.colour("gen")
    assert svg.colours(list(reversed(names)))["gen"] == fill["gen"]
    drawing = svg.lines([1, 2], {n: [0.1, 0.2] for n in names[:3]})
    assert len(set(re.findall(r'stroke="(#[0-9a-f]+)" stroke-width="2"', drawing))) == 3


def test_a_long_key_wraps_onto_rows_inside_the_drawing():
    names = [f"rollout/some_long_stage_name_{i}" for i in range(12)]
    drawing = svg.key(names)
    height = float(re.search(r'height="([\d.]+)"', drawing).group(1))
    placed = texts(drawing)
    assert {t for _, _, t in placed} == set(names)  # no stage lost
    assert all(x + 7 * len(t) <= svg.W for x, _, t in placed) and all(y <= height for _, y, _ in placed)
    assert len({y for _, y, _ in placed}) > 1  # wrapped
    bars = svg.stacked_bars([1, 2], {n: [1.0, 1.0] for n in names})
    height = float(re.search(r'height="([\d.]+)"', bars).group(1))
    assert all(0 < y <= height for _, y, _ in texts(bars))


def test_values_that_are_not_finite_are_not_drawn():
    inf, nan = float("inf"), float("nan")
    assert "inf" not in svg.lines([1, 2, 3], {"m": [1.0, inf, nan]}, "s")
    assert "<svg" in svg.stacked_bars([1, 2], {"gen": [inf, 1.0]})
    assert "<svg" in svg.area([(0.0, 10), (1.0, inf), (nan, 3)], [("gen", 0.0, inf)])
    assert "<svg" in svg.gantt(["a"], [("a", "gen", 0.0, inf, "")], 0.0, 1.0)
    assert "<svg" in svg.histogram([0.1, 0.2, inf, nan, 0.15], "s", "latency")


def test_numbers_in_tables_are_for_people():
    from plait.profiler.analysis.report import _fmt
    assert [_fmt(v) for v in (9.64e-05, 0.0123, 1.23456, 12.345, 12345.6, 0.0, 7, float("inf"))] == \
        ["<0.001", "0.0123", "1.23", "12.3", "12,346", "0", "7", "-"]


def _colliding() -> list[str]:
    """Two names that are no plait stage and hash to the same colour (a chart then shifts one of them)."""
    seen: dict[str, str] = {}
    for i in range(1000):
        name = f"tool_{i}"
        if svg.colour(name) in seen:
            return [seen[svg.colour(name)], name]
        seen[svg.colour(name)] = name
    raise AssertionError("no collision in 1000 names")


def fills(drawing: str) -> dict[str, str]:
    """name -> colour, from each bar's (or band's) tooltip and each legend entry's text."""
    bars = dict((t.split(" ")[0], f) for f, t in re.findall(r'fill="(#[0-9a-f]+)"[^>]*><title>([^<]*)</title>', drawing))
    keyed = dict((t, f) for f, t in re.findall(r'fill="(#[0-9a-f]+)"/><text [^>]*>([^<]*)</text>', drawing))
    return {**{f"bar {k}": v for k, v in bars.items()}, **{f"key {k}": v for k, v in keyed.items()}}


def test_the_gantt_and_memory_bars_are_the_colours_their_key_names():
    a, b = _colliding()
    spans = [("lane", a, 0.0, 0.4, f"{a} · step 1"), ("lane", b, 0.5, 0.9, f"{b} · step 1")]
    fill = svg.colours([a, b])
    got = {**fills(svg.gantt(["lane"], spans, 0.0, 1.0, fill)), **fills(svg.key([a, b], fill))}
    assert got[f"bar {a}"] == got[f"key {a}"] and got[f"bar {b}"] == got[f"key {b}"] and got[f"key {a}"] != got[f"key {b}"]
    memory = fills(svg.area([(0.0, 1), (1.0, 2**20)], [(a, 0.0, 0.4), (b, 0.5, 0.9)]))
    assert memory[f"bar {a}"] == memory[f"key {a}"] and memory[f"bar {b}"] == memory[f"key {b}"]
