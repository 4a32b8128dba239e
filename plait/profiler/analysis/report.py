"""`plait profile report DIR`: one offline page and one merged trace from a run's files.

    DIR (a run's output dir and/or a profiler save_path)
      timeline.jsonl   metrics.jsonl          the run: stage spans, per-step metrics
      manifest.jsonl + step*/…                the profiler: torch traces, memory artifacts
    ─▶ DIR/report/index.html        verdict · Gantt per step · stage breakdown · windows' top ops · memory
       DIR/report/timeline.json.gz  every span and every torch trace on one clock (Perfetto)
       DIR/report/verdict.json      the verdict with each rule's inputs and predicted bound (verdict.py)
       and a short text summary, the verdict first (returned, printed by the CLI)

The profiler's save_path is found as DIR itself, DIR/profile, or given (`--profile`); the run's
files as DIR itself or given (`--run`). Whatever is missing is left out of the page, and said so.
A folder may come from someone else: every file read is below the folder it was found in (DIR,
--profile, --run), symbolic links resolved; a manifest path or a recorded save_path that leads
elsewhere (`..`, absolute, a link out) is not read, and the page says so.
"""

from __future__ import annotations

import html
import json
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from plait.profiler.analysis import memory as mem
from plait.profiler.analysis import svg, verdict
from plait.profiler.analysis.traces import Trace, load_trace, merged_trace, top_ops, top_ops_overall, write_trace
from plait.profiler.naming import LOCATION, MANIFEST, read_location, read_manifest
from plait.profiler.timeline import TIMELINE_FILE
from plait.safeload import load_pickle

MAX_GANTT_STEPS = 16
VERDICT_FILE = "verdict.json"


@dataclass
class Inputs:
    run_dir: Optional[str]
    profile_dir: Optional[str]
    spans: list[dict]
    metrics: list[dict]
    manifest: list[dict]
    looked: list[str]          # where a manifest was looked for (said when none was found)


def locate(path: str, profile: Optional[str] = None, run: Optional[str] = None) -> Inputs:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a directory")
    has = lambda d, f: d is not None and below(d, f) is not None and os.path.exists(os.path.join(d, f))  # noqa: E731
    run = run or (path if has(path, TIMELINE_FILE) or has(path, "metrics.jsonl") else None)
    # the save_path the run recorded wins when it is inside DIR: a copied run's points at the original
    recorded = read_location(run) if has(run, LOCATION) else None
    outside = [f"{recorded} (the run's recorded save_path: outside {path}, not read; give --profile)"] \
        if recorded and below(path, recorded) is None else []
    looked = [profile] if profile else list(dict.fromkeys(
        d for d in (recorded if not outside else None, path, os.path.join(path, "profile")) if d))
    profile = next((d for d in looked if has(d, MANIFEST)), None)
    looked += outside
    if run is None and profile is None:
        raise FileNotFoundError(f"{path}: no timeline.jsonl, metrics.jsonl or manifest.jsonl here, nor a "
                                f"manifest in {', '.join(looked)} (give a run's output dir or a profiler save_path)")
    spans = _read_jsonl(os.path.join(run, TIMELINE_FILE)) if has(run, TIMELINE_FILE) else []
    metrics = _read_jsonl(os.path.join(run, "metrics.jsonl")) if has(run, "metrics.jsonl") else []
    spans = [s for s in spans if _typed(s, SPAN_FIELDS) and isinstance(s.get("version"), (int, type(None)))]
    metrics = [_numbers(m) for m in metrics if isinstance(m.get("step"), int)]
    return Inputs(run, profile, spans, [m for m in metrics if m["step"] >= 1],
                  [r for r in read_manifest(profile) if _well_formed(r)] if profile else [], looked)


# The shapes plait writes; a line of another shape (hand-edited, crafted) is skipped, not a traceback.
RECORD_FIELDS = {"steps": list, "role": str, "rank": int, "pid": int, "tool": str, "complete": bool}
NULLABLE_FIELDS = {"path": str, "stage": str, "policy_version": int}
SPAN_FIELDS = {"step": int, "role": str, "stage": str, "pid": int, "thread": str, "start": (int, float),
               "end": (int, float)}


def _typed(rec: dict, fields: dict) -> bool:
    return all(isinstance(rec.get(k), t) for k, t in fields.items())


def _well_formed(rec: dict) -> bool:
    """A manifest line as the profiler writes it."""
    return _typed(rec, RECORD_FIELDS) and all(isinstance(rec.get(k), (t, type(None))) for k, t in NULLABLE_FIELDS.items())


def _numbers(record: dict) -> dict:
    """A metrics line's numbers (plait logs only numbers; anything else is not plotted)."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def below(root: str, rel: str) -> Optional[str]:
    """`root`/`rel` when it resolves (links followed) inside `root`; None when it leads out of it
    (`..`, an absolute path, a symbolic link elsewhere)."""
    full = os.path.join(root, rel)
    real_root = os.path.realpath(root)
    return full if os.path.commonpath([real_root, os.path.realpath(full)]) == real_root else None


def _read_jsonl(path: str) -> list[dict]:
    """The JSON objects of a JSONL file; a torn or foreign line is skipped."""
    rows = []
    with open(path, errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def build_report(path: str, profile: Optional[str] = None, run: Optional[str] = None) -> str:
    """Write DIR/report/{index.html, timeline.json.gz}; returns the text summary."""
    inp = locate(path, profile, run)
    out_dir = os.path.join(path, "report")
    for link in (out_dir, os.path.join(out_dir, "index.html"), os.path.join(out_dir, "timeline.json.gz")):
        if os.path.islink(link):  # a planted link: the report is written in the folder, never through it
            os.unlink(link)
    os.makedirs(out_dir, exist_ok=True)
    traces, memories, notes = [], [], []
    for rec in inp.manifest:
        file = below(inp.profile_dir, rec["path"]) if rec["path"] else None
        if rec["path"] and file is None:
            notes.append(f"{rec['path']}: outside the profile folder {inp.profile_dir}; not read")
            continue
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
    judged = verdict.report(verdict.of_run(inp.spans, inp.metrics, _run_summary(inp.run_dir)))
    with open(os.path.join(out_dir, VERDICT_FILE), "w") as f:
        json.dump(judged, f, indent=1)
    page = _page(inp, traces, memories, notes, out_dir, judged)
    with open(os.path.join(out_dir, "index.html"), "w") as f:
        f.write(page)
    return summary(inp, traces, memories, out_dir, judged)


def _trainer_stages(spans: list[dict]) -> list[dict]:
    return [s for s in spans if s["role"] in ("trainer", "snapshot")]


# -- the text summary ---------------------------------------------------------------------------

def summary(inp: Inputs, traces: list[Trace], memories: list, out_dir: str, judged: dict) -> str:
    lines = [f"verdict: {v['line']}" for v in judged["verdicts"]] or ["verdict: nothing stands out"]
    lines += [f"  evidence: {'; '.join(v['evidence'])}" for v in judged["verdicts"][:1]]
    lines += [f"plait profile report: {os.path.join(out_dir, 'index.html')}",
              f"  merged trace: {os.path.join(out_dir, 'timeline.json.gz')} (open in ui.perfetto.dev)",
              f"  verdict's inputs: {os.path.join(out_dir, VERDICT_FILE)}"]
    steps = [m["step"] for m in inp.metrics]
    if steps:
        times = [m.get("perf/time_per_step", 0.0) for m in inp.metrics]
        lines.append(f"  steps {min(steps)}-{max(steps)}: step time p50 {_quantile(times, 0.5):.3f} s, "
                     f"p90 {_quantile(times, 0.9):.3f} s")
        stages = _stage_totals(inp.metrics)
        total = sum(stages.values()) or 1.0
        top = sorted(stages.items(), key=lambda kv: -kv[1])[:4]
        lines.append("  time by stage: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in top))
        for key in ("trainer/idle_ratio", "rollouter/idle_ratio"):
            vals = [m[key] for m in inp.metrics if key in m]
            if vals:
                lines.append(f"  {key}: mean {sum(vals) / len(vals):.2f}")
    where = inp.profile_dir or "no manifest.jsonl in " + ", ".join(inp.looked)
    lines.append(f"  profiled artifacts: {len(inp.manifest)} ({len(traces)} torch traces; {where})")
    for rec, file, r in memories:
        site = r.top_sites[0][0] if r.top_sites else "-"
        lines.append(f"  memory {rec['path']}: window peak {r.peak_bytes / 2**20:.1f} MiB in {r.peak_stage} "
                     f"{_when(inp.spans, r.peak_time)}; top site {site}")
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
    head = "".join(f"<th>{_esc(h)}</th>" for h in header) if any(header) else ""
    body = "".join("<tr>" + "".join(f'<td class="n">{_fmt(c)}</td>' if isinstance(c, (int, float)) else
                                    f"<td>{_esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table>{'<tr>' + head + '</tr>' if head else ''}{body}</table>"


def _fmt(x) -> str:
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _page(inp: Inputs, traces: list[Trace], memories: list, notes: list[str], out_dir: str, judged: dict) -> str:
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>plait profile report</title>"
             f"<style>{CSS}</style></head><body><h1>plait profile report</h1>",
             f"<p class='note'>run: {_esc(inp.run_dir or '(none)')} · profiler save_path: "
             f"{_esc(inp.profile_dir or '(none)')} · merged trace: <a href='timeline.json.gz'>timeline.json.gz</a> "
             "(open in ui.perfetto.dev)</p>"]
    parts.append(_verdict_section(judged))
    parts.append(_summary_box(inp, traces, memories))
    parts.append(_gantt_section(inp))
    parts.append(_breakdown_section(inp))
    parts.append(_windows_section(traces, inp.profile_dir, out_dir))
    parts.append(_memory_section(inp, memories, out_dir))
    parts.append(_learning_section(inp))
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
        out.append(f"<h3>step {step} · {w['end'] - w['start']:.3f} s · policy version {_esc(w['version'])}</h3>")
        out.append(svg.gantt(lanes, bars, w["start"], w["end"]))
    out.append(svg.key(sorted({b[1] for b in bars})))
    keys = ["trainer/idle_ratio", "rollouter/idle_ratio", "training/staleness/mean", "training/staleness/max"]
    keys = [k for k in keys if any(k in m for m in inp.metrics)]
    out.append("<h3>Idle ratios and staleness per step</h3>")
    if not keys:
        out.append("<p class='note'>No idle ratios in metrics.jsonl (a run from before they were measured in "
                   "every mode).</p>")
        return "".join(out)
    xs = [m["step"] for m in inp.metrics]
    out.append("<p class='note'>idle ratio: the share of the step a side waited (sync: the trainer during "
               "gen, the rollout during the training stages; async: measured waits). Staleness: policy versions "
               "between a sample's generation and its update.</p>")
    out.append(svg.lines(xs, {k: [m.get(k, float("nan")) for m in inp.metrics] for k in keys}, "ratio / versions"))
    out.append(_per_step_table(inp.metrics, keys))
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
        out.append("<h3>Process peak memory per stage (max over steps, GB)</h3>")
        out.append("<p class='note'>From metrics.jsonl: the whole process's peak while the stage ran, with "
                   "everything already live (weights, optimizer state): peak RSS on CPU, the allocator's "
                   "peak on CUDA.</p>")
        if len(set(peaks.values())) == 1:  # every stage hit the same high: peaks without a per-stage reset
            k = next(iter(peaks))
            out.append(f"<p class='note'>every stage: {_fmt(peaks[k])} GB (first at step {_argmax_step(inp.metrics, k)}); "
                       "the same value everywhere means the counter was not reset per stage (an async rollouter "
                       "thread in the process), so it shows the process's high-water mark.</p>")
        else:
            out.append(_table(["metric", "GB", "at step"], [[k, v, _argmax_step(inp.metrics, k)] for k, v in sorted(peaks.items())]))
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
        overall = top_ops_overall(t, n=10)
        out.append("<p class='note'>Top operators across every stage of the window (self time):</p>")
        out.append(_table(["operator", "ms", "calls", "most in stage"], [[op, us / 1000, c, st] for op, us, c, st in overall]))
        ops = top_ops(t, n=8)
        rows = [[stage, op, us / 1000, calls] for stage in sorted(ops) for op, us, calls in ops[stage]]
        out.append("<p class='note'>Per stage (an update's mini-batch ranges count in the update):</p>")
        out.append(_table(["stage", "operator (self time)", "ms", "calls"], rows))
    return "".join(out)


def _memory_section(inp: Inputs, memories: list, out_dir: str) -> str:
    out = ["<h2 id='memory'>4. Memory</h2>"]
    if not memories:
        return out[0] + "<p class='note'>No torch_memory artifacts (global_profiler.tool=torch_memory).</p>"
    for rec, file, r in memories:
        link = os.path.relpath(file, out_dir)
        out.append(f"<h3>{_esc(rec['path'])} · {_esc(rec['role'])} rank {rec['rank']} · {r.device}</h3>"
                   f"<p>window peak <b>{r.peak_bytes / 2**20:.2f} MiB</b> {_esc(_when(inp.spans, r.peak_time))}, "
                   f"in stage <b>{_esc(r.peak_stage)}</b> · raw: <a href='{_esc(link)}'>{_esc(os.path.basename(file))}</a></p>")
        out.append(f"<p class='note'>{_esc(_what_it_counts(r.device))} {_esc(_process_peak(inp.metrics, rec))}</p>")
        out.append(svg.area(r.series, [(s["stage"], s["start"], s["end"]) for s in _trainer_stages(inp.spans)
                                       if s["stage"] != "step"]))
        out.append("<p class='note'>Top allocation sites live at the window peak (innermost frame outside torch):</p>")
        out.append(_table(["site", "MiB"], [[s, b / 2**20] for s, b in r.top_sites]))
        out.append("<p class='note'>Growth per stage (allocated at exit minus entry, summed over the window):</p>")
        out.append(_table(["stage", "MiB"], [[s, b / 2**20] for s, b in sorted(r.growth.items(), key=lambda kv: -abs(kv[1]))]))
    return "".join(out)


def _what_it_counts(device: str) -> str:
    if device == "cpu":
        return ("Counts CPU tensor allocations made inside the window, from 0 at its start: memory live "
                "before the window (weights, optimizer state) is not in it.")
    return (f"Counts {device} allocator memory: blocks allocated in the window, plus blocks live when the "
            "snapshot was taken that the window never allocated (counted from its start).")


def _process_peak(metrics: list[dict], rec: dict) -> str:
    """The process-wide peak of the window's steps from metrics.jsonl, to set the window peak against."""
    first, last = rec["steps"] or (None, None)
    inside = [m for m in metrics if first is not None and first <= m["step"] <= last]
    best = max(((v, k, m["step"]) for m in inside for k, v in m.items() if k.startswith("memory/")
                and not k.startswith("memory/step/") and "reserved" not in k and isinstance(v, (int, float))),
               default=None)
    if best is None:
        return ""
    v, k, step = best
    return (f"The process's own peak in these steps, everything live included, was {v:.3g} GB "
            f"({k} at step {step}, metrics.jsonl).")


def _when(spans: list[dict], t: float) -> str:
    """`t` as seconds into its step and its innermost trainer stage (both from the timeline)."""
    trainer = [s for s in spans if s["role"] == "trainer" and s["start"] <= t <= s["end"]]
    step = next((s for s in trainer if s["stage"] == "step"), None)
    if step is None:
        return "(outside the timeline's steps)"
    inner = min((s for s in trainer if s["stage"] != "step"), key=lambda s: s["end"] - s["start"], default=None)
    text = f"at {t - step['start']:.3f} s into step {step['step']}"
    return text + (f" ({t - inner['start']:.3f} s into {inner['stage']})" if inner else "")


# -- the verdict, the summary box and the learning curves ------------------------------------------

def _verdict_section(judged: dict) -> str:
    """Each verdict with the numbers it rests on; the step's time per thread beside them."""
    out = ["<h2 id='verdict'>Verdict</h2>"]
    if not judged["verdicts"]:
        out.append("<p>Nothing stands out: no rule found a stage or setting that could save 10 % of the step "
                   "(docs/profiling.md lists the rules and their thresholds).</p>")
    for v in judged["verdicts"]:
        out.append(f"<p><b>{_esc(v['line'])}</b></p><p class='note'>rests on: {_esc('; '.join(v['evidence']))} "
                   f"· rule {_esc(v['rule'])} · inputs and predicted bound in {VERDICT_FILE}</p>")
    if judged["skipped_rules"]:
        out.append(f"<p class='note'>rules left out (their records did not read): {_esc('; '.join(judged['skipped_rules']))}</p>")
    f = judged["facts"]
    for title, shares in (("trainer", f["trainer"]), ("rollouter", f["rollouter"])):
        if shares:
            out.append(f"<p class='note'>{title}'s time, median share of the step ({f['step_s']:.3g} s, {f['steps']} steps): "
                       + _esc(", ".join(f"{k} {100 * v:.0f} %" for k, v in shares.items() if v >= 0.005)) + "</p>")
    return "".join(out)



LEARNING = [("val-core/", "validation reward"), ("critic/score/mean", "score"), ("actor/ppo_kl", "KL (actor/ppo_kl)"),
            ("actor/kl_loss", "KL loss"), ("actor/entropy", "entropy"), ("response_length/mean", "response length (tokens)")]


def _learning_section(inp: Inputs) -> str:
    out = ["<h2 id='learning'>5. Learning curves</h2>"]
    records = [m for m in _all_records(inp) if isinstance(m.get("step"), int)]
    shown = 0
    for prefix, label in LEARNING:
        keys = sorted({k for m in records for k in m if k == prefix or (prefix.endswith("/") and k.startswith(prefix))
                       and isinstance(m[k], (int, float))})
        for key in keys[:2]:
            points = [(m["step"], m[key]) for m in records if isinstance(m.get(key), (int, float))]
            if len(points) < 2:
                continue
            out.append(f"<h3>{_esc(label)}: {_esc(key)}</h3>")
            out.append(svg.lines([p[0] for p in points], {key: [p[1] for p in points]}, label.split(" (")[0]))
            shown += 1
    if not shown:
        out.append("<p class='note'>Fewer than two logged points per curve in metrics.jsonl.</p>")
    return "".join(out)


def _all_records(inp: Inputs) -> list[dict]:
    """metrics.jsonl with step 0 (validation before training), which `inp.metrics` leaves out."""
    path = below(inp.run_dir, "metrics.jsonl") if inp.run_dir else None
    return _read_jsonl(path) if path and os.path.exists(path) else []


def _summary_box(inp: Inputs, traces: list, memories: list) -> str:
    rows = []
    times = [m["perf/time_per_step"] for m in inp.metrics if isinstance(m.get("perf/time_per_step"), (int, float))]
    if times:
        rows.append(["steps", f"{inp.metrics[0]['step']}-{inp.metrics[-1]['step']} ({len(times)})"])
        rows.append(["step time", f"p50 {_quantile(times, 0.5):.3f} s · p90 {_quantile(times, 0.9):.3f} s"])
        totals = _stage_totals(inp.metrics)
        whole = sum(totals.values()) or 1.0
        rows.append(["stage shares", ", ".join(f"{k} {100 * v / whole:.0f}%" for k, v in
                                               sorted(totals.items(), key=lambda kv: -kv[1])[:5])])
    for key in ("trainer/idle_ratio", "rollouter/idle_ratio"):
        vals = [m[key] for m in inp.metrics if isinstance(m.get(key), (int, float))]
        if vals:
            rows.append([key, f"mean {sum(vals) / len(vals):.2f} (min {min(vals):.2f}, max {max(vals):.2f})"])
    peak = mem.process_peak(inp.metrics)  # the run summary's memory_peak
    if peak:
        rows.append(["process memory peak", f"{peak['gb']:.3g} GB in stage {peak['stage']} at step {peak['step']} ({peak['metric']})"])
    for rec, _, r in memories:
        site = r.top_sites[0][0] if r.top_sites else "-"
        rows.append([f"window peak {rec['path']}", f"{r.peak_bytes / 2**20:.1f} MiB in {r.peak_stage}, "
                                                   f"{_when(inp.spans, r.peak_time)}; top site {site}"])
    profiled = {s for rec in inp.manifest if rec.get("steps") for s in range(rec["steps"][0], rec["steps"][1] + 1)}
    inside = [m["perf/time_per_step"] for m in inp.metrics if m["step"] in profiled and "perf/time_per_step" in m]
    outside = [m["perf/time_per_step"] for m in inp.metrics if m["step"] not in profiled and "perf/time_per_step" in m]
    if inside and outside:
        rows.append(["profiler overhead", f"profiled steps took {_quantile(inside, 0.5) / _quantile(outside, 0.5):.2f}x "
                                          "the others (medians)"])
    run = _run_summary(inp.run_dir)
    if run:
        w = run["wall_s"]
        rows.append(["wall time", f"{w['total']:.1f} s: " + ", ".join(
            f"{k} {w[k]:.1f} s" for k in ("startup", "steps", "validation", "checkpoints", "profiler", "other")) +
            " (profiler: starting, stopping and writing windows; summary.json)"])
    if not rows:
        return "<p class='note'>Nothing to summarise: no metrics.jsonl and no artifacts.</p>"
    return "<h2 id='summary'>Summary</h2>" + _table(["", ""], rows)


def _run_summary(run_dir: Optional[str]) -> Optional[dict]:
    path = below(run_dir, "summary.json") if run_dir else None
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _quantile(xs: list[float], q: float) -> float:
    """The median for q=0.5 (as summary.json gives it); else the value at rank q (nearest rank)."""
    if q == 0.5:
        return statistics.median(xs)
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def _argmax_step(metrics: list[dict], key: str):
    return max((m for m in metrics if isinstance(m.get(key), (int, float))), key=lambda m: m[key])["step"]


def _per_step_table(metrics: list[dict], keys: list[str]) -> str:
    """A column that never changes is one line, not a column; a long table folds away."""
    constant = [k for k in keys if len({m.get(k) for m in metrics}) == 1]
    varying = [k for k in keys if k not in constant]
    out = ["<p class='note'>constant over every step: " + ", ".join(f"{_esc(k)} = {_fmt(metrics[0].get(k))}"
                                                                     for k in constant) + "</p>"] if constant else []
    if varying:
        table = _table(["step", *varying], [[m["step"], *[m.get(k, "") for k in varying]] for m in metrics])
        out.append(table if len(metrics) <= 20 else f"<details><summary>per-step values ({len(metrics)} steps)"
                                                   f"</summary>{table}</details>")
    return "".join(out)
