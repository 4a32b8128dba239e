"""`plait profile diff RUN_A RUN_B`: one run against another, and A's verdict against what B measured.

    A, B (run output dirs, read as untrusted data) ─▶ facts of each (verdict.py: the same steps, the same
    cycle) ─▶ stage medians side by side · top operators added / removed / slower per stage in both runs'
    torch windows (per profiled step; what only one run has is named, not compared) · memory peaks · each
    of A's verdicts: what it predicted, what B measured

The usual use: A is a run, B the rerun with A's verdict applied (`try <key>=<value>`). For each predicted
quantity of A's verdicts (`predicted` in verdict.json) B's measurement of the same quantity is read from
B's own facts: step_s (the median cycle outside profiler windows), update_s, reward_s, generation_s
(sync: gen; async: the rollouter's generating), sync_s (param_sync / update_weights), spent_s (the wall
time of validation or checkpoints), peak_gb and <role>_peak_gb (the highest of the process's median stage
peaks, or of the role's stages: memory_fit.py). Whether B set the suggested key to the suggested value is read from
B's summary.json settings and said beside it. Each run's summary.json records the host's load averages at
its end (`load`); runs timed under loads far apart get a warning line first.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Optional

from plait.profiler.analysis import verdict
from plait.profiler.analysis.accounting import account
from plait.profiler.analysis.inputs import Inputs, below, locate
from plait.profiler.analysis.memory import process_peak
from plait.profiler.analysis.memory_fit import role_peaks, stage_peaks
from plait.profiler.analysis.traces import Clock, load_trace, op_totals, origin_of, timeline_lanes

SLOWER = 1.2          # an operator at >= 1.2x its time in A (per profiled step) is "slower"
MIN_OP_US = 100.0     # ... and by at least this many µs per step: noise is not a change
TOP = 5
LOAD_APART, LOAD_RATIO = 1.0, 1.5  # two runs' loads this far apart make their times incomparable


def diff_runs(a: str, b: str, as_json: bool = False) -> str:
    """The comparison as text (or JSON); a FileNotFoundError for a folder that is not a run's."""
    ra, rb = _run(a), _run(b)
    out = {"a": a, "b": b, "steps": {"a": _steps(ra["facts"]), "b": _steps(rb["facts"])},
           "stages": stages(ra["facts"], rb["facts"]), "operators": operators(ra["ops"], rb["ops"]),
           "operators_not_compared": not_compared(ra["ops"], rb["ops"]),
           "memory": {"a": process_peak(ra["inputs"].metrics, ra["facts"].profiled),
                      "b": process_peak(rb["inputs"].metrics, rb["facts"].profiled)},
           "predictions": predictions(ra["facts"], rb["facts"]),
           "load": {"a": ra["inputs"].summary.get("load"), "b": rb["inputs"].summary.get("load")}}
    out["load"]["warning"] = load_warning(out["load"]["a"], out["load"]["b"])
    return json.dumps(out, indent=1) if as_json else text(out)


def _run(path: str) -> dict:
    inp = locate(path)
    steps = account(inp.spans)
    f = verdict.facts(steps, inp.metrics, inp.summary, inp.spans)
    return {"inputs": inp, "facts": f, "ops": _ops_per_step(inp)}


def _steps(f: verdict.Facts) -> dict:
    return {"median_s": f.step_s, "p90_s": f.step_p90, "basis": f.basis, "steps": f.steps}


def stages(fa: verdict.Facts, fb: verdict.Facts) -> list[dict]:
    """Every part of the trainer's step in either run: median seconds in A and B, and B / A."""
    names = sorted(set(fa.trainer_s) | set(fb.trainer_s), key=lambda k: -max(fa.trainer_s.get(k, 0), fb.trainer_s.get(k, 0)))
    rows = [{"stage": "(step)", "a_s": fa.step_s, "b_s": fb.step_s}]
    rows += [{"stage": k, "a_s": fa.trainer_s.get(k, 0.0), "b_s": fb.trainer_s.get(k, 0.0)} for k in names]
    for r in rows:
        r["ratio"] = r["b_s"] / r["a_s"] if r["a_s"] > 0 else None
    return rows


def load_warning(a: Optional[dict], b: Optional[dict]) -> Optional[str]:
    """One line when the two runs' machines were loaded differently (1-minute load average at each run's end,
    LOAD_APART runnable tasks apart and LOAD_RATIO times the lower): their timings then measure the machine."""
    if not a or not b:
        return None
    low, high = sorted((a["1m"], b["1m"]))
    if high - low < LOAD_APART or high < LOAD_RATIO * low:
        return None
    return (f"warning: the machine's load differed: A {a['1m']:.2g} on {a['cpus']:g} CPUs, B {b['1m']:.2g} on "
            f"{b['cpus']:g} (1-minute load average at each run's end): the times below compare the machine too; "
            "rerun both on a quiet one")


def _ops_per_step(inp: Inputs) -> dict[str, dict[str, float]]:
    """stage -> operator -> self µs per profiled step, summed over the run's torch traces (no merge)."""
    clock = Clock(origin_of(inp.spans, inp.manifest))
    lanes = timeline_lanes(inp.spans, clock)
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    steps = 0
    windows = set()
    for rec in inp.manifest:
        file = below(inp.profile_dir, rec["path"]) if rec["path"] and inp.profile_dir else None
        if file is None or ".json" not in file or not os.path.isfile(file) or not rec["steps"]:
            continue
        try:
            totals = op_totals(load_trace(file, rec, clock), lanes)
        except Exception as err:  # noqa: BLE001 - one unreadable trace is one note
            inp.notes.append(f"{rec['path']}: could not be read ({type(err).__name__})")
            continue
        if tuple(rec["steps"]) not in windows:
            windows.add(tuple(rec["steps"]))
            steps += rec["steps"][1] - rec["steps"][0] + 1
        for stage, ops in totals.items():
            for op, (us, _) in ops.items():
                out[stage][op] += us
    return {stage: {op: us / steps for op, us in ops.items()} for stage, ops in out.items()} if steps else {}


def operators(a: dict, b: dict) -> dict[str, dict[str, list]]:
    """Per stage in both runs' traces: the operators only B has (added), only A has (removed), and those
    SLOWER times and MIN_OP_US slower per step in B; the largest TOP of each, µs per profiled step. A stage
    in one run's traces only is not compared (`not_compared`): an unprofiled rerun removed nothing."""
    out = {}
    for stage in sorted(set(a) & set(b)):
        oa, ob = a.get(stage, {}), b.get(stage, {})
        added = sorted(((op, us) for op, us in ob.items() if op not in oa), key=lambda x: -x[1])[:TOP]
        removed = sorted(((op, us) for op, us in oa.items() if op not in ob), key=lambda x: -x[1])[:TOP]
        slower = sorted(((op, oa[op], ob[op]) for op in set(oa) & set(ob)
                         if ob[op] >= SLOWER * oa[op] and ob[op] - oa[op] >= MIN_OP_US), key=lambda x: x[1] - x[2])[:TOP]
        if added or removed or slower:
            out[stage] = {"added": added, "removed": removed, "slower": slower}
    return out


def not_compared(a: dict, b: dict) -> list[str]:
    """What one run's traces have and the other's lack, one line each."""
    if bool(a) != bool(b):
        return [f"{'B' if a else 'A'} has no torch traces (global_profiler.tool=torch): operators not compared"]
    return [f"{stage}: only in {'A' if stage in a else 'B'}'s traces; not compared" for stage in sorted(set(a) ^ set(b))]


def measured(fb: verdict.Facts, quantity: str, rule: str) -> Optional[float]:
    """B's measurement of one quantity a verdict predicted (see the module docstring)."""
    t = fb.trainer_s
    if quantity == "step_s":
        return fb.step_s or None
    if quantity == "update_s":
        return t.get("update_actor")
    if quantity == "log_prob_s":
        return t.get("old_log_prob", 0.0) + t.get("ref", 0.0) or None
    if quantity == "reward_s":
        return t.get("reward")
    if quantity == "generation_s":
        return fb.rollout_busy_s or t.get("gen")
    if quantity in ("sync_s", "sync_s_per_update"):
        sync = t.get("param_sync", t.get("update_weights"))
        per = fb.settings.get("async_training.trigger_parameter_sync_step", 1) if quantity.endswith("update") else 1
        return None if sync is None else sync / per
    if quantity == "spent_s":
        part = rule.removesuffix("_share")
        return fb.wall.get(part)
    if quantity.endswith("peak_gb"):  # the same median stage peaks the prediction was fitted on (memory_fit.py)
        return role_peaks(stage_peaks(fb)[1]).get(quantity.removesuffix("peak_gb").rstrip("_") or "process")
    return None


def predictions(fa: verdict.Facts, fb: verdict.Facts) -> list[dict]:
    """Each of A's verdicts (and its profiler line's): every predicted quantity beside B's measurement."""
    rows = []
    found = [v.as_dict() for v in verdict.verdicts(fa)]
    line = verdict.profiler_line(fa)
    if line and line["predicted"]:
        found.append({"rule": "profiler_share", **line})
    for v in found:
        applied = fb.settings.get(v["key"]) if v["key"] else None
        for quantity, predicted in v["predicted"].items():
            got = measured(fb, quantity, v["rule"])
            rows.append({"rule": v["rule"], "line": v["line"], "key": v["key"], "value": v["value"], "b_value": applied,
                         "quantity": quantity, "a_measured": _a_value(v, quantity, fa), "predicted": predicted,
                         "b_measured": got, "measured_over_predicted": got / predicted if got is not None and predicted
                         and v["key"] else None})  # a verdict with no key to set predicts no rerun of it
    return rows


def _a_value(v: dict, quantity: str, fa: verdict.Facts) -> Optional[float]:
    return measured(fa, quantity, v["rule"])


def text(out: dict) -> str:
    sa, sb = out["steps"]["a"], out["steps"]["b"]
    lines = [f"plait profile diff: A {out['a']}", f"                    B {out['b']}",
             f"step: A {sa['median_s']:.3g} s, B {sb['median_s']:.3g} s (median cycle; A {sa['basis']}, B {sb['basis']})"]
    if out["load"]["warning"]:
        lines.insert(2, out["load"]["warning"])
    lines.append("stages (median s per step):  A  ->  B")
    for r in out["stages"]:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "new"
        if r["a_s"] >= 0.001 or r["b_s"] >= 0.001:
            lines.append(f"  {r['stage']:<22} {r['a_s']:>9.4g} -> {r['b_s']:<9.4g} {ratio}")
    for stage, ops in out["operators"].items():
        lines.append(f"operators in {stage} (µs per profiled step):")
        lines += [f"  added   {op}: {us:.0f}" for op, us in ops["added"]]
        lines += [f"  removed {op}: {us:.0f}" for op, us in ops["removed"]]
        lines += [f"  slower  {op}: {x:.0f} -> {y:.0f}" for op, x, y in ops["slower"]]
    lines += [f"operators: {line}" for line in out["operators_not_compared"]]
    if not out["operators"] and not out["operators_not_compared"]:
        lines.append("operators: no torch traces in both runs (global_profiler.tool=torch) or no change")
    ma, mb = out["memory"]["a"], out["memory"]["b"]
    if ma or mb:
        fmt = lambda m: f"{m['gb']:.3g} GB in {m['stage']}" if m else "-"  # noqa: E731
        lines.append(f"memory peak: A {fmt(ma)}, B {fmt(mb)}")
    for p in out["predictions"]:
        set_ = "" if not p["key"] else (f"; B has {p['key']}={p['b_value']}" + ("" if p["b_value"] == p["value"]
                                                                            else f" (A suggested {p['value']})"))
        unit = "GB" if p["quantity"].endswith("_gb") else "s"
        ratio = "" if p["measured_over_predicted"] is None else f" ({p['measured_over_predicted']:.2f}x the prediction)"
        got = "B did not measure it" if p["b_measured"] is None else f"B measured {p['b_measured']:.3g} {unit}{ratio}"
        if not p["key"]:
            got += " (A's verdict names no key to set, so B is not its rerun)"
        was = f"A {p['a_measured']:.3g} {unit}, " if p["a_measured"] is not None else ""
        lines.append(f"A's verdict ({p['rule']}): {p['quantity']}: {was}predicted {p['predicted']:.3g} {unit}; {got}{set_}")
    if not out["predictions"]:
        lines.append("A's verdict: nothing stood out, so nothing was predicted")
    return "\n".join(lines)
