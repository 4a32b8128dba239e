"""`plait profile report DIR`: one offline page, the verdict and merged traces from a run's files.

    DIR (a run's output dir and/or a profiler save_path), read as untrusted data (inputs.py)
      timeline.jsonl  metrics.jsonl  samples.jsonl  summary.json     the run: spans, per-step metrics, samples
      manifest.jsonl + step*/…                                       the profiler: torch traces, memory artifacts,
                                                                     memray captures
    ─▶ DIR/report/index.html            verdict · summary · ranks · Gantt per step · stages · samples · windows · memory
       DIR/report/verdict.json          the verdict with each rule's inputs and predicted bound (verdict.py)
       DIR/report/timeline.json.gz      every timeline span (driver, rollouter, every Ray rank) and the
                                        per-sample lanes, on one clock (Perfetto)
       DIR/report/step<N>[-<M>].trace.json.gz   per window: its torch traces from every rank and process,
                                        with the timeline spans of its steps (`--no-merge`: none written)
       DIR/report/step<N>[-<M>]_<role>_rank<r>.memray.html   per memray capture: memray's flame graph
       and a short text summary, the verdict first (returned, printed by the CLI)

Traces are streamed one at a time (traces.py): a window's merged trace is written as its traces are
read, and only the events the tables need are kept, one trace at a time, so memory is bounded by one
trace's kept events, not by the run's. The profiler's save_path is found as DIR itself, DIR/profile, or
given (`--profile`); the run's files as DIR itself or given (`--run`). Whatever is missing is left out
of the page, and said so.
"""

from __future__ import annotations

import html
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional

from plait.profiler.analysis import memory as mem
from plait.profiler.analysis import memray_capture
from plait.profiler.analysis import alarms, served, svg, verdict
from plait.profiler.analysis.accounting import StepTime, account
from plait.profiler.analysis.inputs import Inputs, below, locate, number
from plait.profiler.analysis.traces import (Clock, MergedTrace, load_trace, op_totals, origin_of, timeline_lanes,
                                            top_ops, top_ops_overall)
from plait.profiler.naming import MEMRAY_EXT, sanitise
from plait.safeload import load_pickle

# The page's size is bounded whatever the timeline holds (a million spans, a thousand stage names): per step at
# most MAX_GANTT_BARS bars in MAX_GANTT_LANES rows, MAX_STAGES stages per chart and table (the rest summed
# into one "other"), MAX_BAR_STEPS steps in the stacked bars, svg.MAX_TEXT characters of a name; each cut is
# said on the page. PAGE_BOUND is what that adds up to with crafted names (each "&" is 5 bytes escaped);
# tests/profiler/test_report_bounds.py holds such a page under it.
MAX_GANTT_STEPS = 16
MAX_GANTT_LANES = 32
MAX_GANTT_BARS = 500
MAX_KEY_NAMES = 40
MAX_STAGES = 16
MAX_BAR_STEPS = 200
PAGE_BOUND = 8 << 20
MAX_SAMPLE_LANES = 256
VERDICT_FILE = "verdict.json"
TIMELINE_TRACE = "timeline.json.gz"


@dataclass
class Artifact:
    """One manifest artifact as the page shows it (a trace's events are not kept past its tables)."""
    record: dict
    file: str
    overall: list                      # top operators over the window (traces.top_ops_overall)
    per_stage: dict                    # stage -> top operators
    memory: Optional[mem.MemoryReport]
    merged: Optional[str]              # the window's merged trace, relative to report/
    notes: list
    flame: Optional[str] = None        # a memray capture's flame graph, relative to report/


def build_report(path: str, profile: Optional[str] = None, run: Optional[str] = None, merge: bool = True) -> str:
    """Write DIR/report/ (see the module docstring); returns the text summary."""
    inp = locate(path, profile, run)
    out_dir = os.path.join(path, "report")
    _unlink_planted(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileNotFoundError(f"{out_dir}: exists and is not a folder, and the report is written there; move it")
    os.makedirs(out_dir, exist_ok=True)
    clock = Clock(origin_of(inp.spans, inp.manifest))
    steps = account(inp.spans)
    f = verdict.facts(steps, inp.metrics, inp.summary, inp.spans)
    judged = verdict.report(f, [a.as_dict() for a in alarms.alarms(inp.spans, inp.metrics + inp.nonfinite, f.settings)])
    judged["verdicts"] += [v.as_dict() for v in served.verdicts(inp.spans)]  # plait serve's Tinker sessions
    artifacts = read_artifacts(inp, clock, out_dir, merge)
    if merge:
        merged = MergedTrace(os.path.join(out_dir, TIMELINE_TRACE), clock)
        merged.spans(inp.spans, _process_names(inp))
        merged.samples(sample_lanes(inp.samples, clock, inp.notes))
        merged.close()
    _write(os.path.join(out_dir, VERDICT_FILE), json.dumps(judged, indent=1))
    _write(os.path.join(out_dir, "index.html"), _page(inp, steps, f, artifacts, out_dir, judged, merge))
    return summary(inp, f, artifacts, out_dir, judged, merge)


def _unlink_planted(out_dir: str) -> None:
    """A link planted in report/ (the folder or a file the report writes) is removed, never written through."""
    if os.path.islink(out_dir):
        os.unlink(out_dir)
    if os.path.isdir(out_dir):
        for name in os.listdir(out_dir):
            if os.path.islink(os.path.join(out_dir, name)):
                os.unlink(os.path.join(out_dir, name))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _process_names(inp: Inputs) -> dict[int, str]:
    names = {s["pid"]: "driver" for s in inp.spans if s.get("rank") is None}
    names.update({s["pid"]: f"{s['role']} rank {s['rank']}" for s in inp.spans if s.get("rank") is not None})
    names.update({r["pid"]: f"{r['role']} rank {r['rank']}" for r in inp.manifest})
    return names


def read_artifacts(inp: Inputs, clock: Clock, out_dir: str, merge: bool) -> list[Artifact]:
    """Every manifest artifact, window by window; with `merge`, each window's traces merged into
    report/step<N>[-<M>].trace.json.gz with the timeline spans of its steps."""
    windows: dict = defaultdict(list)
    for rec in inp.manifest:
        windows[tuple(rec["steps"]) if rec["steps"] else None].append(rec)
    lanes = timeline_lanes(inp.spans, clock)
    names = _process_names(inp)
    out = []
    for steps, records in windows.items():
        traced = [r for r in records if r["path"] and ".json" in r["path"]]
        merged = None
        if merge and steps is not None and traced:
            name = f"step{steps[0]}" + (f"-{steps[1]}" if steps[1] != steps[0] else "") + ".trace.json.gz"
            ranks = {r["rank"] for r in traced}  # one rank's traces: HTA reads it from the file (distributedInfo)
            merged = MergedTrace(os.path.join(out_dir, name), clock, next(iter(ranks)) if len(ranks) == 1 else None)
            merged.spans([s for s in inp.spans if steps[0] <= s["step"] <= steps[1]], names)
        for rec in records:
            got = _artifact(inp, rec, clock, lanes, merged, out_dir)
            if got is not None:
                out.append(got)
        if merged is not None:
            merged.close()
    return out


def _artifact(inp: Inputs, rec: dict, clock: Clock, lanes: dict, merged: Optional[MergedTrace],
              out_dir: str) -> Optional[Artifact]:
    """One artifact's tables (or a note saying why it is not shown)."""
    file = below(inp.profile_dir, rec["path"]) if rec["path"] else None
    if rec["path"] and file is None:
        inp.notes.append(f"{rec['path']}: outside the profile folder {inp.profile_dir}; not read")
        return None
    if file is None or not os.path.isfile(file):
        inp.notes.append(f"{rec['path'] or rec['role']}: no file (complete={rec['complete']})")
        return None
    stages = _trainer_stages(inp.spans)
    try:
        if file.endswith(".pickle"):
            snapshot = load_pickle(file)  # plain data only: a crafted folder runs nothing
            report = mem.cuda_snapshot(snapshot, _trainer_stages(stages + mem.snapshot_stages(snapshot)))
            return Artifact(rec, file, [], {}, report, None, [])
        if file.endswith(MEMRAY_EXT):
            return _memray_artifact(inp, rec, file, stages, out_dir)
        if ".json" not in file:
            return None
        trace = load_trace(file, rec, clock, merged)
        totals = op_totals(trace, lanes)
        memory = mem.cpu_trace(trace.events, stages, origin_s=clock.origin_ns / 1e9) if rec["tool"] == "torch_memory" else None
        return Artifact(rec, file, top_ops_overall(totals, n=10), top_ops(totals, n=8), memory,
                        merged and os.path.basename(merged.path), trace.notes)
    except Exception as err:  # noqa: BLE001 - one unreadable artifact must not hide the others
        inp.notes.append(f"{rec['path']}: could not be read ({type(err).__name__}: {str(err)[:200]})")
        return None


def _memray_artifact(inp: Inputs, rec: dict, file: str, stages: list[dict], out_dir: str) -> Optional[Artifact]:
    if not memray_capture.available():
        inp.notes.append(f"{rec['path']}: a memray capture, and memray is not installed here (pip install "
                         "'plait[memray]'): no flame graph or memory chart")
        return None
    flame = sanitise(rec["path"].removesuffix(".bin").replace("/", "_")) + ".html"
    report, heap, notes = memray_capture.report(file, stages, os.path.join(out_dir, flame))
    if report is None:
        inp.notes.append(f"{rec['path']}: " + "; ".join(notes))
        return None
    notes.append(f"memray's own peak of the memory allocated in the window: {heap / 2**20:.2f} MiB")
    return Artifact(rec, file, [], {}, report, None, notes,
                    flame if os.path.isfile(os.path.join(out_dir, flame)) else None)


def _trainer_stages(spans: list[dict]) -> list[dict]:
    return [s for s in spans if s["role"] in ("trainer", "snapshot") and s.get("rank") is None]


def sample_lanes(samples: list[dict], clock: Clock, notes: list[str]) -> list[tuple]:
    """Each sample's spans on one lane of the merged trace, lanes reused once a sample is done (at most
    MAX_SAMPLE_LANES lanes; samples past them are in samples.jsonl only, said in `notes`)."""
    by_sample: dict[str, list[dict]] = defaultdict(list)
    for r in samples:
        by_sample[r["sample"]].append(r)
    free_at: list[int] = []
    rows, left_out = [], 0
    for sample, spans in sorted(by_sample.items(), key=lambda kv: min(r["start"] for r in kv[1])):
        start, end = clock.wall(min(r["start"] for r in spans)), clock.wall(max(r["end"] for r in spans))
        lane = next((i for i, t in enumerate(free_at) if t <= start), None)
        if lane is None:
            if len(free_at) == MAX_SAMPLE_LANES:
                left_out += 1
                continue
            free_at.append(end)
            lane = len(free_at) - 1
        free_at[lane] = end
        for r in sorted(spans, key=lambda r: (r["start"], -(r["end"] - r["start"]))):
            ts = clock.wall(r["start"])
            rows.append((lane + 1, sample, r["span"], ts, max(clock.wall(r["end"]), ts),
                         {"step": r["step"], "version": r["version"], **r["attrs"]}))
    if left_out:
        notes.append(f"samples.jsonl: {left_out} samples past the merged trace's {MAX_SAMPLE_LANES} lanes (in the file only)")
    return rows


# -- the text summary ---------------------------------------------------------------------------

def summary(inp: Inputs, f: verdict.Facts, artifacts: list[Artifact], out_dir: str, judged: dict, merge: bool) -> str:
    lines = alarms.console_lines(judged["alarms"], bool(judged["verdicts"]))
    lines += [f"verdict: {v['line']}" for v in judged["verdicts"]] or ["verdict: nothing stands out"]
    lines += [f"  evidence: {'; '.join(v['evidence'])}" for v in judged["verdicts"][:1]]
    if judged["profiler"]:
        lines.append(judged["profiler"]["line"])
    lines += [f"plait profile report: {os.path.join(out_dir, 'index.html')}",
              f"  verdict's inputs: {os.path.join(out_dir, VERDICT_FILE)}"]
    if merge:
        windows = sorted({a.merged for a in artifacts if a.merged})
        lines.append(f"  merged traces (ui.perfetto.dev): {os.path.join(out_dir, TIMELINE_TRACE)}"
                     + (f"; per window: {', '.join(windows)}" if windows else ""))
    if f.steps:
        lines.append(f"  step time p50 {f.step_s:.3f} s, p90 {f.step_p90:.3f} s ({f.basis}, {f.steps} steps)")
        top = [(k, v) for k, v in f.trainer.items() if k not in verdict.BETWEEN][:4]
        lines.append("  time by stage: " + ", ".join(f"{k} {_pct(v)}" for k, v in top))
    for key in ("trainer/idle_ratio", "rollouter/idle_ratio"):
        if key in f.metrics:
            lines.append(f"  {key}: median {f.metrics[key]:.2f}")
    for name, ranks in f.ranks.items():
        slow, ratio = _slowest(ranks)
        lines.append(f"  ranks in {name}: " + ", ".join(f"rank {r} {v['s']:.3g} s" for r, v in ranks.items())
                     + f"; slowest rank {slow} ({ratio:.2f}x the median's own work)")
    served = served_requests(inp.spans)
    if served:
        totals: dict[str, list[float]] = defaultdict(list)
        for (_, stage), t in served.items():
            totals[stage] += t
        lines.append(f"  served requests ({len({c for c, _ in served})} clients): " + ", ".join(
            f"{stage} {len(t)} x {1000 * sum(t) / len(t):.1f} ms" for stage, t in sorted(totals.items())))
    where = inp.profile_dir or "no manifest.jsonl in " + ", ".join(inp.looked)
    traces = sum(1 for a in artifacts if ".json" in a.file)
    lines.append(f"  profiled artifacts: {len(inp.manifest)} ({traces} torch traces; {where})")
    for a in artifacts:
        if a.memory is not None:
            r = a.memory
            site = r.top_sites[0][0] if r.top_sites else "-"
            lines.append(f"  memory {a.record['path']}: window peak {r.peak_bytes / 2**20:.1f} MiB in {r.peak_stage} "
                         f"{_when(inp.spans, r.peak_time)}; top site {site}")
    lines += [f"  not shown: {n}" for n in inp.notes]
    return "\n".join(lines)


def _slowest(ranks: dict) -> tuple[int, float]:
    work = {r: max(v["s"] - v["wait_s"], 0.0) for r, v in ranks.items()}
    median = sorted(work.values())[(len(work) - 1) // 2]
    slow = max(work, key=work.get)
    return slow, work[slow] / median if median > 0 else 1.0


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
    body = "".join("<tr>" + "".join(f'<td class="n">{_fmt(c)}</td>' if isinstance(c, (int, float)) and
                                    not isinstance(c, bool) else f"<td>{_esc(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table>{'<tr>' + head + '</tr>' if head else ''}{body}</table>"


def _fmt(x) -> str:
    """A number for people: 3 significant digits, no exponent (12,345; 1.23; 0.0123; below 0.001: '<0.001')."""
    if isinstance(x, int) or not number(x):
        return f"{x:,}" if isinstance(x, int) and not isinstance(x, bool) else "-"
    if x == 0:
        return "0"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) < 0.001:
        return "<0.001" if x > 0 else ">-0.001"
    text = f"{x:.3g}"
    return text if "e" not in text else f"{x:.4f}"


def _pct(share: float) -> str:
    return f"{100 * share:.0f} %" if share >= 0.01 else "<1 %"


def _page(inp: Inputs, steps: list[StepTime], f: verdict.Facts, artifacts: list[Artifact], out_dir: str, judged: dict,
          merge: bool) -> str:
    traces = f"merged trace: <a href='{TIMELINE_TRACE}'>{TIMELINE_TRACE}</a> (open in ui.perfetto.dev)" if merge \
        else "no merged traces (--no-merge)"
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>plait profile report</title>"
             f"<style>{CSS}</style></head><body><h1>plait profile report</h1>",
             f"<p class='note'>run: {_esc(inp.run_dir or '(none)')} · profiler save_path: "
             f"{_esc(inp.profile_dir or '(none)')} · {traces}</p>",
             _alarms_section(judged), _verdict_section(judged), _summary_box(inp, f, artifacts, judged), _ranks_section(f),
             _gantt_section(inp, steps), _served_section(inp), _breakdown_section(inp), _samples_section(inp),
             _windows_section(artifacts, inp.profile_dir, out_dir), _memory_section(inp, artifacts, out_dir),
             _learning_section(inp)]
    if inp.notes:
        parts.append("<h2 id='notes'>Not shown</h2><ul>" + "".join(f"<li>{_esc(n)}</li>" for n in inp.notes) + "</ul>")
    return "".join(parts) + "</body></html>"


def _alarms_section(judged: dict) -> str:
    """The run's health alarms, before the verdict: while one holds, its advice may mislead."""
    out = ["<h2 id='alarms'>Alarms</h2>"]
    if not judged["alarms"]:
        return out[0] + ("<p class='note'>None: no stalled stage, groups without signal, truncated responses, engine "
                         "restarts, failures or non-finite losses (docs/profiling.md lists the rules).</p>")
    for a in judged["alarms"]:
        out.append(f"<p><b>{_esc(a['line'])}</b></p><p class='note'>rests on: {_esc('; '.join(a['evidence']))} "
                   f"· rule {_esc(a['rule'])}</p>")
    out.append(f"<p class='note'><b>{_esc(alarms.CAVEAT)}</b> (the verdict below)</p>")
    return "".join(out)


def _verdict_section(judged: dict) -> str:
    """Each verdict with the numbers it rests on; the profiler's cost and the step's time per thread beside them."""
    out = ["<h2 id='verdict'>Verdict</h2>"]
    if not judged["verdicts"]:
        out.append("<p>Nothing stands out: no rule found a stage or setting that could save 10 % of the step "
                   "(docs/profiling.md lists the rules and their thresholds).</p>")
    for v in judged["verdicts"]:
        out.append(f"<p><b>{_esc(v['line'])}</b></p><p class='note'>rests on: {_esc('; '.join(v['evidence']))} "
                   f"· rule {_esc(v['rule'])} · inputs and predicted bound in {VERDICT_FILE}</p>")
    if judged["profiler"]:
        out.append(f"<p class='note'>{_esc(judged['profiler']['line'])}</p>")
    if judged["skipped_rules"]:
        out.append(f"<p class='note'>rules left out (their records did not read): {_esc('; '.join(judged['skipped_rules']))}</p>")
    f = judged["facts"]
    for title, shares in (("trainer", f["trainer"]), ("rollouter", f["rollouter"])):
        if shares:
            out.append(f"<p class='note'>{title}'s time, share of the step ({_fmt(f['step_s'])} s, {f['basis']}, "
                       f"{f['steps']} steps): " + _esc(", ".join(f"{k} {_pct(v)}" for k, v in shares.items() if v >= 0.005))
                       + "</p>")
    return "".join(out)


def _summary_box(inp: Inputs, f: verdict.Facts, artifacts: list[Artifact], judged: dict) -> str:
    rows = []
    numbers = [m["step"] for m in inp.metrics]
    if f.steps and numbers:
        rows.append(["steps", f"{min(numbers)}-{max(numbers)}" + (f" ({len(f.profiled)} inside profiler windows)"
                                                                  if f.profiled else "")])
        rows.append(["step time", f"p50 {f.step_s:.3f} s · p90 {f.step_p90:.3f} s ({f.basis}: each step's cycle "
                                   "on the trainer, from its first span to the next step's)"])
        rows.append(["stage shares", ", ".join(f"{k} {_pct(v)}" for k, v in list(f.trainer.items())[:6])])
    for key in ("trainer/idle_ratio", "rollouter/idle_ratio"):
        vals = [m[key] for m in inp.metrics if key in m]
        if vals:
            rows.append([key, f"mean {sum(vals) / len(vals):.2f} (min {min(vals):.2f}, max {max(vals):.2f})"])
    mfu = {k: v for k, v in f.metrics.items() if k.startswith("perf/mfu/")}
    if mfu:
        rows.append(["MFU (median)", ", ".join(f"{k.removeprefix('perf/mfu/')} {_pct_fine(v)}"
                                               for k, v in sorted(mfu.items())[:MAX_STAGES])
                     + " of this device's measured matmul peak at the model's dtype (workers/flops.py)"])
    peak = mem.process_peak(inp.metrics, f.profiled)  # the run summary's memory_peak
    if peak:
        rows.append(["process memory peak", mem.peak_text(peak)])
    for a in artifacts:
        if a.memory is not None:
            r = a.memory
            site = r.top_sites[0][0] if r.top_sites else "-"
            rows.append([f"window peak {a.record['path']}", f"{r.peak_bytes / 2**20:.1f} MiB in {r.peak_stage}, "
                                                            f"{_when(inp.spans, r.peak_time)}; top site {site}"])
    if judged["profiler"]:
        rows.append(["profiler", judged["profiler"]["line"].removeprefix("profiler: ")])
    w = inp.summary.get("wall_s")
    if w:
        rows.append(["wall time", f"{w['total']:.1f} s: " + ", ".join(
            f"{k} {w[k]:.1f} s" for k in ("startup", "steps", "validation", "checkpoints", "profiler", "other")) +
            " (summary.json)"])
    if not rows:
        return "<p class='note'>Nothing to summarise: no metrics.jsonl and no artifacts.</p>"
    return "<h2 id='summary'>Summary</h2>" + _table(["", ""], rows)


def _pct_fine(x: float) -> str:
    return f"{100 * x:.2g} %" if x < 0.1 else f"{100 * x:.0f} %"


def _ranks_section(f: verdict.Facts) -> str:
    """Per stage run by several ranks: each rank's time, its waits in collectives and its own work."""
    if not f.ranks:
        return ""
    out = ["<h2 id='ranks'>Ranks side by side</h2><p class='note'>From each Ray worker's own spans (recorded every "
           f"step), {_esc(f.basis)}. Own work is the stage less its collectives (all-reduce, all-gather): a rank that "
           "waits there is waiting for a slower one.</p>"]
    for name, ranks in f.ranks.items():
        slow, ratio = _slowest(ranks)
        work = {r: max(v["s"] - v["wait_s"], 0.0) for r, v in ranks.items()}
        median = sorted(work.values())[(len(work) - 1) // 2]
        out.append(f"<h3>{_esc(name)}: slowest rank {slow}, {ratio:.2f}x the median rank's own work</h3>")
        out.append(_table(["rank", "stage s", "waiting s", "own work s", "x median"],
                          [[r, v["s"], v["wait_s"], work[r], work[r] / median if median else 1.0]
                           for r, v in ranks.items()]))
    return "".join(out)


def served_requests(spans: list[dict]) -> dict[tuple[str, str], list[float]]:
    """(client, stage) -> the seconds of each of its spans, for the spans of served clients (a Tinker server's
    sessions: "session" is the training client or sampler, which begins with its session's id)."""
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for s in spans:
        if s.get("session") is not None:
            out[(s["session"], s["stage"])].append(s["end"] - s["start"])
    return out


def _served_section(inp: Inputs) -> str:
    """A server's clients (plait serve's Tinker sessions): per client and stage, its requests' count and times."""
    served = served_requests(inp.spans)
    if not served:
        return ""
    rows = [[client[:svg.MAX_TEXT], stage[:svg.MAX_TEXT], len(t), sum(t), 1000 * sum(t) / len(t), 1000 * max(t)]
            for (client, stage), t in sorted(served.items())]
    cut = len(rows) > MAX_BAR_STEPS
    return ("<h2 id='served'>Served requests</h2><p class='note'>plait serve's Tinker clients (SESSION:train:N, "
            "SESSION:...:sample:N): each job's wait in the queue and its own time; every span is in "
            f"{TIMELINE_TRACE}.</p>" + _table(["client", "stage", "requests", "total s", "mean ms", "max ms"],
                                              rows[:MAX_BAR_STEPS])
            + (f"<p class='note'>{len(rows) - MAX_BAR_STEPS} more rows not shown.</p>" if cut else ""))


def _gantt_section(inp: Inputs, steps: list[StepTime]) -> str:
    out = ["<h2 id='gantt'>1. Stages per step</h2>"]
    if not inp.spans:
        return out[0] + "<p class='note'>No timeline.jsonl: give the run's output dir.</p>"
    if not steps:
        return out[0] + ("<p class='note'>No trainer steps on this timeline" + (" (a server's: see Served requests)"
                                                                              if served_requests(inp.spans) else "")
                         + ".</p>")
    lane = lambda s: f"{s['role']}{'' if s.get('rank') is None else ' rank ' + str(s['rank'])} ({s['thread']})"  # noqa: E731
    lanes = sorted({lane(s) for s in inp.spans}, key=lambda n: (not n.startswith("trainer"), n))
    shown = steps if len(steps) <= MAX_GANTT_STEPS else [steps[round(i * (len(steps) - 1) / (MAX_GANTT_STEPS - 1))]
                                                         for i in range(MAX_GANTT_STEPS)]
    out.append("<p class='note'>One row per role, rank and thread; gaps in a row are idle time (bubbles). A step is its "
               "cycle on the trainer: from its first span to the next step's. Hover a bar for stage, step and version.</p>")
    if len(lanes) > MAX_GANTT_LANES:
        out.append(f"<p class='note'>{len(lanes) - MAX_GANTT_LANES} of {len(lanes)} rows not drawn (the page shows "
                   f"{MAX_GANTT_LANES}, the trainer's first; every row is in {TIMELINE_TRACE}).</p>")
        lanes = lanes[:MAX_GANTT_LANES]
    drawn = set(lanes)
    version = lambda v: "" if v is None else f" · v{v}"  # noqa: E731 - a span outside any policy version has none
    bars = [(lane(s), s["stage"], s["start"], s["end"],
             f"{s['stage'][:60]} · step {s['step']}{version(s['version'])} · {1000 * (s['end'] - s['start']):.1f} ms")
            for s in inp.spans if s["stage"] != "step" and lane(s) in drawn]
    versions = {s["step"]: s["version"] for s in inp.spans if s["role"] == "trainer" and s["stage"] == "step"}
    busy: dict[str, float] = defaultdict(float)  # stage -> seconds drawn, for the key's order
    fill = svg.colours(sorted({b[1] for b in bars}))  # one mapping for every step's chart and the key
    for st in shown:
        t0, t1 = st.start, st.start + st.wall
        inside = [b for b in bars if b[3] > t0 and b[2] < t1]
        longest = sorted(inside, key=lambda b: min(b[3], t1) - max(b[2], t0), reverse=True)[:MAX_GANTT_BARS]
        for b in longest:
            busy[b[1]] += min(b[3], t1) - max(b[2], t0)
        policy = "" if versions.get(st.step) is None else f" · policy version {versions[st.step]}"
        out.append(f"<h3>step {st.step} · {st.wall:.3f} s{policy}</h3>")
        out.append(svg.gantt(lanes, longest, t0, t1, fill))
        if len(inside) > len(longest):
            out.append(f"<p class='note'>{len(longest):,} of {len(inside):,} spans drawn, the longest "
                       f"(the rest are in {TIMELINE_TRACE}).</p>")
    names = sorted(busy, key=lambda k: -busy[k])
    out.append(svg.key(sorted(names[:MAX_KEY_NAMES]), fill))
    if len(names) > MAX_KEY_NAMES:
        out.append(f"<p class='note'>the key names the {MAX_KEY_NAMES} stages with the most time drawn; "
                   f"{len(names) - MAX_KEY_NAMES} more: hover a bar for its name.</p>")
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
    totals = _stage_totals(inp.metrics)
    ranked = sorted(totals, key=lambda k: -totals[k])
    top, rest = sorted(ranked[:MAX_STAGES]), ranked[MAX_STAGES:]
    other = f"{len(rest)} other stages"
    series = {s: [m.get(f"timing_s/{s}", 0.0) for m in inp.metrics] for s in top}
    if rest:
        series[other] = [sum(m.get(f"timing_s/{s}", 0.0) for s in rest) for m in inp.metrics]
    bar_steps = range(len(xs)) if len(xs) <= MAX_BAR_STEPS else \
        [round(i * (len(xs) - 1) / (MAX_BAR_STEPS - 1)) for i in range(MAX_BAR_STEPS)]
    out.append("<h3>Stage time per step (stacked, seconds)</h3>")
    out.append(svg.stacked_bars([xs[i] for i in bar_steps], {k: [v[i] for i in bar_steps] for k, v in series.items()}))
    if len(bar_steps) < len(xs):
        out.append(f"<p class='note'>{len(bar_steps)} of {len(xs)} steps drawn, evenly spaced.</p>")
    whole = sum(totals.values()) or 1.0
    rows = [[k, totals[k], 100 * totals[k] / whole] for k in ranked[:MAX_STAGES]]
    if rest:
        rest_s = sum(totals[k] for k in rest)
        rows.append([other, rest_s, 100 * rest_s / whole])
    out.append(_table(["stage", "total s", "share %"], rows))
    for key, unit in (("perf/time_per_step", "s"), ("perf/throughput", "tokens/s/device")):
        out.append(f"<h3>{key} ({unit})</h3>")
        out.append(svg.lines(xs, {key: [m.get(key, float("nan")) for m in inp.metrics]}, unit))
    mfu = sorted({k for m in inp.metrics for k in m if k.startswith("perf/mfu/")})[:MAX_STAGES]
    if mfu:
        out.append("<h3>MFU per stage (share of this device's measured matmul peak at the model's dtype)</h3>")
        out.append(svg.lines(xs, {k: [m.get(k, float("nan")) for m in inp.metrics] for k in mfu}, "MFU"))
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


def _stage_totals(metrics: list[dict]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for m in metrics:
        for k, v in m.items():
            if k.startswith("timing_s/") and k != "timing_s/step":
                out[k.removeprefix("timing_s/")] += v
    return dict(out)


def _samples_section(inp: Inputs) -> str:
    """Per sample (samples.jsonl): latency histograms, staleness, what happened to them, the slowest ones."""
    if not inp.samples:
        return ""
    lives = sample_lives(inp.samples)
    out = ["<h2 id='samples'>3. Samples</h2><p class='note'>Each sample from its submission to the update that trained "
           "on it (samples.jsonl; the merged trace's <code>samples</code> lanes): queue (waiting for the rollout), gen, "
           "tool, resume, queued (generated, waiting for the trainer), reward; a gateway session's calls as "
           "request_queue, prefill and decode, its agent's own time as agent.</p>"]
    ends = defaultdict(int)
    for life in lives.values():
        ends[life["end"]] += 1
    out.append("<p>" + _esc(", ".join(f"{k}: {v}" for k, v in sorted(ends.items()))) + "</p>")
    done = [x for x in lives.values() if x["end"] == "consumed"]
    for title, values in (("submission to update", [x["total"] for x in done]),
                          (f"generating ({', '.join(GENERATING)})", [part_s(x, GENERATING) for x in done]),
                          (f"waiting ({', '.join(WAITING)})", [part_s(x, WAITING) for x in done])):
        out.append(f"<h3>{_esc(title)}</h3>" + svg.histogram(values, "s", title))
    stale = defaultdict(int)
    for x in done:
        stale[x["staleness"]] += 1
    if stale:
        out.append("<h3>Staleness at the update (policy versions behind)</h3>"
                   + _table(["versions behind", "samples"], [[k, v] for k, v in sorted(stale.items(), key=lambda kv: str(kv[0]))]))
    spent: dict[str, float] = defaultdict(float)
    for x in lives.values():
        for k, v in x["parts"].items():
            spent[k] += v
    spans = sorted(sorted(spent, key=lambda k: -spent[k])[:MAX_STAGES])  # the columns: the spans with the most time
    slow = sorted(lives.items(), key=lambda kv: -kv[1]["total"])[:10]
    out.append("<h3>The slowest samples</h3>" + _table(["sample", "end", "step", "total s", *spans],
                                                        [[k, x["end"], x["step"], x["total"], *[x["parts"].get(s, 0.0) for s in spans]]
                                                         for k, x in slow]))
    return "".join(out)


# A sample's spans by what they are: making it (plait's rollout, an agent loop's turns and tools, a gateway
# session's calls and its agent's own time) or waiting (for the rollout, for an engine round, for the trainer).
GENERATING = ("gen", "prefill", "decode", "tool", "agent", "resume")
WAITING = ("queue", "request_queue", "queued")


def part_s(life: dict, spans: tuple[str, ...]) -> float:
    """A sample's seconds in those spans."""
    return sum(life["parts"].get(s, 0.0) for s in spans)


def sample_lives(samples: list[dict]) -> dict[str, dict]:
    """sample -> {"total": first start to last end, "parts": span -> seconds, "end": how it ended, "step", "staleness"}."""
    out: dict[str, dict] = {}
    for r in samples:
        x = out.setdefault(r["sample"], {"start": r["start"], "stop": r["end"], "parts": defaultdict(float),
                                         "end": "in flight", "step": r["step"], "staleness": "-"})
        x["start"], x["stop"] = min(x["start"], r["start"]), max(x["stop"], r["end"])
        if r["span"] in ("consumed", "dropped", "discarded"):
            x["end"], x["step"] = r["span"], r["step"]
            x["staleness"] = r["attrs"].get("staleness", "-")
        else:
            x["parts"][r["span"]] += r["end"] - r["start"]
    for x in out.values():
        x["total"] = x["stop"] - x["start"]
    return out


def _windows_section(artifacts: list[Artifact], profile_dir: Optional[str], out_dir: str) -> str:
    out = ["<h2 id='windows'>4. Profiled windows</h2>"]
    traces = [a for a in artifacts if ".json" in a.file]
    if not traces:
        return out[0] + "<p class='note'>No torch traces in the manifest.</p>"
    for a in traces:
        r = a.record
        link = os.path.relpath(a.file, out_dir)
        merged = f" · merged with every rank and the timeline: <a href='{_esc(a.merged)}'>{_esc(a.merged)}</a>" if a.merged else ""
        out.append(f"<h3>steps {r['steps'][0]}-{r['steps'][1]} · {_esc(r['role'])} rank {r['rank']}"
                   f"{' · ' + _esc(r['stage']) if r['stage'] else ''} · pid {r['pid']} · policy version "
                   f"{_esc(r['policy_version'])} · {'complete' if r['complete'] else 'INCOMPLETE'}</h3>"
                   f"<p class='note'>raw: <a href='{_esc(link)}'>{_esc(r['path'])}</a>{merged}"
                   + "".join(f" · {_esc(n)}" for n in a.notes) + "</p>")
        out.append("<p class='note'>Top operators across every stage of the window (self time; GPU kernels by the "
                   "operator that launched them):</p>")
        out.append(_table(["operator", "ms", "calls", "most in stage"], [[op, us / 1000, c, st] for op, us, c, st in a.overall]))
        rows = [[stage, op, us / 1000, calls] for stage in sorted(a.per_stage) for op, us, calls in a.per_stage[stage]]
        out.append("<p class='note'>Per stage (an update's mini-batch ranges count in the update; an operator of a "
                   "stage the window cut is charged to the timeline's span around it):</p>")
        out.append(_table(["stage", "operator (self time)", "ms", "calls"], rows))
    return "".join(out)


def _memory_section(inp: Inputs, artifacts: list[Artifact], out_dir: str) -> str:
    out = ["<h2 id='memory'>5. Memory</h2>"]
    memories = [a for a in artifacts if a.memory is not None]
    if not memories:
        return out[0] + ("<p class='note'>No torch_memory or memray artifacts (global_profiler.tool=torch_memory or "
                         "memray).</p>")
    for a in memories:
        rec, r = a.record, a.memory
        link = os.path.relpath(a.file, out_dir)
        out.append(f"<h3>{_esc(rec['path'])} · {_esc(rec['role'])} rank {rec['rank']} · {r.device}</h3>"
                   f"<p>window peak <b>{r.peak_bytes / 2**20:.2f} MiB</b> {_esc(_when(inp.spans, r.peak_time))}, "
                   f"in stage <b>{_esc(r.peak_stage)}</b> · raw: <a href='{_esc(link)}'>{_esc(os.path.basename(a.file))}</a>"
                   + (f" · flame graph (memray): <a href='{_esc(a.flame)}'>{_esc(a.flame)}</a>" if a.flame else "")
                   + "".join(f" · {_esc(n)}" for n in a.notes) + "</p>")
        out.append(f"<p class='note'>{_esc(_what_it_counts(r.device))} {_esc(_process_peak(inp.metrics, rec))}</p>")
        out.append(svg.area(r.series, [(s["stage"], s["start"], s["end"]) for s in _trainer_stages(inp.spans)
                                       if s["stage"] != "step"]))
        out.append("<p class='note'>Top allocation sites live at the window peak (innermost frame outside torch):</p>")
        out.append(_table(["site", "MiB"], [[s, b / 2**20] for s, b in r.top_sites]))
        out.append("<p class='note'>Growth per stage (allocated at exit minus entry, summed over the window):</p>")
        out.append(_table(["stage", "MiB"], [[s, b / 2**20] for s, b in sorted(r.growth.items(), key=lambda kv: -abs(kv[1]))]))
    return "".join(out)


def _what_it_counts(device: str) -> str:
    if device == memray_capture.DEVICE:
        return ("Counts the process's resident memory (RSS) as memray sampled it every 10 ms, everything live "
                "included; the sites are the allocations live at memray's high-water mark of the window.")
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
                and not k.startswith("memory/step/") and "reserved" not in k), default=None)
    if best is None:
        return ""
    v, k, step = best
    return (f"The process's own peak in these steps, everything live included, was {v:.3g} GB "
            f"({k} at step {step}, metrics.jsonl).")


def _when(spans: list[dict], t: float) -> str:
    """`t` as seconds into its step and its innermost trainer stage (both from the timeline)."""
    trainer = [s for s in spans if s["role"] == "trainer" and s.get("rank") is None and s["start"] <= t <= s["end"]]
    step = next((s for s in trainer if s["stage"] == "step"), None)
    if step is None:
        return "(outside the timeline's steps)"
    inner = min((s for s in trainer if s["stage"] != "step"), key=lambda s: s["end"] - s["start"], default=None)
    text = f"at {t - step['start']:.3f} s into step {step['step']}"
    return text + (f" ({t - inner['start']:.3f} s into {inner['stage']})" if inner else "")


LEARNING = [("val-core/", "validation reward"), ("critic/score/mean", "score"), ("actor/ppo_kl", "KL (actor/ppo_kl)"),
            ("actor/kl_loss", "KL loss"), ("actor/entropy", "entropy"), ("response_length/mean", "response length (tokens)")]


def _learning_section(inp: Inputs) -> str:
    out = ["<h2 id='learning'>6. Learning curves</h2>"]
    records = inp.validation  # with step 0 (validation before training)
    shown = 0
    for prefix, label in LEARNING:
        keys = sorted({k for m in records for k in m if k == prefix or (prefix.endswith("/") and k.startswith(prefix))})
        for key in keys[:2]:
            points = [(m["step"], m[key]) for m in records if key in m]
            if len(points) < 2:
                continue
            out.append(f"<h3>{_esc(label)}: {_esc(key)}</h3>")
            out.append(svg.lines([p[0] for p in points], {key: [p[1] for p in points]}, label.split(" (")[0]))
            shown += 1
    if not shown:
        out.append("<p class='note'>Fewer than two logged points per curve in metrics.jsonl.</p>")
    return "".join(out)


def _argmax_step(metrics: list[dict], key: str):
    return max((m for m in metrics if key in m), key=lambda m: m[key])["step"]


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



WATCHED = ("metrics.jsonl", "timeline.jsonl", "samples.jsonl", "summary.json", "profile/manifest.jsonl", "manifest.jsonl")


def watch(path: str, profile: Optional[str] = None, run: Optional[str] = None, merge: bool = False,
          interval: float = 10.0, stop_after: Optional[int] = None) -> int:
    """`plait profile report --watch DIR`: rewrite the report whenever the run's files change (checked
    every `interval` s), one line per refresh, until the run has ended and the last refresh read its summary
    (a run that ended before the watch began gets one refresh), or Ctrl-C; `stop_after` refreshes for tests."""
    import sys
    import time
    folder, seen, done = run or path, None, 0
    while stop_after is None or done < stop_after:
        state = [(p, os.stat(p).st_mtime_ns, os.stat(p).st_size) for p in
                 (os.path.join(folder, name) for name in WATCHED) if os.path.isfile(p)]
        if state and state != seen:
            seen = state
            ended = run_ended(folder)  # asked before the refresh, so that the refresh reads the summary
            try:
                text = build_report(path, profile=profile, run=run, merge=merge)
            except FileNotFoundError:
                text = None  # the run has not written its first files yet
            if text is not None:
                done += 1
                first = text.splitlines()[0]
                print(f"plait: report refreshed {time.strftime('%H:%M:%S')}: {first}", file=sys.stderr, flush=True)
                if ended:
                    return 0
        time.sleep(interval)
    return 0


def run_ended(folder: str) -> bool:
    """The run writing `folder` has ended: its summary.json (written last) is newer than .plait.lock, which
    every run and resume rewrites as it starts (trainers/checkpoint.py's output_dir_lock). A folder without
    the lock (copied from elsewhere) has ended when it has a summary. Not from the clock: a run that ended
    before the watch began has ended, and a resumed run's old summary is older than its lock."""
    summary, lock = os.path.join(folder, "summary.json"), os.path.join(folder, ".plait.lock")
    if not os.path.isfile(summary):
        return False
    return not os.path.isfile(lock) or os.stat(summary).st_mtime_ns >= os.stat(lock).st_mtime_ns
