"""What held memory: peak, when, in which stage, by which allocation sites, and growth per stage.

Two sources give the same answer (`MemoryReport`):

    cuda_snapshot(snapshot)   a torch_memory CUDA snapshot (the dict of torch.cuda.memory._snapshot():
                              device_traces replayed alloc/free; blocks still active at the dump and
                              never allocated in the trace count as live from the start)
    cpu_trace(events)         a torch_memory CPU trace (torch.profiler with profile_memory): the
                              "[memory]" events replayed by address; a site is the innermost Python
                              frame (with_stack) enclosing the allocation on its thread

A site is the innermost frame outside torch ("file.py(line): function"), so an allocation made by
aten for a user's line is charged to that line. Stages come from the run's timeline (wall clock),
the innermost stage span containing the moment; without a timeline, from the trace's own ranges.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field

FREES = ("free_requested",)  # free_completed follows it for the same block: counted once


@dataclass
class MemoryReport:
    device: str
    peak_bytes: int
    peak_time: float                       # wall-clock seconds
    peak_stage: str
    top_sites: list[tuple[str, int]]       # (site, bytes live at the peak), largest first
    series: list[tuple[float, int]]        # (wall-clock seconds, bytes allocated)
    growth: dict[str, int] = field(default_factory=dict)  # stage -> bytes at exit minus entry, summed


def site_of(frames: list[str]) -> str:
    """The innermost frame outside torch and Python built-ins; frames innermost first."""
    for f in frames:
        if not _internal(f):
            return f
    return frames[0] if frames else "(unknown)"


def _internal(frame: str) -> bool:
    return ("torch/" in frame or frame.startswith("<built-in") or frame.startswith("nn.Module:")
            or "/plait/profiler/" in frame or frame.startswith("plait/profiler/"))


def replay(events: list[tuple[float, int, int, str]], live: dict[int, tuple[int, str]]) -> tuple:
    """events: (time, addr, +bytes | -bytes, site) in time order; `live` starts with what was there.

    Returns (series, peak index, live at peak)."""
    total = sum(size for size, _ in live.values())
    series = [(events[0][0], total)] if events else []
    peak, peak_i, at_peak = total, 0, dict(live)
    for t, addr, delta, site in events:
        if delta > 0:
            live[addr] = (delta, site)
            total += delta
        elif addr in live:
            total -= live.pop(addr)[0]
        else:
            continue  # freed, but allocated before the recording began
        series.append((t, total))
        if total > peak:
            peak, peak_i, at_peak = total, len(series) - 1, dict(live)
    return series, peak_i, at_peak


def _report(device: str, series, peak_i, at_peak, stages, n_sites: int) -> MemoryReport:
    by_site: dict[str, int] = defaultdict(int)
    for size, site in at_peak.values():
        by_site[site] += size
    t, peak = series[peak_i] if series else (0.0, 0)
    return MemoryReport(device, peak, t, stage_at(stages, t),
                        sorted(by_site.items(), key=lambda x: -x[1])[:n_sites], series,
                        growth_per_stage(series, stages))


def cuda_snapshot(snapshot: dict, stages: list[dict], device: int = 0, n_sites: int = 10) -> MemoryReport:
    trace = snapshot["device_traces"][device] if snapshot["device_traces"] else []
    events, allocated = [], set()
    for e in trace:
        site = site_of([_frame(f) for f in e.get("frames", [])])
        if e["action"] == "alloc":
            allocated.add(e["addr"])
            events.append((e["time_us"] / 1e6, e["addr"], e["size"], site))
        elif e["action"] in FREES:
            events.append((e["time_us"] / 1e6, e["addr"], -e["size"], site))
    live = {b["address"]: (b["size"], site_of([_frame(f) for f in b.get("frames", [])]))
            for seg in snapshot["segments"] if seg.get("device", device) == device
            for b in seg["blocks"] if b["state"] == "active_allocated" and b["address"] not in allocated}
    series, peak_i, at_peak = replay(events, live)
    return _report(f"cuda:{device}", series, peak_i, at_peak, stages, n_sites)


def _frame(f: dict) -> str:
    return f"{f['filename']}({f['line']}): {f['name']}"


def snapshot_stages(snapshot: dict) -> list[dict]:
    """Stage ranges recorded in a snapshot (global_record_annotations), as timeline-like spans."""
    open_at: dict[str, float] = {}
    spans = []
    for a in snapshot.get("external_annotations", []):  # absent from snapshots of older PyTorch
        if a["stage"] == "START":
            open_at[a["name"]] = a["time_us"] / 1e6
        elif a["name"] in open_at:
            spans.append({"stage": a["name"], "role": "snapshot", "start": open_at.pop(a["name"]),
                          "end": a["time_us"] / 1e6})
    return spans


def cpu_trace(events: list[dict], stages: list[dict], n_sites: int = 10, origin_s: float = 0.0) -> MemoryReport:
    """From a torch.profiler trace (ts in µs from `origin_s`, wall-clock seconds) with "[memory]" events of
    CPU memory."""
    frames: dict[tuple, list[dict]] = defaultdict(list)
    mems = []
    for e in events:
        if e.get("cat") == "python_function" and e.get("ph") == "X":
            frames[(e["pid"], e["tid"])].append(e)
        elif e.get("name") == "[memory]" and e["args"].get("Device Type") == 0:
            mems.append(e)
    mems.sort(key=lambda e: e["ts"])
    sites = {}
    for key, fs in frames.items():
        sites.update(_sites(fs, [m for m in mems if (m["pid"], m["tid"]) == key]))
    replayed = [(origin_s + m["ts"] / 1e6, m["args"]["Addr"], m["args"]["Bytes"], sites.get(id(m), "(no stack)"))
                for m in mems]
    series, peak_i, at_peak = replay(replayed, {})
    return _report("cpu", series, peak_i, at_peak, stages, n_sites)


def _sites(frames: list[dict], mems: list[dict]) -> dict[int, str]:
    """id(memory event) -> site, by one sweep over this thread's frames (they nest properly)."""
    frames.sort(key=lambda e: (e["ts"], -e["dur"]))
    out, stack, i = {}, [], 0
    for m in mems:
        while i < len(frames) and frames[i]["ts"] <= m["ts"]:
            f = frames[i]
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= f["ts"]:
                stack.pop()
            stack.append(f)
            i += 1
        while stack and stack[-1]["ts"] + stack[-1]["dur"] < m["ts"]:
            stack.pop()
        out[id(m)] = site_of([f["name"] for f in reversed(stack)])
    return out


def stage_at(stages: list[dict], t: float) -> str:
    """The innermost (shortest) stage span containing wall time t; "step" only if nothing else."""
    inside = [s for s in stages if s["start"] <= t <= s["end"]]
    if not inside:
        return "(between stages)"
    inner = [s for s in inside if s["stage"] != "step"] or inside
    return min(inner, key=lambda s: s["end"] - s["start"])["stage"]


def growth_per_stage(series: list[tuple[float, int]], stages: list[dict]) -> dict[str, int]:
    """Bytes allocated at each stage's exit minus at its entry, summed per stage name, for the
    stage spans that overlap the series' time range (before its first event: the baseline)."""
    if not series:
        return {}
    times = [t for t, _ in series]
    def at(t: float) -> int:
        i = bisect.bisect_right(times, t) - 1
        return series[max(i, 0)][1]
    out: dict[str, int] = defaultdict(int)
    for s in stages:
        if s["stage"] != "step" and s["start"] <= times[-1] and times[0] <= s["end"]:
            out[s["stage"]] += at(s["end"]) - at(s["start"])
    return dict(out)


def process_peak(records: list[dict], profiled: Collection[int] = ()) -> dict | None:
    """The highest per-stage peak over a run's metric records (memory/<stage>/peak_*_gb; the stage `step`
    left out: it folds in the others): {gb, metric, stage, step, tied}. The tie rule: peaks within TIE_SHARE
    (1 %, at least ru_maxrss's 1 KiB) of the highest tie (a resident size that holds once freed memory is
    kept makes stages tie, creeping by pages); the one named is the earliest step's, in it the stage that
    closed first (the record's order), `gb` the highest value; `tied` names the other stages, and the
    console and page say the one named is only the first.
    Steps inside profiler windows (`profiled`) are left out while another step has a peak: a window's own
    recording (torch_memory's allocation records, a trace's events) holds memory the run without it never
    would. A window peak above the run's is kept beside it as `window` ({gb, stage, step}); a run profiled on
    every step gets its windows' peak, marked `profiled`. What a window frees can stay resident after it (the
    heap keeps freed memory: plait/allocator.py gives it back as the window closes, not all of it), so a
    peak after the first window above the one before it keeps that one beside it as `before_windows`."""
    best = _highest([r for r in records if r.get("step") not in profiled])
    inside = _highest([r for r in records if r.get("step") in profiled])
    if best is None:
        return None if inside is None else {**inside, "profiled": True}
    if inside is not None and inside["gb"] > best["gb"] + tie(best["gb"]):
        best["window"] = {k: inside[k] for k in ("gb", "stage", "step")}
    first = min(profiled, default=None)
    before = _highest([r for r in records if first is not None and r.get("step", first) < first])
    if before is not None and best["step"] > first and best["gb"] > before["gb"] + tie(before["gb"]):
        best["before_windows"] = {k: before[k] for k in ("gb", "stage", "step")}
    return best


def _highest(records: list[dict]) -> dict | None:
    """The peak over `records`: its value, named by the first stage to come within tie() of it (process_peak)."""
    seen = [(v, k, r["step"]) for r in records for k, v in r.items()
            if k.startswith("memory/") and not k.startswith("memory/step/") and "reserved" not in k
            and isinstance(v, (int, float)) and not isinstance(v, bool)]
    if not seen:
        return None
    top = max(v for v, _, _ in seen)
    near = [(k, step) for v, k, step in seen if top - v <= tie(top)]
    metric, step = near[0]
    stage = metric.split("/")[1]
    return {"gb": top, "metric": metric, "stage": stage, "step": step,
            "tied": sorted({k.split("/")[1] for k, _ in near} - {stage})}


TIE_GB = 2**-20     # 1 KiB, the resolution of ru_maxrss: peaks this close are the same counter value ...
TIE_SHARE = 0.01    # ... and so are peaks within 1 %: a resident size held once freed memory is kept creeps by
#                     pages from stage to stage, and which stage crept last is chance (identical runs named others)


def tie(peak: float) -> float:
    return max(TIE_GB, TIE_SHARE * peak)


def peak_text(peak: dict) -> str:
    """The run's process peak in words, the tie and a profiler window's own peak said where there is one."""
    text = f"{peak['gb']:.3g} GB in stage {peak['stage']} at step {peak['step']} ({peak['metric']})"
    if peak.get("profiled"):
        text += " inside a profiler window (every step was profiled: its recording's memory is in it)"
    tied = peak.get("tied") or []
    if tied:
        names = ", ".join(tied[:5]) + (f" and {len(tied) - 5} more" if len(tied) > 5 else "")
        text += (f"; {names} reached the same peak, within {100 * TIE_SHARE:.0f} % (the first is named: a held "
                 "resident size, not one stage's)")
    b = peak.get("before_windows")
    if b:
        text += (f"; before the first profiler window it was {b['gb']:.3g} GB (stage {b['stage']} at step "
                 f"{b['step']}): memory a window frees can stay resident after it")
    w = peak.get("window")
    if w:
        text += (f"; a profiler window reached {w['gb']:.3g} GB in stage {w['stage']} at step {w['step']}, "
                 "its own recording's memory included (left out of the run's peak)")
    return text
