"""Where every second of a step went, per thread: the timeline's spans with nothing left out.

    timeline.jsonl spans ─▶ account(spans) ─▶ [StepTime(step, wall, lanes)]
                                                lanes["trainer (MainThread)"] = {"update_actor": s, ...,
                                                                                 "unattributed": s}
A step's wall time is its cycle on the trainer's thread: from the first trainer span recorded with
that step (its profiler start, else its `step` span) to the next step's first one; the last step (or
the last before a resume, another process) ends at its own last trainer span. So the time between
two steps (`profiler_stop`, `log`, `profiler_start`) belongs to the step before.

Each lane (one role on one thread: the trainer, an async rollouter) splits the cycle exactly:
every instant goes to the innermost span covering it (the one that started last; `step` itself is
a frame, not work), and what no span covers is `unattributed`. A lane that is not the trainer's is
`not started` before its first span of the run and `finished` after its last (a rollouter that
has issued every prompt). The parts of a lane add up to the cycle's wall time by construction; a
large `unattributed` is a hole in the recording, not a property of the run.

It leaves out worker processes (Ray workers write no timeline; their torch traces are the report's
windows) and the time before step 1 (start-up, the first validation: the run summary's).
"""

from __future__ import annotations

import heapq
import statistics
from collections import defaultdict
from dataclasses import dataclass

UNATTRIBUTED, NOT_STARTED, FINISHED = "unattributed", "not started", "finished"
FRAME = "step"  # the trainer's step span: the frame its stages sit in


@dataclass
class StepTime:
    step: int
    start: float                            # wall clock
    wall: float                             # seconds
    lanes: dict[str, dict[str, float]]      # lane -> part -> seconds; each lane's parts sum to wall


def lane(span: dict) -> str:
    return f"{span['role']} ({span['thread']})"


def account(spans: list[dict]) -> list[StepTime]:
    """Every step's cycle, split per lane (see the module docstring)."""
    frames = {s["step"]: s for s in spans if s["role"] == "trainer" and s["stage"] == FRAME}
    trainer = {(f["pid"], lane(f)) for f in frames.values()}
    first: dict[int, float] = defaultdict(lambda: float("inf"))
    last: dict[int, float] = defaultdict(lambda: float("-inf"))
    bounds: dict[tuple, list[float]] = {}  # (pid, lane) -> [first start, last end] over the run
    for s in spans:
        key = (s["pid"], lane(s))
        b = bounds.setdefault(key, [s["start"], s["end"]])
        b[0], b[1] = min(b[0], s["start"]), max(b[1], s["end"])
        if key in trainer:
            first[s["step"]] = min(first[s["step"]], s["start"])
            last[s["step"]] = max(last[s["step"]], s["end"])
    steps = sorted(frames)
    by_start = sorted(spans, key=lambda s: s["start"])
    out, nxt_span, open_ = [], 0, []  # a sweep: a long run's steps each see only the spans near them
    for i, step in enumerate(steps):
        pid, nxt = frames[step]["pid"], steps[i + 1] if i + 1 < len(steps) else None
        a = first[step]
        b = first[nxt] if nxt is not None and frames[nxt]["pid"] == pid else last[step]
        while nxt_span < len(by_start) and by_start[nxt_span]["start"] < b:
            open_.append(by_start[nxt_span])
            nxt_span += 1
        open_ = [s for s in open_ if s["end"] > a]  # cycles only move forward in time
        near = [s for s in open_ if s["pid"] == pid]
        lanes = {name: bound for (p, name), bound in bounds.items() if p == pid}
        out.append(StepTime(step, a, b - a, split_lanes(near, lanes, lane(frames[step]), a, b)))
    return out


def split_lanes(spans: list[dict], bounds: dict[str, list[float]], trainer_lane: str, a: float,
                b: float) -> dict[str, dict[str, float]]:
    """Each lane's parts over [a, b) (stages, unattributed, not started, finished); `bounds` holds
    each lane's first start and last end over the whole run."""
    out = {}
    for name in sorted(bounds, key=lambda n: (n != trainer_lane, n)):
        lo, hi = (a, b) if name == trainer_lane else (max(a, bounds[name][0]), min(b, bounds[name][1]))
        parts = innermost([(s["stage"], s["start"], s["end"]) for s in spans
                           if lane(s) == name and s["stage"] != FRAME], lo, hi)
        if name != trainer_lane:
            parts[NOT_STARTED] = max(0.0, min(lo, b) - a)
            parts[FINISHED] = max(0.0, b - max(hi, a))
        out[name] = {k: v for k, v in parts.items() if v > 0 or k == UNATTRIBUTED}
    return out


def innermost(spans: list[tuple[str, float, float]], a: float, b: float) -> dict[str, float]:
    """Seconds of [a, b) per name: each instant to the covering span that started last (then the
    shorter); the rest unattributed. [(name, start, end)] -> {name: s}. A sweep over the span
    boundaries with a heap of the open spans: O(n log n) for the many spans of a busy rollouter."""
    out: dict[str, float] = defaultdict(float)
    inside = sorted((max(s, a), min(e, b), -s, e - s, n) for n, s, e in spans if e > a and s < b)
    cuts = sorted({a, b, *(x for lo, hi, *_ in inside for x in (lo, hi))}) if b > a else []
    heap: list[tuple] = []
    i = 0
    for lo, hi in zip(cuts, cuts[1:]):
        while i < len(inside) and inside[i][0] <= lo:
            start, end, neg_start, length, name = inside[i]
            heapq.heappush(heap, (neg_start, length, name, end))
            i += 1
        while heap and heap[0][3] <= lo:  # the innermost open span ended: the next one in
            heapq.heappop(heap)
        out[heap[0][2] if heap else UNATTRIBUTED] += hi - lo
    out.setdefault(UNATTRIBUTED, 0.0)
    return dict(out)


def median_shares(steps: list[StepTime], lane_name: str) -> dict[str, float]:
    """Per part of one lane: its median share of the step's wall time over the steps (0 where a
    step lacks it), largest first."""
    rows = [st.lanes.get(lane_name, {}) for st in steps if st.wall > 0]
    walls = [st.wall for st in steps if st.wall > 0]
    parts = {k for r in rows for k in r}
    shares = {k: statistics.median(r.get(k, 0.0) / w for r, w in zip(rows, walls)) for k in parts}
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))


def trainer_lane(steps: list[StepTime]) -> str | None:
    """The lane the cycles are measured on (listed first in every step)."""
    return next(iter(steps[0].lanes), None) if steps else None
