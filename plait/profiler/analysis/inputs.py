"""What a report reads from a run's folders, read as untrusted data (the folder may be someone else's).

    locate(DIR, profile, run) ─▶ Inputs: spans, metrics, manifest, summary, and `notes` on what was left out

Every file is read below the folder it was found in (DIR, --profile, --run; symbolic links resolved).
A JSONL file is streamed a line at a time: a line longer than MAX_LINE_BYTES, one that does not parse
(torn, nested past the parser's stack, a number too long) or one not of the shape plait writes is
skipped and counted; past MAX_RECORDS records or MAX_FILE_BYTES bytes the rest is not read. A JSON file (summary.json) past
MAX_JSON_BYTES is not read. Each record is checked field by field against the shape plait writes:
types (a bool is not a number), finite numbers, times within MAX_TIME_S of the epoch (a crafted
±1e308 would overflow the µs clock), steps below MAX_STEP, metrics below MAX_VALUE, an end not before
its start; records not of that shape are counted, one note per file. summary.json is reduced to the
parts the report and the verdict read, each of its type (the verdict's settings key by key, against
verdict.SETTINGS). Whatever is dropped is said in one line in `notes` (the page's "Not shown" list).
Nothing here evaluates or unpickles anything (memory snapshots go through plait/safeload.py).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from plait.profiler.analysis.alarms import NONFINITE
from plait.profiler.naming import LOCATION, MANIFEST
from plait.profiler.timeline import TIMELINE_FILE

MAX_LINE_BYTES = 1 << 20      # a JSONL line plait writes is well under 1 MiB
MAX_RECORDS = 2_000_000       # records read from one JSONL file (a long run's timeline is far fewer)
MAX_FILE_BYTES = 512 << 20    # bytes read from one JSONL file
MAX_JSON_BYTES = 64 << 20     # summary.json, verdict.json, profile_location.json
MAX_TIME_S = 1e11             # a span's wall-clock seconds (year 5138): past it, not a time plait wrote
MAX_STEP = 10**9              # a step number past it is not one a run reached
MAX_VALUE = 1e15              # a metric past it is not a measurement (sums of a few 1e308 overflow the charts)
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CRASH_FILE = "crash.log"       # the stacks of a run that died on a fatal signal (driver.py's crash_log)
SAMPLES_FILE = "samples.jsonl"


@dataclass
class Inputs:
    run_dir: Optional[str]
    profile_dir: Optional[str]
    spans: list[dict]               # timeline.jsonl (checked)
    metrics: list[dict]             # metrics.jsonl records of steps >= 1, numbers only (finite)
    manifest: list[dict]            # manifest.jsonl (checked)
    looked: list[str]               # where a manifest was looked for (said when none was found)
    summary: dict = field(default_factory=dict)      # summary.json, reduced (clean_summary)
    validation: list[dict] = field(default_factory=list)  # metrics.jsonl records with step 0 too
    samples: list[dict] = field(default_factory=list)     # samples.jsonl (checked)
    nonfinite: list[dict] = field(default_factory=list)   # per step >= 1: {step, key: "nan" | "inf" | "-inf"} (alarms)
    notes: list[str] = field(default_factory=list)


def locate(path: str, profile: Optional[str] = None, run: Optional[str] = None) -> Inputs:
    """The run's and the profiler's files under `path` (see the module docstring)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a directory")
    has = lambda d, f: d is not None and below(d, f) is not None and os.path.isfile(os.path.join(d, f))  # noqa: E731
    run = run or (path if has(path, TIMELINE_FILE) or has(path, METRICS_FILE) else None)
    notes: list[str] = []
    # the save_path the run recorded wins when it is inside DIR: a copied run's points at the original
    location = read_json(os.path.join(run, LOCATION), notes) if has(run, LOCATION) else None
    recorded = location.get("save_path") if isinstance(location, dict) and isinstance(location.get("save_path"), str) else None
    outside = [f"{recorded} (the run's recorded save_path: outside {path}, not read; give --profile)"] \
        if recorded and below(path, recorded) is None else []
    looked = [profile] if profile else list(dict.fromkeys(
        d for d in (recorded if not outside else None, path, os.path.join(path, "profile")) if d))
    profile = next((d for d in looked if has(d, MANIFEST)), None)
    looked += outside
    if run is None and profile is None:
        raise FileNotFoundError(f"{path}: no timeline.jsonl, metrics.jsonl or manifest.jsonl here, nor a "
                                f"manifest in {', '.join(looked)} (give a run's output dir or a profiler save_path)")
    read = lambda d, name, clean: read_checked(os.path.join(d, name), clean, notes) if has(d, name) else []  # noqa: E731
    metrics = read(run, METRICS_FILE, clean_metrics)
    # the NaN alarm's records: clean_metrics keeps finite numbers only (a second pass, its own notes unsaid)
    nonfinite = [m for m in map(clean_nonfinite, read_jsonl(os.path.join(run, METRICS_FILE), [])) if m is not None] \
        if has(run, METRICS_FILE) else []
    summary = read_json(os.path.join(run, SUMMARY_FILE), notes) if has(run, SUMMARY_FILE) else None
    if summary is None and has(run, CRASH_FILE) and os.path.getsize(os.path.join(run, CRASH_FILE)):
        notes.append(f"the run died on a fatal signal (it wrote no {SUMMARY_FILE}): {CRASH_FILE} holds its threads' "
                     "Python stacks at that moment")
    return Inputs(run, profile, read(run, TIMELINE_FILE, clean_span), [m for m in metrics if m["step"] >= 1],
                  read(profile, MANIFEST, clean_record), looked, clean_summary(summary, notes), metrics,
                  read(run, SAMPLES_FILE, clean_sample), nonfinite, notes)


def below(root: str, rel: str) -> Optional[str]:
    """`root`/`rel` when it resolves (links followed) inside `root`; None when it leads out of it
    (`..`, an absolute path, a symbolic link elsewhere)."""
    full = os.path.join(root, rel)
    real_root = os.path.realpath(root)
    return full if os.path.commonpath([real_root, os.path.realpath(full)]) == real_root else None


# -- reading ------------------------------------------------------------------------------------

def read_jsonl(path: str, notes: list[str]) -> Iterator[dict]:
    """The JSON objects of a JSONL file, streamed; see the module docstring for what is skipped."""
    name, long, bad, count, read = os.path.basename(path), 0, 0, 0, 0
    with open(path, "rb") as f:
        while True:
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                break
            read += len(line)
            if read > MAX_FILE_BYTES:
                notes.append(f"{name}: past the first {_size(MAX_FILE_BYTES)} not read")
                break
            if len(line) > MAX_LINE_BYTES:  # the rest of it is read in bounded pieces and dropped
                long += 1
                while line and not line.endswith(b"\n"):
                    line = f.readline(MAX_LINE_BYTES + 1)
                    read += len(line)
                continue
            row = _parse(line)
            if row is _BAD:
                bad += line.strip() != b""
                continue
            if not isinstance(row, dict):
                bad += 1
                continue
            if count == MAX_RECORDS:
                notes.append(f"{name}: records past the first {MAX_RECORDS} not read")
                break
            count += 1
            yield row
    if long:
        notes.append(f"{name}: {long} line(s) longer than {_size(MAX_LINE_BYTES)} skipped")
    if bad:
        notes.append(f"{name}: {bad} line(s) that are not JSON objects skipped")


def read_checked(path: str, clean, notes: list[str]) -> list[dict]:
    """The records of a JSONL file that `clean` keeps; the ones it drops are counted in one note."""
    rows, dropped = [], 0
    for row in read_jsonl(path, notes):
        kept = clean(row)
        dropped += kept is None
        if kept is not None:
            rows.append(kept)
    if dropped:
        notes.append(f"{os.path.basename(path)}: {dropped} record(s) not of the shape plait writes skipped "
                     "(a wrong type, a missing key, a number not finite or out of range, an end before its start)")
    return rows


def read_json(path: str, notes: list[str]) -> Any:
    """A JSON file's value, or None (said in `notes`) when it is too large or does not parse."""
    name = os.path.basename(path)
    with open(path, "rb") as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        notes.append(f"{name}: larger than {_size(MAX_JSON_BYTES)}; not read")
        return None
    value = _parse(data)
    if value is _BAD:
        notes.append(f"{name}: not JSON; not read")
        return None
    return value


_BAD = object()


def _parse(data: bytes) -> Any:
    """json.loads that answers _BAD for anything it cannot read: bad syntax or encoding, nesting past the
    parser's stack (RecursionError), an integer too long to convert (ValueError), non-finite literals."""
    try:
        return json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return _BAD


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number plait writes")


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


# -- the shapes plait writes --------------------------------------------------------------------

def number(v) -> bool:
    """A finite int or float (a bool is not a number here; nor an integer past a float's range, 10**400)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def moment(v) -> bool:
    """A wall-clock time in seconds that the µs clock can hold (see MAX_TIME_S)."""
    return number(v) and abs(v) < MAX_TIME_S


def integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def step_number(v) -> bool:
    return integer(v) and 0 <= v < MAX_STEP


def text(v) -> bool:
    return isinstance(v, str) and len(v) <= 1000


def clean_span(r: dict) -> Optional[dict]:
    """A timeline.jsonl record: {step, role, stage, pid, thread, start, end, version[, tid, rank, session]}."""
    ok = (step_number(r.get("step")) and text(r.get("role")) and text(r.get("stage")) and integer(r.get("pid"))
          and text(r.get("thread")) and moment(r.get("start")) and moment(r.get("end")) and r["end"] >= r["start"]
          and (r.get("version") is None or integer(r["version"])) and all(
              k not in r or integer(r[k]) for k in ("tid", "rank")) and (r.get("session") is None or text(r["session"])))
    return {k: r.get(k) for k in ("step", "role", "stage", "pid", "thread", "start", "end", "version", "tid",
                                  "rank", "session")} if ok else None


def clean_metrics(r: dict) -> Optional[dict]:
    """A metrics.jsonl record: a step number and its finite numbers below MAX_VALUE (anything else is not plotted)."""
    if not step_number(r.get("step")):
        return None
    return {k: v for k, v in r.items() if text(k) and number(v) and abs(v) < MAX_VALUE}


def clean_nonfinite(r: dict) -> Optional[dict]:
    """A metrics.jsonl record's non-finite values ({step, key: "nan", ...}), or None when it has none or is
    not a step >= 1: what the NaN alarm reads (clean_metrics keeps finite numbers only)."""
    if not integer(r.get("step")) or r["step"] < 1:
        return None
    bad = {k: v for k, v in r.items() if isinstance(k, str) and len(k) <= 1000 and v in NONFINITE}
    return {"step": r["step"], **bad} if bad else None


def clean_record(r: dict) -> Optional[dict]:
    """A manifest.jsonl record as the profiler writes it (steps [first, last], or null for an OOM dump)."""
    steps = r.get("steps")
    ok = ((steps is None or (isinstance(steps, list) and len(steps) == 2 and all(map(step_number, steps))
                             and 1 <= steps[0] <= steps[1]))
          and text(r.get("role")) and integer(r.get("rank")) and integer(r.get("pid")) and text(r.get("tool"))
          and isinstance(r.get("complete"), bool) and all(r.get(k) is None or text(r[k]) for k in ("path", "stage"))
          and (r.get("policy_version") is None or integer(r["policy_version"]))
          and all(moment(r.get(k)) for k in ("start_time", "end_time")))
    return dict(r) if ok else None


def clean_sample(r: dict) -> Optional[dict]:
    """A samples.jsonl record (plait/profiler/samples.py): sample, span, start, end, step[, version, attrs]."""
    ok = (text(r.get("sample")) and text(r.get("span")) and moment(r.get("start")) and moment(r.get("end"))
          and r["end"] >= r["start"] and step_number(r.get("step"))
          and (r.get("version") is None or integer(r["version"])) and isinstance(r.get("attrs", {}), dict))
    if not ok:
        return None
    attrs = {k: v for k, v in r.get("attrs", {}).items() if isinstance(k, str) and (number(v) or text(v))}
    return {**{k: r.get(k) for k in ("sample", "span", "start", "end", "step", "version")}, "attrs": attrs}


WALL_PARTS = ("total", "startup", "steps", "validation", "checkpoints", "profiler", "other")
LOAD_PARTS = ("1m", "5m", "15m", "cpus")


def clean_summary(s: Any, notes: list[str]) -> dict:
    """summary.json reduced to what the report and the verdict read, each part of its type; {} for none.
    A part of the wrong type is dropped (one note); a setting of the wrong type is dropped by itself."""
    from plait.profiler.analysis.verdict import SETTINGS, fits  # the rules' own table of what they read
    if s is None:
        return {}
    if not isinstance(s, dict):
        notes.append(f"summary.json: a {type(s).__name__}, not an object; not read")
        return {}
    out: dict = {}
    wall = s.get("wall_s")
    if isinstance(wall, dict) and all(number(wall.get(k)) and wall[k] >= 0 for k in WALL_PARTS):
        out["wall_s"] = {k: wall[k] for k in WALL_PARTS}
    elif wall is not None:
        notes.append("summary.json: wall_s not read (each of " + ", ".join(WALL_PARTS) + " must be seconds)")
    peak = s.get("memory_peak")
    if isinstance(peak, dict) and number(peak.get("gb")) and text(peak.get("stage")) and text(peak.get("metric")) \
            and integer(peak.get("step")):
        out["memory_peak"] = {k: peak[k] for k in ("gb", "stage", "metric", "step")}
    elif peak is not None:
        notes.append("summary.json: memory_peak not read (gb, stage, metric, step)")
    load = s.get("load")
    if isinstance(load, dict) and all(number(load.get(k)) and load[k] >= 0 for k in LOAD_PARTS):
        out["load"] = {k: load[k] for k in LOAD_PARTS}
    elif load is not None:
        notes.append("summary.json: load not read (" + ", ".join(LOAD_PARTS) + " must be numbers)")
    settings = s.get("settings")
    if isinstance(settings, dict):
        out["settings"] = {k: v for k, v in settings.items() if k in SETTINGS and fits(v, SETTINGS[k])}
        dropped = sorted(k for k in settings if k in SETTINGS and k not in out["settings"])
        if dropped:
            notes.append(f"summary.json: settings {', '.join(dropped)} not of its type; the rules that read them are silent")
    elif settings is not None:
        notes.append("summary.json: settings not an object; not read")
    verdicts = s.get("verdict")
    if isinstance(verdicts, list):
        out["verdict"] = [v for v in map(clean_verdict, verdicts) if v is not None]
    return out


def clean_verdict(v: Any) -> Optional[dict]:
    """One verdict as verdict.json and summary.json hold it: the fields `plait profile diff` compares."""
    if not (isinstance(v, dict) and text(v.get("rule")) and text(v.get("line")) and text(v.get("key"))
            and isinstance(v.get("predicted"), dict)):
        return None
    predicted = {k: x for k, x in v["predicted"].items() if isinstance(k, str) and number(x)}
    value = v.get("value")
    return {"rule": v["rule"], "line": v["line"], "key": v["key"], "predicted": predicted,
            "value": value if number(value) or text(value) or isinstance(value, bool) else None}
