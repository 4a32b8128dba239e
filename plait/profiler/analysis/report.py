"""`plait profile report DIR`: one offline page and one merged trace from a run's files.

    DIR (a run's output dir and/or a profiler save_path)
      timeline.jsonl   metrics.jsonl          the run: stage spans, per-step metrics
      manifest.jsonl + step*/…                the profiler: torch traces, memory artifacts
    ─▶ DIR/report/index.html        Gantt per step · stage breakdown · windows' top ops · memory
       DIR/report/timeline.json.gz  every span and every torch trace on one clock (Perfetto)
       and a short text summary (returned, printed by the CLI)

The profiler's save_path is found as DIR itself, DIR/profile, or given (`--profile`); the run's
files as DIR itself or given (`--run`). Whatever is missing is left out of the page, and said so.
"""

from __future__ import annotations

import html
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from plait.profiler.analysis import memory as mem
from plait.profiler.analysis import svg
from plait.profiler.analysis.traces import Trace, load_trace, merged_trace, top_ops, write_trace
from plait.profiler.naming import read_manifest
from plait.profiler.timeline import TIMELINE_FILE, read_timeline
from plait.safeload import load_pickle

MAX_GANTT_STEPS = 16


@dataclass
class Inputs:
    run_dir: Optional[str]
    profile_dir: Optional[str]
    spans: list[dict]
    metrics: list[dict]
    manifest: list[dict]


def locate(path: str, profile: Optional[str] = None, run: Optional[str] = None) -> Inputs:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a directory")
    has = lambda d, f: d is not None and os.path.exists(os.path.join(d, f))  # noqa: E731
    run = run or (path if has(path, TIMELINE_FILE) or has(path, "metrics.jsonl") else None)
    profile = profile or next((d for d in (path, os.path.join(path, "profile")) if has(d, "manifest.jsonl")), None)
    if run is None and profile is None:
        raise FileNotFoundError(f"{path}: no timeline.jsonl, metrics.jsonl or manifest.jsonl here "
                                "(give a run's output dir or a profiler save_path)")
    spans = read_timeline(os.path.join(run, TIMELINE_FILE)) if has(run, TIMELINE_FILE) else []
    metrics = _read_jsonl(os.path.join(run, "metrics.jsonl")) if has(run, "metrics.jsonl") else []
    return Inputs(run, profile, spans, [m for m in metrics if m.get("step", 0) >= 1],
                  read_manifest(profile) if profile else [])


def _read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def build_report(path: str, profile: Optional[str] = None, run: Optional[str] = None) -> str:
    """Write DIR/report/{index.html, timeline.json.gz}; returns the text summary."""
    inp = locate(path, profile, run)
    out_dir = os.path.join(path, "report")
    os.makedirs(out_dir, exist_ok=True)
    traces, memories, notes = [], [], []
    for rec in inp.manifest:
        file = os.path.join(inp.profile_dir, rec["path"]) if rec["path"] else None
        if file is None or not os.path.exists(file):
            notes.append(f"{rec['path'] or rec['role']}: no file (complete={rec['complete']})")
            continue
        try:
            if file.endswith(".pickle"):
                snapshot = load_pickle(file)  # plain data only: a crafted folder runs nothing
                stages = inp.spans + mem.snapshot_stages(snapshot)
                memories.append((rec, file, mem.cuda_snapshot(snapshot, _trainer_stages(stages))))
            elif ".json" in file:
                trace = load_trace(file, rec)
                traces.append(trace)
                if rec["tool"] == "torch_memory":
                    memories.append((rec, file, mem.cpu_trace(trace.events, _trainer_stages(inp.spans))))
        except Exception as err:  # one unreadable artifact must not hide the others
            notes.append(f"{rec['path']}: could not be read ({type(err).__name__}: {err})")
    drivers = {s["pid"]: "driver" for s in inp.spans}
    write_trace(merged_trace(inp.spans, traces, drivers), os.path.join(out_dir, "timeline.json.gz"))
    page = _page(inp, traces, memories, notes, out_dir)
    with open(os.path.join(out_dir, "index.html"), "w") as f:
        f.write(page)
    return summary(inp, traces, memories, out_dir)


def _trainer_stages(spans: list[dict]) -> list[dict]:
    return [s for s in spans if s["role"] in ("trainer", "snapshot")]


# -- the text summary ---------------------------------------------------------------------------

def summary(inp: Inputs, traces: list[Trace], memories: list, out_dir: str) -> str:
    lines = [f"plait profile report: {os.path.join(out_dir, 'index.html')}",
             f"  merged trace: {os.path.join(out_dir, 'timeline.json.gz')} (open in ui.perfetto.dev)"]
    steps = [m["step"] for m in inp.metrics]
    if steps:
        times = [m.get("perf/time_per_step", 0.0) for m in inp.metrics]
        lines.append(f"  steps {min(steps)}-{max(steps)}: mean step {sum(times) / len(times):.3f} s")
        stages = _stage_totals(inp.metrics)
        total = sum(stages.values()) or 1.0
        top = sorted(stages.items(), key=lambda kv: -kv[1])[:4]
        lines.append("  time by stage: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in top))
        for key in ("trainer/idle_ratio", "rollouter/idle_ratio"):
            vals = [m[key] for m in inp.metrics if key in m]
            if vals:
                lines.append(f"  {key}: mean {sum(vals) / len(vals):.2f}")
    lines.append(f"  profiled artifacts: {len(inp.manifest)} ({len(traces)} torch traces)")
    for rec, file, r in memories:
        site = r.top_sites[0][0] if r.top_sites else "-"
        lines.append(f"  memory {rec['path']}: peak {r.peak_bytes / 2**20:.1f} MiB in {r.peak_stage}; top site {site}")
    return "\n".join(lines)


def _stage_totals(metrics: list[dict]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for m in metrics:
        for k, v in m.items():
            if k.startswith("timing_s/") and k != "timing_s/step":
                out[k.removeprefix("timing_s/")] += v
    return dict(out)


# -- the page -----------------------------------------------------------------------------------

CSS = """body{font-family:system-ui,sans-serif;margin:24px;max-width:960px;color:#222}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:32px}
h3{font-size:14px;margin:18px 0 6px}table{border-collapse:collapse;font-size:12px;margin:6px 0}
td,th{border:1px solid #ddd;padding:2px 6px;text-align:left}td.n{text-align:right}
.note{color:#666;font-size:12px}svg{display:block;margin:4px 0}code{font-size:12px}"""


def _esc(x) -> str:
    return html.escape(str(x))


def _table(header: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f'<td class="n">{_fmt(c)}</td>' if isinstance(c, (int, float)) else
                                    f"<td>{_esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _page(inp: Inputs, traces: list[Trace], memories: list, notes: list[str], out_dir: str) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>plait profile report</title>"
             f"<style>{CSS}</style></head><body><h1>plait profile report</h1>",
             f"<p class='note'>run: {_esc(inp.run_dir or '(none)')} · profiler save_path: "
             f"{_esc(inp.profile_dir or '(none)')} · merged trace: <a href='timeline.json.gz'>timeline.json.gz</a> "
             "(open in ui.perfetto.dev)</p>"]
    parts.append(_gantt_section(inp))
    parts.append(_breakdown_section(inp))
    parts.append(_windows_section(traces, inp.profile_dir, out_dir))
    parts.append(_memory_section(inp, memories, out_dir))
    if notes:
        parts.append("<h2>Artifacts not shown</h2><ul>" + "".join(f"<li>{_esc(n)}</li>" for n in notes) + "</ul>")
    return "".join(parts) + "</body></html>"


def _gantt_section(inp: Inputs) -> str:
    out = ["<h2 id='gantt'>1. Stages per step</h2>"]
    if not inp.spans:
        return out[0] + "<p class='note'>No timeline.jsonl: give the run's output dir.</p>"
    lanes = sorted({f"{s['role']} ({s['thread']})" for s in inp.spans}, key=lambda l: (not l.startswith("trainer"), l))
    steps = sorted({s["step"] for s in inp.spans if s["role"] == "trainer" and s["stage"] == "step"})
    shown = steps if len(steps) <= MAX_GANTT_STEPS else [steps[round(i * (len(steps) - 1) / (MAX_GANTT_STEPS - 1))]
                                                         for i in range(MAX_GANTT_STEPS)]
    out.append("<p class='note'>One row per role and thread; gaps in a row are idle time (bubbles). "
               "Hover a bar for stage, step and policy version.</p>")
    by_step = {s["step"]: s for s in inp.spans if s["role"] == "trainer" and s["stage"] == "step"}
    bars = [(f"{s['role']} ({s['thread']})", s["stage"], s["start"], s["end"],
             f"{s['stage']} · step {s['step']} · v{s['version']} · {1000 * (s['end'] - s['start']):.1f} ms")
            for s in inp.spans if s["stage"] != "step"]
    for step in shown:
        w = by_step[step]
        out.append(f"<h3>step {step} · {w['end'] - w['start']:.3f} s · policy version {w['version']}</h3>")
        out.append(svg.gantt(lanes, bars, w["start"], w["end"]))
    out.append(svg.key(sorted({b[1] for b in bars})))
    keys = ["trainer/idle_ratio", "rollouter/idle_ratio", "training/staleness/mean", "training/staleness/max"]
    keys = [k for k in keys if any(k in m for m in inp.metrics)]
    if keys:
        out.append("<h3>Idle ratios and staleness per step</h3>")
        xs = [m["step"] for m in inp.metrics]
        out.append(svg.lines(xs, {k: [m.get(k, float("nan")) for m in inp.metrics] for k in keys}))
        out.append(_table(["step", *keys], [[m["step"], *[m.get(k, "") for k in keys]] for m in inp.metrics]))
    return "".join(out)


def _breakdown_section(inp: Inputs) -> str:
    out = ["<h2 id='breakdown'>2. Where the time went</h2>"]
    if not inp.metrics:
        return out[0] + "<p class='note'>No metrics.jsonl: give the run's output dir.</p>"
    xs = [m["step"] for m in inp.metrics]
    stages = sorted({k.removeprefix("timing_s/") for m in inp.metrics for k in m
                     if k.startswith("timing_s/") and k != "timing_s/step"})
    out.append("<h3>Stage time per step (stacked, seconds)</h3>")
    out.append(svg.stacked_bars(xs, {s: [m.get(f"timing_s/{s}", 0.0) for m in inp.metrics] for s in stages}))
    totals = _stage_totals(inp.metrics)
    whole = sum(totals.values()) or 1.0
    out.append(_table(["stage", "total s", "share %"], [[k, v, 100 * v / whole] for k, v in
                                                        sorted(totals.items(), key=lambda kv: -kv[1])]))
    for key, unit in (("perf/time_per_step", "s"), ("perf/throughput", "tokens/s/device")):
        out.append(f"<h3>{key} ({unit})</h3>")
        out.append(svg.lines(xs, {key: [m.get(key, float("nan")) for m in inp.metrics]}, unit))
    peaks: dict[str, float] = defaultdict(float)
    for m in inp.metrics:
        for k, v in m.items():
            if k.startswith("memory/"):
                peaks[k] = max(peaks[k], v)
    if peaks:
        out.append("<h3>Peak memory per stage (max over steps, GB)</h3>")
        out.append(_table(["metric", "GB"], sorted(peaks.items())))
    return "".join(out)


def _windows_section(traces: list[Trace], profile_dir: Optional[str], out_dir: str) -> str:
    out = ["<h2 id='windows'>3. Profiled windows</h2>"]
    if not traces:
        return out[0] + "<p class='note'>No torch traces in the manifest.</p>"
    for t in traces:
        r = t.record
        link = os.path.relpath(os.path.join(profile_dir, r["path"]), out_dir)
        out.append(f"<h3>steps {r['steps'][0]}-{r['steps'][1]} · {_esc(t.label)}"
                   f"{' · ' + _esc(r['stage']) if r['stage'] else ''} · pid {r['pid']} · policy version "
                   f"{r['policy_version']} · {'complete' if r['complete'] else 'INCOMPLETE'}</h3>"
                   f"<p class='note'>raw: <a href='{_esc(link)}'>{_esc(r['path'])}</a></p>")
        ops = top_ops(t, n=8)
        rows = [[stage, op, us / 1000, calls] for stage in sorted(ops) for op, us, calls in ops[stage]]
        out.append(_table(["stage", "operator (self time)", "ms", "calls"], rows))
    return "".join(out)


def _memory_section(inp: Inputs, memories: list, out_dir: str) -> str:
    out = ["<h2 id='memory'>4. Memory</h2>"]
    if not memories:
        return out[0] + "<p class='note'>No torch_memory artifacts (global_profiler.tool=torch_memory).</p>"
    run_start = min((s["start"] for s in inp.spans), default=None)
    for rec, file, r in memories:
        link = os.path.relpath(file, out_dir)
        when = f"{r.peak_time - run_start:.3f} s after the run's first stage" if run_start else f"t={r.peak_time:.3f}"
        out.append(f"<h3>{_esc(rec['path'])} · {_esc(rec['role'])} rank {rec['rank']} · {r.device}</h3>"
                   f"<p>peak <b>{r.peak_bytes / 2**20:.2f} MiB</b> at {when}, in stage <b>{_esc(r.peak_stage)}</b>"
                   f" · raw: <a href='{_esc(link)}'>{_esc(os.path.basename(file))}</a></p>")
        out.append(svg.area(r.series, [(s["stage"], s["start"], s["end"]) for s in _trainer_stages(inp.spans)
                                       if s["stage"] != "step"]))
        out.append("<p class='note'>Top allocation sites live at the peak (innermost frame outside torch):</p>")
        out.append(_table(["site", "MiB"], [[s, b / 2**20] for s, b in r.top_sites]))
        out.append("<p class='note'>Growth per stage (allocated at exit minus entry, summed):</p>")
        out.append(_table(["stage", "MiB"], [[s, b / 2**20] for s, b in sorted(r.growth.items(), key=lambda kv: -abs(kv[1]))]))
    return "".join(out)
