"""Torch traces and the stage timeline on one wall clock: loading, merging, top operators.

    load_trace(path, record)     a torch.profiler Chrome trace, its events moved to wall-clock µs
                                 (the trace's baseTimeNanoseconds + each event's ts)
    merged_trace(spans, traces)  ONE Chrome/Perfetto trace: every timeline span (its own thread per
                                 role and thread) and every trace's events, processes and threads
                                 named "<role> rank <r>", the policy version in each stage's args;
                                 each process's GPU rows (Kineto uses the device index as their
                                 pid) get a pid of their own, so ranks' "GPU 0" rows stay apart
    top_ops(trace)               self time per operator per stage of one window (top_ops_overall: across stages)

Times in a merged trace are µs since its `origin` (the earliest event), kept in
`otherData.wall_clock_origin_us`, so a reader can map any event back to the wall clock.
"""

from __future__ import annotations

import gzip
import json
import os
from collections import defaultdict
from dataclasses import dataclass

STAGE_CAT = "plait.stage"
TIMELINE_TID0 = 1 << 30  # timeline lanes get tids above any OS thread id
DEVICE_PID0 = 1 << 30    # GPU rows of torch traces get pids above any OS process id


@dataclass
class Trace:
    record: dict          # the manifest record of the artifact
    events: list[dict]    # ts in wall-clock µs
    label: str            # "<role> rank <r>"


def label(record: dict) -> str:
    return f"{record['role']} rank {record['rank']}"


MAX_TRACE_BYTES = 1 << 30  # a trace past 1 GiB (decompressed) is not one a report can parse in memory


def load_json(path: str) -> dict:
    """A (gzipped) JSON file; a ValueError past MAX_TRACE_BYTES, read no further (a gzip bomb)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read(MAX_TRACE_BYTES + 1)
    if len(data) > MAX_TRACE_BYTES:
        raise ValueError(f"larger than {MAX_TRACE_BYTES >> 20} MiB (decompressed); not read")
    return json.loads(data)


def load_trace(path: str, record: dict) -> Trace:
    data = load_json(path)
    base = data.get("baseTimeNanoseconds", 0) / 1000  # absent in old exports: ts is then absolute
    events = []
    for e in filter(_well_formed, data["traceEvents"]):
        if "ts" in e and e.get("ph") != "M":
            e = {**e, "ts": base + float(e["ts"])}
        events.append(e)
    return Trace(record, events, label(record))


def _well_formed(e) -> bool:
    """An event with the fields the merge and top_ops read, of their types (Kineto's always are;
    a crafted trace's other events are dropped rather than a traceback)."""
    ids = lambda *keys: all(isinstance(e.get(k), (int, str)) for k in keys)  # noqa: E731
    if not isinstance(e, dict) or ("ts" in e and not isinstance(e["ts"], (int, float))):
        return False
    if e.get("ph") == "M":
        return ids("pid", "tid") and isinstance(e.get("args"), dict) and isinstance(e["args"].get("name"), str)
    if e.get("ph") == "X":
        return ids("pid", "tid") and isinstance(e.get("name"), str) and isinstance(e.get("ts"), (int, float)) \
            and isinstance(e.get("dur"), (int, float)) and isinstance(e.get("args", {}), dict)
    return "pid" not in e or ids("pid")


def merged_trace(spans: list[dict], traces: list[Trace], pid_labels: dict[int, str]) -> dict:
    """The whole run as one Chrome trace; `pid_labels` names processes without a torch trace."""
    times = [s["start"] * 1e6 for s in spans] + [e["ts"] for t in traces for e in t.events
                                                 if "ts" in e and e.get("ph") != "M"]
    origin = min(times) if times else 0.0
    out: list[dict] = []
    names: dict[tuple, str] = {}
    lanes: dict[tuple, int] = {}
    for s in spans:
        lane = (s["pid"], s["role"], s["thread"])
        tid = lanes.setdefault(lane, TIMELINE_TID0 + len(lanes))
        names[(s["pid"], tid)] = f"{s['role']} stages ({s['thread']})"
        out.append({"ph": "X", "cat": STAGE_CAT, "name": s["stage"], "pid": s["pid"], "tid": tid,
                    "ts": s["start"] * 1e6 - origin, "dur": (s["end"] - s["start"]) * 1e6,
                    "args": {"step": s["step"], "role": s["role"], "policy_version": s["version"]}})
    procs = dict(pid_labels)
    devices: dict[tuple, int] = {}  # (host pid, trace pid) -> a pid of its own for each GPU row
    for t in traces:
        host = t.record["pid"]
        procs[host] = t.label
        version = t.record["policy_version"]
        # Kineto gives GPU rows the device index as pid: every rank's "GPU 0" would be one row.
        pid_of = lambda pid: pid if pid == host else devices.setdefault((host, pid), DEVICE_PID0 + len(devices))  # noqa: E731
        for e in t.events:
            if e.get("ph") == "M":
                if e.get("name") == "thread_name":
                    names[(pid_of(e["pid"]), e["tid"])] = f"{t.label} ({e['args']['name']})"
                elif e.get("name") == "process_name" and e["pid"] != host:
                    procs[pid_of(e["pid"])] = f"{t.label} ({e['args']['name']})"
                continue  # the host's name and sort keys are rewritten below
            e = {**e, "ts": e["ts"] - origin} if "ts" in e else dict(e)
            if "pid" in e:
                e["pid"] = pid_of(e["pid"])
            if e.get("cat") == "user_annotation":
                e["args"] = {**e.get("args", {}), "policy_version": version, "steps": t.record["steps"]}
            out.append(e)
    meta = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
            for pid, name in procs.items()]
    meta += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
             for (pid, tid), name in names.items()]
    return {"traceEvents": meta + out, "displayTimeUnit": "ms",
            "otherData": {"wall_clock_origin_us": origin, "source": "plait profile report"}}


def write_trace(trace: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with gzip.open(path, "wb", compresslevel=6) as f:
        f.write(json.dumps(trace).encode())


def stage_ranges(events: list[dict]) -> list[dict]:
    """The plait stage ranges of a torch trace: user annotations named "<role>/<stage>"."""
    return [e for e in events if e.get("cat") == "user_annotation" and "/" in e.get("name", "")]


def op_totals(trace: Trace) -> dict[str, dict[str, list]]:
    """stage -> operator -> [self time µs, calls], every operator of the window.

    CPU operators' self time is their duration minus their child operators' on the same thread;
    an operator belongs to the innermost stage range open on its thread when it starts. GPU
    kernels (no thread of their own) count whole, in the stage range that contains their start.
    An update's mini-batch ranges ("<role>/mini_batch<i>") are part of the stage they run in (the
    update's), where the update's work is: on their own they would leave it the loop's crumbs.
    """
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    kernels = []
    for e in trace.events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") in ("cpu_op", "user_annotation"):
            by_thread[(e["pid"], e["tid"])].append(e)
        elif e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append(e)
    totals: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for events in by_thread.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, child time, stage]
        def close_until(ts: float) -> None:
            while stack and stack[-1][0]["ts"] + stack[-1][0]["dur"] <= ts:
                event, child, stage = stack.pop()
                if event["cat"] == "cpu_op":
                    total = totals[stage][event["name"]]
                    total[0] += event["dur"] - child
                    total[1] += 1
                    if stack:
                        stack[-1][1] += event["dur"]
        for e in events:
            close_until(e["ts"])
            parent_stage = stack[-1][2] if stack else "(no stage)"
            stack.append([e, 0.0, _stage_of(e, parent_stage)])
        close_until(float("inf"))
    ranges = stage_ranges(trace.events)
    for k in kernels:
        inside = [r for r in ranges if r["ts"] <= k["ts"] < r["ts"] + r["dur"] and not is_mini_batch(r["name"])]
        batches = [r for r in ranges if r["ts"] <= k["ts"] < r["ts"] + r["dur"] and is_mini_batch(r["name"])]
        stage = (min(inside, key=lambda r: r["dur"])["name"] if inside
                 else mini_batch_stage(batches[0]["name"]) if batches else "(no stage)")
        total = totals[stage]["[gpu] " + k["name"]]
        total[0] += k["dur"]
        total[1] += 1
    return totals


def top_ops(trace: Trace, n: int = 10) -> dict[str, list[tuple[str, float, int]]]:
    """stage -> [(operator, self time µs, calls)], largest first (op_totals, the first `n`)."""
    return {stage: sorted(((op, t, c) for op, (t, c) in ops.items()), key=lambda x: -x[1])[:n]
            for stage, ops in op_totals(trace).items()}


def top_ops_overall(trace: Trace, n: int = 10) -> list[tuple[str, float, int, str]]:
    """[(operator, self time µs, calls, the stage it took most time in)] over every stage, largest first."""
    summed: dict[str, list] = defaultdict(lambda: [0.0, 0, "", 0.0])
    for stage, ops in op_totals(trace).items():
        for op, (t, c) in ops.items():
            row = summed[op]
            row[0] += t
            row[1] += c
            if t > row[3]:
                row[2], row[3] = stage, t
    return sorted(((op, t, c, stage) for op, (t, c, stage, _) in summed.items()), key=lambda x: -x[1])[:n]


def _stage_of(e: dict, parent: str) -> str:
    """The stage an event runs in: a stage range opens its own, a mini-batch range stays in its parent's
    (or its role's update when recorded alone), anything else is in its parent's."""
    if e["cat"] != "user_annotation" or "/" not in e["name"]:
        return parent
    if is_mini_batch(e["name"]):
        return mini_batch_stage(e["name"]) if parent == "(no stage)" else parent
    return e["name"]


def is_mini_batch(name: str) -> bool:
    return "/mini_batch" in name and name.rsplit("mini_batch", 1)[-1].isdigit()


def mini_batch_stage(name: str) -> str:
    """A mini-batch range recorded without its stage around it: the role's update ("actor/update_actor")."""
    role = name.split("/", 1)[0]
    return f"{role}/update_{role}"
