"""Where profiler artifacts go and how they are listed: one naming function, one manifest writer.

    <save_path>/step<N>[-<M>]/<role>_rank<r>[_<stage>].<ext>
    <save_path>/oom/<role>_rank<r>_oom-<n>.{pickle,txt}   torch_memory: a CUDA OOM outside any window
    <save_path>/manifest.jsonl     one JSON line per artifact

Role and stage names are sanitised so a stage called "gen/vllm" or "../x" cannot leave the step
folder. Manifest paths are relative to `save_path`, so the folder can be moved or uploaded whole.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional, Sequence

MANIFEST = "manifest.jsonl"
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
    """Append one JSON line per record to `<save_path>/manifest.jsonl`."""
    if not records:
        return
    os.makedirs(save_path, exist_ok=True)
    lines = []
    for record in records:
        if set(record) != set(RECORD_KEYS):
            raise ValueError(f"manifest record keys {sorted(record)} != {sorted(RECORD_KEYS)}")
        lines.append(json.dumps({k: record[k] for k in RECORD_KEYS}) + "\n")
    with open(os.path.join(save_path, MANIFEST), "a") as f:
        f.writelines(lines)


def read_manifest(save_path: str) -> list[dict]:
    path = os.path.join(save_path, MANIFEST)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
