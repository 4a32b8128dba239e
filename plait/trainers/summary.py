"""The end-of-run summary: where the wall time went, what the run reached, where its files are.

    lifecycle:  clock = RunClock()                       wall time of the parts outside steps
                with clock.part("startup"): ...          resume, trainer start
                summarise_run(out_dir, ...)              at the run's end, whatever ended it:
                  summarise(records, clock, ...) -> dict   from this run's metrics.jsonl records
                  + settings, the profile report's alarms and verdict
                  write_summary(out_dir, summary)          summary.json, and a few console lines

Step, validation and checkpoint time come from the records' `timing_s/*` (the same numbers as
metrics.jsonl); start-up, the validation before step 1 and the profiler's own start/stop/write time
are measured here. `other` is what is left of the wall time (logging, shutdown). It leaves out
anything not in the records: a summary of a resumed run covers the steps this process ran, and
validation over the whole of metrics.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Collection
from typing import Optional

from plait.profiler.analysis.alarms import CAVEAT, alarms, console_lines
from plait.profiler.analysis.memory import peak_text, process_peak
from plait.profiler.analysis.verdict import MIN_SAVING, of_run, profiled_steps, profiler_line, settings_of, verdicts
from plait.profiler.naming import MANIFEST as PROFILE_MANIFEST
from plait.profiler.timeline import TIMELINE_FILE, read_timeline
from plait.trainers.checkpoint import flatten
from plait.trainers.tracking import read_records

SUMMARY_FILE = "summary.json"


class RunClock:
    def __init__(self, start: Optional[float] = None):
        self.start = time.perf_counter() if start is None else start  # a perf_counter reading
        self.parts: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def part(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.parts[name] += time.perf_counter() - t0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def summarise_run(output_dir: str, metrics_path: str, checkpoint: Optional[str], profile_path: Optional[str],
                  run_config: Optional[dict], first: int, last: int, clock: RunClock, profiler_s: float,
                  status: str) -> None:
    """summary.json in the output dir, with the console lines unless the run failed (its error is then the
    last word). `checkpoint` is the newest one, `profile_path` global_profiler.save_path."""
    tb = os.path.join(output_dir, "tensorboard")
    profiled = profile_path and os.path.exists(os.path.join(profile_path, PROFILE_MANIFEST))
    paths = {"output_dir": output_dir, "metrics": metrics_path, "timeline": os.path.join(output_dir, TIMELINE_FILE),
             "checkpoint": checkpoint, "tensorboard": tb if os.path.isdir(tb) else None,
             "profile": profile_path if profiled else None}
    try:
        records = read_records(metrics_path) if os.path.exists(metrics_path) else []
        spans = run_spans(output_dir, first)
        summary = summarise(records, first, last, clock, profiler_s, paths, status, profiled_steps(spans))
        summary["settings"] = settings_of(flatten(run_config or {}), memory_capacity_gb(), device_kind())
        summary["load"] = machine_load()
        summary["alarms"], summary["verdict"], summary["profiler"], cycle = run_verdict(spans, records, first, summary)
        if cycle is not None:  # one step time everywhere: the report's and the verdict's cycle
            summary["step_s"] = cycle
        write_summary(output_dir, summary, console=status != "failed")
    except (OSError, ValueError) as err:  # the summary never hides the run's own outcome
        print(f"plait: warning: no run summary written: {type(err).__name__}: {err}", file=sys.stderr)


def run_spans(output_dir: str, first: int) -> list[dict]:
    """This run's timeline spans (steps >= first); none where the timeline is missing or unreadable (said)."""
    path = os.path.join(output_dir, TIMELINE_FILE)
    try:
        return [s for s in read_timeline(path) if s["step"] >= first] if os.path.exists(path) else []
    except (OSError, ValueError, KeyError, TypeError) as err:
        print(f"plait: warning: {path} not read: {type(err).__name__}: {err}", file=sys.stderr)
        return []


def run_verdict(spans: list[dict], records: list[dict], first: int,
                summary: dict) -> tuple[list[dict], list[dict], Optional[dict], Optional[dict]]:
    """The profile report's health alarms (profiler/analysis/alarms.py) and verdict (verdict.py, marked with
    the caveat while an alarm holds) on this run's steps, its profiler line, and the step time it measured
    ({median, p90, basis}: the trainer's cycle, outside profiler windows); a rule that fails says so in one
    line and leaves the summary whole."""
    try:
        ran = [r for r in records if r.get("step", 0) >= first]
        found = [a.as_dict() for a in alarms(spans, ran, summary.get("settings"))]
        f = of_run(spans, ran, summary)
        cycle = {"median": f.step_s, "p90": f.step_p90, "basis": f.basis} if f.steps else None
        caveat = {"caveat": CAVEAT} if found else {}
        return found, [{**v.as_dict(), **caveat} for v in verdicts(f)], profiler_line(f), cycle
    except Exception as err:  # noqa: BLE001 - advice must never cost the run its summary
        print(f"plait: warning: no verdict: {type(err).__name__}: {err}", file=sys.stderr)
        return [], [], None, None


NESTED = {"judge": "reward"}  # a stage timed inside another (the judge's rounds within the reward stage)


def summarise(records: list[dict], first_step: int, last_step: int, clock: RunClock, profiler_s: float,
              paths: dict[str, Optional[str]], status: str, profiled: Collection[int] = ()) -> dict:
    """The summary of one run (one process) from its metrics.jsonl records; `profiled`: the steps inside
    profiler windows (the memory peak leaves them out: memory.process_peak)."""
    ran = [r for r in records if first_step <= r.get("step", 0)]
    step_s = [_num(r, "timing_s/step") for r in ran]
    testing = sum(_num(r, "timing_s/testing") for r in ran)
    ckpt = sum(_num(r, "timing_s/save_checkpoint") for r in ran)
    wall = {"total": clock.elapsed(), "startup": clock.parts["startup"],
            "steps": sum(step_s) - testing - ckpt, "validation": clock.parts["validation"] + testing,
            "checkpoints": ckpt, "profiler": profiler_s}
    wall["other"] = max(wall["total"] - sum(v for k, v in wall.items() if k != "total"), 0.0)
    stages: dict[str, float] = defaultdict(float)
    for r in ran:
        for k, v in r.items():
            if k.startswith("timing_s/") and k not in ("timing_s/step", "timing_s/testing") and _is_num(v):
                stages[k.removeprefix("timing_s/")] += v
    for inner, outer in NESTED.items():  # counted once: the outer stage's share is what the inner one leaves
        if inner in stages and outer in stages:
            stages[outer] = max(stages[outer] - stages[inner], 0.0)
    whole = sum(stages.values()) or 1.0
    return {
        "status": status,
        "steps": {"first": ran[0]["step"] if ran else None, "last": ran[-1]["step"] if ran else None,
                  "done": len(ran), "run_last_step": last_step},
        "wall_s": wall,
        "step_s": {"median": statistics.median(step_s) if step_s else None,
                   "p90": _quantile(step_s, 0.9) if step_s else None},
        "top_stages": [{"stage": k, "total_s": v, "share": v / whole}
                       for k, v in sorted(stages.items(), key=lambda kv: -kv[1])[:4]],
        "validation": _validation(records),
        "memory_peak": process_peak(ran, profiled),
        "paths": paths,
        "next": f"plait profile report {paths['output_dir']}",
    }


def memory_capacity_gb() -> float:
    """The device's memory: the first CUDA device's, else the host's (the verdict's headroom)."""
    import psutil
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30
    return psutil.virtual_memory().total / 2**30


def machine_load() -> Optional[dict]:
    """The host's load averages (/proc/loadavg) at the run's end and its CPU count: two runs timed on a
    machine loaded differently compare poorly (`plait profile diff` warns). None where there are none."""
    try:
        one, five, fifteen = os.getloadavg()
    except OSError:
        return None
    return {"1m": one, "5m": five, "15m": fifteen, "cpus": os.cpu_count() or 1}


def device_kind() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _validation(records: list[dict]) -> Optional[dict]:
    """First, best (with its step) and last of the first val-core mean key the records hold (acc
    where the reward returns it, as verl's core variable, else reward)."""
    key = next((k for r in records for k in r if k.startswith("val-core/") and "/acc/mean@" in k), None)
    key = key or next((k for r in records for k in r if k.startswith("val-core/") and "/reward/mean@" in k), None)
    key = key or next((k for r in records for k in r if k.startswith("val-core/")), None)
    points = [(r["step"], r[key]) for r in records if _is_num(r.get(key))]
    if not points:
        return None
    best = max(points, key=lambda p: p[1])
    return {"key": key, "first": {"step": points[0][0], "value": points[0][1]},
            "best": {"step": best[0], "value": best[1]}, "last": {"step": points[-1][0], "value": points[-1][1]}}


def write_summary(output_dir: str, summary: dict, console: bool = True) -> None:
    path = os.path.join(output_dir, SUMMARY_FILE)
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    if console:
        print("\n".join(f"plait: {line}" for line in summary_lines(summary, path)), file=sys.stderr)


def summary_lines(s: dict, path: str) -> list[str]:
    st, w = s["steps"], s["wall_s"]
    parts = ", ".join(f"{k} {w[k]:.1f} s" for k in ("startup", "steps", "validation", "checkpoints", "profiler", "other"))
    steps = f"steps {st['first']}-{st['last']}" if st["done"] else "no steps"
    lines = [f"{s['status']}: {steps} of {st['run_last_step']} in {w['total']:.1f} s ({parts})"]
    lines += console_lines(s.get("alarms") or [], bool(s.get("verdict")))
    lines += [f"verdict: {v['line']}" for v in s.get("verdict") or []] or (
        [f"verdict: nothing stands out (no stage or setting could save {100 * MIN_SAVING:.0f} % of the step; "
         "docs/profiling.md lists the rules)"] if s["step_s"].get("basis") else [])  # the verdict read the steps
    if s.get("profiler"):
        lines.append(s["profiler"]["line"])
    if s["step_s"]["median"] is not None:
        top = ", ".join(f"{t['stage']} {100 * t['share']:.0f}%" for t in s["top_stages"])
        basis = f" ({s['step_s']['basis']})" if s["step_s"].get("basis") else ""
        lines.append(f"step time median {s['step_s']['median']:.3f} s, p90 {s['step_s']['p90']:.3f} s{basis}; top stages: {top}")
    v = s["validation"]
    if v:
        lines.append(f"validation {v['key']}: first {v['first']['value']:.4g} (step {v['first']['step']}), best "
                     f"{v['best']['value']:.4g} (step {v['best']['step']}), last {v['last']['value']:.4g} (step {v['last']['step']})")
    m = s["memory_peak"]
    if m:
        lines.append(f"memory peak {peak_text(m)}")
    files = [f"{k} {p}" for k, p in s["paths"].items() if p and k != "output_dir"]
    lines.append("files: " + " · ".join(files + [f"summary {path}"]))
    lines.append(f"next: {s['next']}")
    return lines


def _num(r: dict, key: str) -> float:
    v = r.get(key, 0.0)
    return v if _is_num(v) else 0.0


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]
