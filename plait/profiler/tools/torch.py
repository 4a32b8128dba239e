"""The `torch` tool: a torch.profiler Chrome trace per window, or per stage with `discrete`.

CPU activity is always recorded, because stage names are CPU-side `record_function` ranges;
CUDA activity is added when CUDA is available, unless `contents` asks for cpu alone. `contents`
memory / shapes / stack map to profile_memory / record_shapes / with_stack. With memory on, the
trace also gets a counter track per device ("memory allocated (cpu)"), which Perfetto draws as a
curve above the stages; torch.profiler itself writes only per-allocation instant events.
Discrete stages assume one stage at a time per process; a stage nested in a discrete stage is a
range inside its parent's trace.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
import time
from typing import Iterator

import torch
from torch._C._autograd import _profiler_enabled
from torch.profiler import ProfilerActivity, record_function

TRACE_EXT = "pt.trace.json.gz"


class TorchTool:
    def __init__(self, contents: set[str], discrete: bool, cuda: bool):
        self.discrete = discrete
        self.options = dict(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
            profile_memory="memory" in contents, record_shapes="shapes" in contents,
            with_stack="stack" in contents)
        self._window = None
        self._prof: torch.profiler.profile | None = None  # the window's, or the running stage's

    def open(self, window) -> None:
        self._window = window
        if not self.discrete:
            self._prof = self._start()

    @contextlib.contextmanager
    def stage(self, role: str, stage: str, own_file: bool) -> Iterator[None]:
        label = f"{role}/{stage}"
        if self._prof is not None:  # the window's collector, or a discrete stage this one nests in
            with record_function(label):
                yield
            return
        if not own_file:  # discrete, and this role is not profiled here: nothing is collecting
            yield
            return
        start = time.time()
        self._prof = prof = self._start()
        try:
            with record_function(label):
                yield
        finally:
            self._prof = None
            prof.stop()
            self._window.save(role, TRACE_EXT, lambda path: self._export(prof, path), stage=stage,
                              start_time=start)

    def _start(self) -> torch.profiler.profile:
        # Two profiler sessions at once crash the process (a segfault on torch 2.13): refuse.
        if _profiler_enabled():
            raise RuntimeError("another torch profiler is already running in this process")
        prof = torch.profiler.profile(**self.options)
        prof.start()
        return prof

    def close(self) -> None:
        prof, self._prof = self._prof, None
        if prof is not None:
            prof.stop()
            self._window.save(self._window.name, TRACE_EXT, lambda path: self._export(prof, path))
        self._window = None

    def _export(self, prof: torch.profiler.profile, path: str) -> None:
        if not self.options["profile_memory"]:
            prof.export_chrome_trace(path)  # gzips because of the .gz suffix
            return
        with tempfile.TemporaryDirectory() as tmp:
            raw = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(raw)
            with open(raw) as f:
                trace = json.loads(f.read())  # whole-string (de)coding: json.dump to a file is ~5x slower
        trace["traceEvents"].extend(memory_counters(trace["traceEvents"]))
        with gzip.open(path, "wb", compresslevel=6) as f:
            f.write(json.dumps(trace).encode())


def memory_counters(events: list[dict]) -> list[dict]:
    """Chrome-trace counter events ("ph": "C") of allocated bytes per device, from "[memory]" events."""
    counters = []
    for e in events:
        if e.get("name") != "[memory]":
            continue
        args = e["args"]
        kind = args["Device Type"]  # c10::DeviceType: 0 CPU, 1 CUDA
        device = "cpu" if kind == 0 else f"{'cuda' if kind == 1 else f'device{kind}'}:{args['Device Id']}"
        counters.append({"ph": "C", "name": f"memory allocated ({device})", "pid": e["pid"],
                         "ts": e["ts"], "args": {"bytes": args["Total Allocated"]}})
    return counters
