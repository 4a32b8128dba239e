"""Torch traces and the stage timeline on one clock: streaming, merging, attributing operators.

    iter_trace(path)             a (gzipped) Chrome trace's header and its events, parsed one event at a
                                 time (a window's trace can be hundreds of MB: never one json.load)
    Clock(origin_ns)             every source onto integer µs from one origin: a torch trace's events by
                                 its baseTimeNanoseconds + ts, timeline spans by their wall clock
    MergedTrace(path, clock)     ONE Chrome/Perfetto trace written as it goes: timeline spans (a thread
                                 per role, rank and thread; spans that overlap in one lane get lanes of
                                 their own) and every event of each torch trace added, processes named
                                 "<role> rank <r>" and labelled with every role and rank they ran
                                 (process_labels), flow ids renumbered per source, GPU rows a pid each;
                                 a file whose torch traces are all one rank's says it (`distributedInfo`,
                                 which HTA reads a trace's rank from; several ranks in one file: none)
    load_trace(path, record, clock, merged)   one pass: events to the merged trace, and the ones the
                                 analysis reads kept (bounded: MAX_KEPT_EVENTS)
    op_totals(trace, lanes)      self time per operator per stage; GPU kernels charged to the operator
                                 that launched them (correlation id), ops a window cut from their stage
                                 range to the timeline span around them

Why integers: a torch trace's ts are µs floats from its base; moved onto wall-clock floats (about
1.8e15 µs) they lose all but 0.25 µs, and a child then ends after its parent. Rounding each source's
exact offset from one origin to whole µs is monotone, so every source's nesting is kept (an event of
less than a µs may become 0 long). `otherData.wall_clock_origin_ns` maps any ts back to the wall clock.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Iterator, Optional

STAGE_CAT = "plait.stage"
SAMPLE_CAT = "plait.sample"
TIMELINE_TID0 = 1 << 30  # timeline lanes get tids above any OS thread id
DEVICE_PID0 = 1 << 30    # GPU rows (and Kineto's named rows) of torch traces get pids above any OS process id
SAMPLES_PID = (1 << 30) - 1  # the per-sample lanes' process
PYTHON_TID0 = 1 << 29    # each thread's Python frames (with_stack) get a row of their own (Source)
MAX_TRACE_BYTES = 1 << 30     # a trace past 1 GiB (decompressed) is not read further
MAX_EVENT_BYTES = 64 << 20    # one event (or header value) past this is not a trace plait can read
MAX_KEPT_EVENTS = 4_000_000   # events of one trace kept for its tables (the merge streams them all)
OP_CATS = ("cpu_op", "user_annotation")
KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
KEPT_CATS = (*OP_CATS, *KERNEL_CATS, *LAUNCH_CATS, "python_function")
FLOW_PHASES = ("s", "t", "f")
NO_STAGE = "(no stage)"
_ENCODE = json.JSONEncoder(separators=(",", ":")).encode  # one encoder: json.dumps with options builds one per call


@dataclass
class Trace:
    record: dict                       # the manifest record of the artifact
    events: list[dict]                 # the kept events, ts in µs from the clock's origin (ints)
    label: str                         # "<role> rank <r>"
    notes: list[str] = field(default_factory=list)


def label(record: dict) -> str:
    return f"{record['role']} rank {record['rank']}"


# -- streaming ----------------------------------------------------------------------------------

def iter_trace(path: str) -> tuple[dict, Iterator[dict]]:
    """(header fields read before traceEvents, the events). A ValueError for a file that is not a trace
    or is past MAX_TRACE_BYTES decompressed (a gzip bomb), raised as it is read."""
    raw = gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    reader = _Reader(io.TextIOWrapper(raw, encoding="utf-8", errors="replace"))
    header: dict = {}
    reader.expect("{")
    while True:
        if reader.peek() == "}":
            return header, iter(())
        key = reader.value()
        reader.expect(":")
        if key == "traceEvents":
            return header, _events(reader)
        header[key] = reader.value()
        if reader.peek() == ",":
            reader.expect(",")


def _events(reader: "_Reader") -> Iterator[dict]:
    reader.expect("[")
    try:
        if reader.peek() == "]":
            return
        while True:
            event = reader.value()
            if isinstance(event, dict):
                yield event
            if reader.peek() == "]":
                return
            reader.expect(",")
    finally:
        reader.close()


class _Reader:
    """Incremental JSON values from a text stream (json's raw_decode over a sliding buffer)."""
    CHUNK = 1 << 20

    def __init__(self, stream):
        self.stream, self.buf, self.pos, self.read, self.eof = stream, "", 0, 0, False
        self.decoder = json.JSONDecoder()

    def close(self) -> None:
        self.stream.close()

    def _more(self) -> bool:
        if self.eof:
            return False
        chunk = self.stream.read(self.CHUNK)
        self.read += len(chunk)
        if self.read > MAX_TRACE_BYTES:
            raise ValueError(f"larger than {MAX_TRACE_BYTES >> 20} MiB (decompressed); not read")
        if not chunk:
            self.eof = True
            return False
        self.buf = self.buf[self.pos:] + chunk
        self.pos = 0
        return True

    def peek(self) -> str:
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._more():
                raise ValueError("ends before the trace does")

    def expect(self, char: str) -> None:
        if self.peek() != char:
            raise ValueError(f"not a Chrome trace (expected {char!r})")
        self.pos += 1

    def value(self):
        self.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
            except RecursionError:
                raise ValueError("nested deeper than a trace is") from None
            except json.JSONDecodeError:
                if len(self.buf) - self.pos > MAX_EVENT_BYTES or not self._more():
                    raise ValueError("not a Chrome trace (an event does not parse)") from None
                continue
            if end == len(self.buf) and not self.eof and self._more():  # a number may go on in the next chunk
                continue
            self.pos = end
            return value


# -- one clock ----------------------------------------------------------------------------------

class Clock:
    """Integer µs from one origin (ns since the epoch, an integer)."""

    def __init__(self, origin_ns: int):
        self.origin_ns = origin_ns

    def wall(self, seconds: float) -> int:
        """A timeline time (wall-clock seconds, µs precision) as µs from the origin."""
        return round(seconds * 1e6) - self.origin_ns // 1000

    def shift(self, base_ns: int) -> float:
        """What to add to a torch trace's ts (µs from its base) to get µs from the origin, exactly enough."""
        return (base_ns - self.origin_ns) / 1000


def origin_of(spans: list[dict], manifest: list[dict]) -> int:
    """The merged traces' origin: the whole second at or before the run's first span or window."""
    times = [s["start"] for s in spans] + [r["start_time"] for r in manifest]
    return int(min(times)) * 10**9 if times else 0


# -- the merged trace ---------------------------------------------------------------------------

class MergedTrace:
    """One Chrome trace, written event by event (gzip); `close` adds the process and thread names."""

    def __init__(self, path: str, clock: Clock, rank: Optional[int] = None):
        """`rank`: the one rank whose torch traces the file holds (HTA's `distributedInfo`); None: several, or none."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.clock, self.path = clock, path
        self.file = gzip.open(path, "wt", compresslevel=3, encoding="utf-8")
        info = "" if rank is None else f'"distributedInfo": {{"rank": {int(rank)}}}, '
        self.file.write(f'{{"displayTimeUnit": "ms", {info}"otherData": {{"wall_clock_origin_ns": {clock.origin_ns}, '
                        f'"wall_clock_origin_us": {clock.origin_ns // 1000}, "source": "plait profile report", '
                        '"time": "integer microseconds from the origin"}, "traceEvents": [\n')
        self.first = True
        self.procs: dict = {}
        self.labels: dict[int, list[str]] = defaultdict(list)  # pid -> every "<role> rank <r>" it ran
        self.threads: dict[tuple, str] = {}
        self.flows: dict[tuple, int] = {}
        self.pids: dict[tuple, int] = {}
        self.sources = 0
        self.buffer: list[str] = []  # encoded events, written to the gzip stream a few thousand at a time
        self.python_rows: dict[tuple, int] = {}  # (pid, tid) -> the row of that thread's Python frames

    def write(self, event: dict) -> None:
        self.buffer.append(_ENCODE(event))
        if len(self.buffer) >= 4096:
            self._drain()

    def _drain(self) -> None:
        if self.buffer:
            self.file.write(("" if self.first else ",\n") + ",\n".join(self.buffer))
            self.first, self.buffer = False, []

    def spans(self, spans: list[dict], role_of_pid: dict[int, str]) -> None:
        """Timeline spans: a thread per (pid, role, rank, thread), split so each lane nests."""
        stacks: dict[tuple, list[list[int]]] = defaultdict(list)  # lane -> per sub-lane, ends of open spans
        tids: dict[tuple, int] = {}
        for s in sorted(spans, key=lambda s: (s["start"], -(s["end"] - s["start"]))):
            lane = (s["pid"], s["role"], s.get("rank"), s["thread"])
            ts, end = self.clock.wall(s["start"]), self.clock.wall(s["end"])
            sub = _fit(stacks[lane], ts, end)
            key = (*lane, sub)
            if key not in tids:
                tids[key] = TIMELINE_TID0 + len(tids)
                rank = "" if s.get("rank") is None else f" rank {s['rank']}"
                more = f" #{sub + 1}" if sub else ""
                self.threads[(s["pid"], tids[key])] = f"{s['role']}{rank} stages ({s['thread']}){more}"
            self.procs.setdefault(s["pid"], role_of_pid.get(s["pid"], f"{s['role']} rank {s.get('rank') or 0}"))
            self._label(s["pid"], s["role"] if s.get("rank") is None else f"{s['role']} rank {s['rank']}")
            self.write({"ph": "X", "cat": STAGE_CAT, "name": s["stage"], "pid": s["pid"], "tid": tids[key], "ts": ts,
                        "dur": end - ts, "args": {"step": s["step"], "role": s["role"], "policy_version": s["version"]}})

    def samples(self, rows: list[tuple[int, str, str, int, int, dict]]) -> None:
        """Per-sample lanes: (lane, sample, span, ts, end, args) in µs from the origin."""
        self.procs[SAMPLES_PID] = "samples"
        for lane, sample, span, ts, end, args in rows:
            self.threads[(SAMPLES_PID, lane)] = f"lane {lane}"
            self.write({"ph": "X", "cat": SAMPLE_CAT, "name": span, "pid": SAMPLES_PID, "tid": lane, "ts": ts,
                        "dur": end - ts, "args": {"sample": sample, **args}})

    def _label(self, pid: int, label: str) -> None:
        if label not in self.labels[pid]:
            self.labels[pid].append(label)

    def source(self, record: dict, host: int, name: str) -> "Source":
        self.sources += 1
        self.procs[host] = name
        self._label(host, name)
        return Source(self, self.sources, host, name, record)

    def close(self) -> None:
        meta = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
                for pid, name in self.procs.items()]
        meta += [{"ph": "M", "name": "process_labels", "pid": pid, "tid": 0, "args": {"labels": ", ".join(labels)}}
                 for pid, labels in self.labels.items()]
        meta += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
                 for (pid, tid), name in self.threads.items()]
        for m in meta:
            self.write(m)
        self._drain()
        self.file.write("\n]}\n")
        self.file.close()


def _fit(lanes: list[list[int]], ts: int, end: int) -> int:
    """The first sub-lane where [ts, end] nests (inside its innermost open span, or after it ends)."""
    for i, ends in enumerate(lanes):
        while ends and ends[-1] <= ts:
            ends.pop()
        if not ends or end <= ends[-1]:
            ends.append(end)
            return i
    lanes.append([end])
    return len(lanes) - 1


class Source:
    """One torch trace being added to a merged trace: its pids, thread names and flow ids its own.

    PYTHON_ROWS: with `with_stack` torch writes each Python frame as a slice on its thread, and the frame
    that enters a range (record_function's __enter__) starts before the range and ends inside it: in the
    source already, a frame and a range do not nest. Each thread's Python frames go to a row of their own
    beside it ("<thread> python"), where frames nest among themselves and ranges and operators among theirs.
    """

    def __init__(self, merged: MergedTrace, n: int, host: int, name: str, record: dict):
        self.merged, self.n, self.host, self.name, self.record = merged, n, host, name, record

    def python_row(self, pid: int, tid) -> int:
        """The row of a thread's Python frames: one per (process, thread) in the merged trace."""
        rows = self.merged.python_rows
        if (pid, tid) not in rows:
            rows[(pid, tid)] = PYTHON_TID0 + len(rows)
            self.merged.threads[(pid, rows[(pid, tid)])] = f"{self.name} (thread {tid} python)"
        return rows[(pid, tid)]

    def pid(self, pid) -> int:
        """The host process keeps its pid; Kineto's other rows (GPU devices, "Spans", "Traces") get one each."""
        if pid == self.host:
            return pid
        m = self.merged
        return m.pids.setdefault((self.n, pid), DEVICE_PID0 + len(m.pids))

    def add(self, e: dict) -> None:
        m = self.merged
        if e.get("ph") == "M":
            args = e.get("args") if isinstance(e.get("args"), dict) else {}
            if e.get("name") == "thread_name" and isinstance(args.get("name"), str):
                m.threads[(self.pid(e.get("pid")), e.get("tid"))] = f"{self.name} ({args['name']})"
            elif e.get("name") == "process_name" and e.get("pid") != self.host and isinstance(args.get("name"), str):
                m.procs[self.pid(e.get("pid"))] = f"{self.name} ({args['name']})"
            return  # the host's name and every sort key are rewritten
        e = dict(e)
        if "pid" in e:
            e["pid"] = self.pid(e["pid"])
        if e.get("cat") == "python_function":  # Python frames: a row of their own (see PYTHON_ROWS)
            e["tid"] = self.python_row(e["pid"], e.get("tid"))
        if e.get("ph") in FLOW_PHASES or "bind_id" in e:  # flow ids are per trace: renumbered per source
            for k in ("id", "bind_id"):
                if k in e:
                    e[k] = m.flows.setdefault((self.n, e.get("cat"), e[k]), len(m.flows) + 1)
        if e.get("cat") == "user_annotation":
            e["args"] = {**(e.get("args") or {}), "policy_version": self.record["policy_version"],
                         "steps": self.record["steps"]}
        m.write(e)


def load_trace(path: str, record: dict, clock: Clock, merged: Optional[MergedTrace] = None) -> Trace:
    """One pass over a torch trace: each event onto the clock, into `merged` when given, and kept for the
    tables when the analysis reads it (OP/KERNEL/LAUNCH cats, Python frames, "[memory]" events)."""
    header, events = iter_trace(path)
    base = header.get("baseTimeNanoseconds", 0)
    shift = clock.shift(base if isinstance(base, int) and not isinstance(base, bool) else 0)
    source = merged.source(record, record["pid"], label(record)) if merged is not None else None
    kept, notes, names = [], [], {}
    for e in events:
        if not _well_formed(e):
            continue
        if e.get("ph") != "M" and "ts" in e:
            start = shift + e["ts"]
            e["ts"] = round(start)
            if e.get("ph") == "X":
                e["dur"] = max(round(start + e["dur"]) - e["ts"], 0)
        if source is not None:
            source.add(e)
        if (e.get("ph") == "X" and e.get("cat") in KEPT_CATS) or e.get("name") == "[memory]":
            if len(kept) < MAX_KEPT_EVENTS:
                e["name"] = names.setdefault(e["name"], e["name"])  # one string per operator name
                kept.append(e)
            elif not notes:
                notes.append(f"its tables read the first {MAX_KEPT_EVENTS} events (the merged trace has them all)")
    return Trace(record, kept, label(record), notes)


def _ids(e: dict, *keys) -> bool:
    return all(isinstance(e.get(k), (int, str)) and not isinstance(e.get(k), bool) for k in keys)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) < 1e18


def _well_formed(e) -> bool:
    """An event with the fields the merge and the tables read, of their types (Kineto's always are;
    a crafted trace's other events are dropped rather than a traceback)."""
    if not isinstance(e, dict) or ("ts" in e and not _num(e["ts"])):
        return False
    ph = e.get("ph")
    if ph == "X":
        return _ids(e, "pid", "tid") and isinstance(e.get("name"), str) and _num(e.get("ts")) and _num(e.get("dur")) \
            and e["dur"] >= 0 and isinstance(e.get("args", {}), dict)
    if ph == "M":
        return _ids(e, "pid", "tid") and isinstance(e.get("args"), dict) and isinstance(e["args"].get("name"), str)
    if e.get("name") == "[memory]":
        args = e.get("args")
        return _ids(e, "pid", "tid") and _num(e.get("ts")) and isinstance(args, dict) and all(
            _num(args.get(k)) for k in ("Addr", "Bytes")) and isinstance(args.get("Device Type"), int)
    return "pid" not in e or _ids(e, "pid")


def nesting_violations(events: list[dict]) -> int:
    """Complete events ("X") that start inside another on their thread and end after it: what a trace
    viewer cannot draw (tests and `plait profile report` check merged traces with it)."""
    threads: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            threads[(e.get("pid"), e.get("tid"))].append(e)
    bad = 0
    for group in threads.values():
        group.sort(key=lambda e: (e["ts"], -e["dur"]))
        ends: list = []
        for e in group:
            while ends and ends[-1] <= e["ts"]:
                ends.pop()
            if ends and e["ts"] + e["dur"] > ends[-1]:
                bad += 1
                continue
            ends.append(e["ts"] + e["dur"])
    return bad


# -- operators per stage -------------------------------------------------------------------------

def stage_ranges(events: list[dict]) -> list[dict]:
    """The plait stage ranges of a torch trace: user annotations named "<role>/<stage>"."""
    return [e for e in events if e.get("cat") == "user_annotation" and "/" in e.get("name", "")]


def op_totals(trace: Trace, lanes: Optional[dict] = None) -> dict[str, dict[str, list]]:
    """stage -> operator -> [self time µs, calls], every operator of the window.

    CPU operators' self time is their duration minus their child operators' on the same thread; an
    operator belongs to the innermost stage range open on its thread when it starts, else (a window
    opened inside a stage: the range was never recorded) to the timeline span around it on that thread
    (`lanes`: (pid, tid) -> [(start µs, end µs, "role/stage")] from timeline.jsonl), else to
    "<role>/(between stages)" when the thread has spans of one role, else "(no stage)". An update's
    mini-batch ranges ("<role>/mini_batch<i>") are part of the update. A GPU kernel (memcpy, memset)
    counts whole, as "[gpu] <kernel> (from <op>)", in the stage of the CPU operator that launched it: the
    runtime call (cudaLaunchKernel) with the kernel's correlation id sits inside that operator; without
    one, in the stage range that contains the kernel's start.
    """
    lanes = lanes or {}
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    kernels = []
    for e in trace.events:
        if e.get("cat") in (*OP_CATS, *LAUNCH_CATS):
            by_thread[(e["pid"], e["tid"])].append(e)
        elif e.get("cat") in KERNEL_CATS:
            kernels.append(e)
    totals: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    launchers: dict = {}  # correlation id -> (op name, stage)
    for key, events in by_thread.items():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        around = _TimelineStage(lanes.get(key, []))
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
            parent = stack[-1][2] if stack else around.at(e["ts"])
            if e["cat"] in LAUNCH_CATS:
                corr = (e.get("args") or {}).get("correlation")
                op = next((s[0]["name"] for s in reversed(stack) if s[0]["cat"] == "cpu_op"), e["name"])
                launchers[corr] = (op, parent)
                continue
            stack.append([e, 0.0, _stage_of(e, parent)])
        close_until(float("inf"))
    ranges = [r for r in stage_ranges(trace.events) if not is_mini_batch(r["name"])]
    for k in kernels:
        corr = (k.get("args") or {}).get("correlation")
        if corr in launchers:
            op, stage = launchers[corr]
            name = f"[gpu] {k['name']} (from {op})"
        else:
            inside = [r for r in ranges if r["ts"] <= k["ts"] < r["ts"] + r["dur"]]
            stage, name = (min(inside, key=lambda r: r["dur"])["name"] if inside else NO_STAGE), f"[gpu] {k['name']}"
        total = totals[stage][name]
        total[0] += k["dur"]
        total[1] += 1
    return totals


class _TimelineStage:
    """The timeline's stage around a moment on one thread, for ops outside any recorded range."""

    def __init__(self, spans: list[tuple[int, int, str]]):
        self.spans = sorted(spans)
        roles = {name.split("/", 1)[0] for _, _, name in self.spans}
        self.fallback = f"{roles.pop()}/(between stages)" if len(roles) == 1 else NO_STAGE

    def at(self, ts: int) -> str:
        inside = [s for s in self.spans if s[0] <= ts < s[1]] if self.spans else []
        return min(inside, key=lambda s: s[1] - s[0])[2] if inside else self.fallback


def timeline_lanes(spans: list[dict], clock: Clock) -> dict[tuple, list[tuple[int, int, str]]]:
    """(pid, tid) -> [(start µs, end µs, "role/stage")] of the timeline's spans that name their thread id
    (the step frame and the lifecycle's own spans left out: an op in them is in no stage)."""
    out: dict[tuple, list] = defaultdict(list)
    for s in spans:
        if s.get("tid") is not None and s["stage"] != "step":
            out[(s["pid"], s["tid"])].append((clock.wall(s["start"]), clock.wall(s["end"]), f"{s['role']}/{s['stage']}"))
    return out


def top_ops(totals: dict, n: int = 10) -> dict[str, list[tuple[str, float, int]]]:
    """stage -> [(operator, self time µs, calls)], largest first (from op_totals, the first `n`)."""
    return {stage: sorted(((op, t, c) for op, (t, c) in ops.items()), key=lambda x: -x[1])[:n]
            for stage, ops in totals.items()}


def top_ops_overall(totals: dict, n: int = 10) -> list[tuple[str, float, int, str]]:
    """[(operator, self time µs, calls, the stage it took most time in)] over every stage, largest first."""
    summed: dict[str, list] = defaultdict(lambda: [0.0, 0, "", 0.0])
    for stage, ops in totals.items():
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
        return mini_batch_stage(e["name"]) if parent in (NO_STAGE,) or parent.endswith("/(between stages)") else parent
    return e["name"]


def is_mini_batch(name: str) -> bool:
    return "/mini_batch" in name and name.rsplit("mini_batch", 1)[-1].isdigit()


def mini_batch_stage(name: str) -> str:
    """A mini-batch range recorded without its stage around it: the role's update ("actor/update_actor")."""
    role = name.split("/", 1)[0]
    return f"{role}/update_{role}"


def read_merged(path: str) -> dict:
    """A merged trace back (tests, `plait profile diff`): bounded like any trace."""
    header, events = iter_trace(path)
    return {**header, "traceEvents": list(events)}

