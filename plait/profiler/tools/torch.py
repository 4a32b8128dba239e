"""The `torch` tool: a torch.profiler Chrome trace per window, or per stage with `discrete`.

CPU activity is always recorded, because stage names are CPU-side `record_function` ranges;
CUDA activity is added when CUDA is available, unless `contents` asks for cpu alone. `contents`
memory / shapes / stack map to profile_memory / record_shapes / with_stack. With memory on, the
trace also gets a counter track per device ("memory allocated (cpu)"), which Perfetto draws as a
curve above the stages; torch.profiler itself writes only per-allocation instant events.
The collector records every thread of the process (an async mode's rollout runs its stages on
a thread of its own), except with memory on: PyTorch then records allocations only with a
collector limited to the thread that started it (the driver's, for a window). Discrete gives one
trace per stage while stages run one at a time; a stage that starts inside a running discrete
stage (nested in it, or on another thread) is a range in that stage's trace, and a discrete stage
still running when its window closes is cut there.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
import threading
import time
from typing import Iterator, Optional

import torch
from torch._C._autograd import _profiler_enabled
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, record_function

TRACE_EXT = "pt.trace.json.gz"
# Kineto prints "USDT: ... profiler_start/stop" at every window; 6 is above all its levels. Read when
# a collector starts, so setting it here (in every process that profiles) is early enough.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")


class TorchTool:
    def __init__(self, contents: set[str], discrete: bool, cuda: bool):
        self.discrete = discrete
        self.options = dict(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
            profile_memory="memory" in contents, record_shapes="shapes" in contents,
            with_stack="stack" in contents,
            # Without this only the thread that starts the collector is recorded; with it PyTorch
            # (2.13) records no allocation events at all, so memory traces keep to that thread.
            experimental_config=_ExperimentalConfig(profile_all_threads="memory" not in contents))
        self._window = None
        self._prof: torch.profiler.profile | None = None  # the window's, or the running stage's
        self._stage: Optional[tuple[str, str, float]] = None  # the running discrete stage: role, stage, start
        self._lock = threading.Lock()  # stages on several threads start and stop the one collector

    def open(self, window) -> None:
        with self._lock:
            self._window = window
            if not self.discrete:
                self._prof = self._start()

    @contextlib.contextmanager
    def stage(self, role: str, stage: str, own_file: bool) -> Iterator[None]:
        label = f"{role}/{stage}"
        with self._lock:
            collecting = self._prof is not None
            own = not collecting and self.discrete and own_file and self._window is not None
            if own:
                self._prof = prof = self._start()
                self._stage = (role, stage, time.time())
        if not own:  # inside the window's collector or a running discrete stage, or nothing collects
            with record_function(label) if collecting else contextlib.nullcontext():
                yield
            return
        try:
            with record_function(label):
                yield
        finally:
            self._stop(prof)

    def _start(self) -> torch.profiler.profile:
        # Two profiler sessions at once crash the process (a segfault on torch 2.13): refuse. This
        # check sees only the calling thread's; self._prof under the lock guards this tool's own.
        if _profiler_enabled():
            raise RuntimeError("another torch profiler is already running in this process")
        prof = torch.profiler.profile(**self.options)
        prof.start()
        return prof

    def close(self) -> None:
        self._stop(self._prof)
        with self._lock:
            self._window = None

    def _stop(self, prof: Optional[torch.profiler.profile]) -> None:
        """Stop `prof` and save its trace, once: the window may close while a stage on another
        thread still runs its discrete collector, and whichever comes first stops it."""
        with self._lock:
            if prof is None or prof is not self._prof:
                return
            self._prof = None
            window, stage, self._stage = self._window, self._stage, None
            prof.stop()  # under the lock: a stage entering meanwhile must not start a second one
        if stage is None:
            window.save(window.name, TRACE_EXT, lambda path: self._export(prof, path))
        else:
            role, name, start = stage
            window.save(role, TRACE_EXT, lambda path: self._export(prof, path), stage=name, start_time=start)

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
