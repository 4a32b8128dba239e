"""Where profiler artifacts go and how they are listed: one naming function, one manifest writer.

    <save_path>/step<N>[-<M>]/<role>_rank<r>[_<stage>].<ext>   ext: pt.trace.json.gz, pickle, memray.bin
    <save_path>/oom/<role>_rank<r>_oom-<n>.{pickle,txt}   torch_memory: a CUDA OOM outside any window
    <save_path>/manifest.jsonl     one JSON line per artifact
    <run dir>/profile_location.json   where a run's artifacts went (save_path may be anywhere)

Role and stage names are sanitised so a stage called "gen/vllm" or "../x" cannot leave the step
folder. Manifest paths are relative to `save_path`, so the folder can be moved or uploaded whole.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional, Sequence

MANIFEST = "manifest.jsonl"
LOCATION = "profile_location.json"
MEMRAY_EXT = "memray.bin"  # a memray capture's extension: the tool writes it, the report finds it by it
RECORD_KEYS = ("steps", "role", "stage", "rank", "pid", "tool", "path", "start_time", "end_time",
               "policy_version", "complete")


def sanitise(name: str) -> str:
    """A file-name-safe form of `name`: only [A-Za-z0-9_.-], no "..", no leading dot."""
    if not name:
        raise ValueError("an artifact name part must not be empty")
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    safe = re.sub(r"\.{2,}", "_", safe)
    return "_" + safe[1:] if safe.startswith(".") else safe


def step_dir(save_path: str, first_step: int, last_step: int) -> str:
    span = f"step{first_step}" if first_step == last_step else f"step{first_step}-{last_step}"
    return os.path.join(save_path, span)


def artifact_path(save_path: str, first_step: int, last_step: int, role: str, rank: int, *,
                  ext: str, stage: Optional[str] = None) -> str:
    name = f"{sanitise(role)}_rank{rank}" + (f"_{sanitise(stage)}" if stage is not None else "")
    return os.path.join(step_dir(save_path, first_step, last_step), f"{name}.{ext}")


def oom_path(save_path: str, name: str, rank: int, n: int, *, ext: str) -> str:
    """An out-of-memory dump taken outside any window: <save_path>/oom/<name>_rank<r>_oom-<n>.<ext>."""
    return os.path.join(save_path, "oom", f"{sanitise(name)}_rank{rank}_oom-{n}.{ext}")


def append_manifest(save_path: str, records: Sequence[dict]) -> None:
    """Add one JSON line per record to `<save_path>/manifest.jsonl`, one record per path: a record
    for a path already listed (a resumed run rewrote an interrupted window's artifact) replaces
    the old one and carries "resumed": true. A rewrite goes through a temp file and a rename."""
    if not records:
        return
    os.makedirs(save_path, exist_ok=True)
    for record in records:
        if set(record) != set(RECORD_KEYS):
            raise ValueError(f"manifest record keys {sorted(record)} != {sorted(RECORD_KEYS)}")
    new = [{k: record[k] for k in RECORD_KEYS} for record in records]
    paths = {r["path"] for r in new if r["path"] is not None}
    old = read_manifest(save_path)
    path = os.path.join(save_path, MANIFEST)
    if not any(r["path"] in paths for r in old):
        with open(path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
        return
    for r in new:
        r["resumed"] = r["path"] in {o["path"] for o in old}
    kept = [r for r in old if r["path"] not in paths]
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept + new)
    os.replace(tmp, path)


def temp_name(path: str) -> str:
    """Where an artifact is written before its rename to `path`: same folder and extension
    (tools pick their format from it), a hidden name a reader skips."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".tmp-{os.getpid()}-{name}")


def read_manifest(save_path: str) -> list[dict]:
    path = os.path.join(save_path, MANIFEST)
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except ValueError:  # a line torn by a kill mid-append
                continue
    return records


def write_location(run_dir: str, save_path: str, tool: Optional[str]) -> None:
    """Record in the run's output dir where its artifacts go, so a report of the run finds them."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, LOCATION), "w") as f:
        json.dump({"save_path": os.path.abspath(save_path), "tool": tool}, f)


def read_location(run_dir: str) -> Optional[str]:
    """The save_path a run recorded, or None."""
    try:
        with open(os.path.join(run_dir, LOCATION)) as f:
            return json.load(f)["save_path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def set_aside(save_path: str, dest: str) -> list[str]:
    """Move a previous run's artifacts (manifest, step folders, OOM dumps, report) out of `save_path`
    into `dest`; returns the names moved. Only those names: a save_path may hold other files."""
    if not os.path.isdir(save_path):
        return []
    names = sorted(n for n in os.listdir(save_path)
                   if n in (MANIFEST, "oom", "report") or re.fullmatch(r"step\d+(-\d+)?", n))
    if names:
        os.makedirs(dest, exist_ok=True)
        for name in names:
            os.replace(os.path.join(save_path, name), os.path.join(dest, name))
    return names
