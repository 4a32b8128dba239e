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

A schedule (`tool_config.torch.schedule`, verl's skip_first/wait/warmup/active/repeat) is a
torch.profiler.schedule stepped once per update mini-batch (`step()`, from the actor's and
critic's update loops), never by the other stages. Continuous: the window's collector follows it
with `repeat` 0 read as 1, so a window keeps what runs up to the end of its first active
mini-batches (everything before them too, unless skip_first/wait/warmup skip ahead) and nothing
after; later cycles (repeat > 1) are files `<name>_part<k>`. Discrete: only the stage that steps
it (`scheduled=True`: update_actor, update_critic) is scheduled, `repeat` as given, one file per
active cycle named by its mini-batches (`update_actor_mb1-2`); other stages are traced whole.
torch's "ProfilerStep#<n>" rows are turned off: a step here is a mini-batch, not an RL step.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import tempfile
import threading
import time
import warnings
from typing import Iterator, Optional

import torch
from torch._C._autograd import _profiler_enabled
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, record_function

log = logging.getLogger("plait.profiler")

TRACE_EXT = "pt.trace.json.gz"
# Kineto prints "USDT: ... profiler_start/stop" at every window; 6 is above all its levels. Read when
# a collector starts, so setting it here (in every process that profiles) is early enough.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")
# A scheduled collector saves each cycle as it ends, so its events are meant to be cleared after it:
# torch's warning about that is noise (its warning about warmup=0 is silenced where one is built).
warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")


def init_kineto() -> None:
    """Kineto's one-time start-up, here, on this thread. It must run on the thread that loaded torch (whose
    load registered torch's Kineto client), else Kineto prints "ERROR: External init callback must run in
    same thread as registerClient" to stderr, which no log level silences. A Ray worker loads torch on its
    main thread and runs its calls, a window's start among them, on others; its Host calls this in
    __init__ (the main thread). An empty CPU collection: the start-up's seconds move from the first window
    to the worker's start."""
    with torch.profiler.profile(activities=[ProfilerActivity.CPU]):
        pass


class TorchTool:
    def __init__(self, contents: set[str], discrete: bool, cuda: bool, schedule: Optional[dict] = None):
        """`schedule`: torch.profiler.schedule keywords (TorchScheduleConfig.torch_kwargs), or None."""
        self.discrete, self.schedule = discrete, schedule
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
        self._stepped = False  # whether self._prof follows the schedule (step() advances it)
        self._lock = threading.Lock()  # stages on several threads start and stop the one collector

    def open(self, window) -> None:
        with self._lock:
            self._window = window
            if not self.discrete:
                scheduled = self.schedule is not None
                self._prof = self._start(window, None, scheduled)
                self._stepped = scheduled

    @contextlib.contextmanager
    def stage(self, role: str, stage: str, own_file: bool, scheduled: bool = False) -> Iterator[None]:
        """`scheduled`: this stage steps the schedule (an update loop); discrete, it alone follows it."""
        label = f"{role}/{stage}"
        with self._lock:
            collecting = self._prof is not None
            own = not collecting and self.discrete and own_file and self._window is not None
            if own:
                self._stepped = scheduled and self.schedule is not None
                self._prof = prof = self._start(self._window, (role, stage), self._stepped)
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

    def _start(self, window, stage: Optional[tuple[str, str]], scheduled: bool) -> torch.profiler.profile:
        # Two profiler sessions at once crash the process (a segfault on torch 2.13): refuse. This
        # check sees only the calling thread's; self._prof under the lock guards this tool's own.
        if _profiler_enabled():
            raise RuntimeError("another torch profiler is already running in this process")
        if not scheduled:
            prof = torch.profiler.profile(**self.options)
        else:
            schedule = dict(self.schedule, repeat=self.schedule["repeat"] or (1 if stage is None else 0))
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
                prof = torch.profiler.profile(**self.options, schedule=torch.profiler.schedule(**schedule),
                                              on_trace_ready=self._saver(window, stage, time.time()))
            prof.record_steps = False  # no "ProfilerStep#<n>" rows: a step is one update mini-batch
        prof.start()
        return prof

    def _saver(self, window, stage: Optional[tuple[str, str]], start: float) -> "_CycleSaver":
        return _CycleSaver(self, window, stage, start)

    def step(self) -> None:
        """One update mini-batch done: advance the running collector's schedule (a no-op without one)."""
        with self._lock:
            if self._prof is not None and self._stepped:
                self._prof.step()

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
            stepped, self._stepped = self._stepped, False
            prof.stop()  # under the lock: a stage entering meanwhile must not start a second one
        if stepped:  # saved cycle by cycle (stop() saves one still recording); say if none was
            if prof.on_trace_ready.saved == 0:
                log.warning("profiler (%s): the torch schedule %s recorded nothing in steps %d-%d%s: it skips more "
                            "update mini-batches than ran", window.name, self.schedule, window.first, window.last,
                            "" if stage is None else f" ({stage[0]}/{stage[1]})")
            return
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



class _CycleSaver:
    """on_trace_ready of a scheduled collector: saves each active cycle as it ends, and counts them."""

    def __init__(self, tool: TorchTool, window, stage: Optional[tuple[str, str]], start: float):
        self.tool, self.window, self.stage, self.start = tool, window, stage, start
        self.saved = 0

    def __call__(self, prof: torch.profiler.profile) -> None:
        export = lambda path: self.tool._export(prof, path)  # noqa: E731
        if self.stage is None:  # the window's trace; repeat > 1 adds _part1, _part2, ...
            self.window.save(self.window.name, TRACE_EXT, export, stage=f"part{self.saved}" if self.saved else None,
                             start_time=self.start)
        else:
            first, last = scheduled_mini_batches(self.tool.schedule, prof.step_num)
            mbs = f"mb{first}" if first == last else f"mb{first}-{last}"
            self.window.save(self.stage[0], TRACE_EXT, export, stage=f"{self.stage[1]}_{mbs}", start_time=self.start)
        self.saved += 1

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


def scheduled_mini_batches(schedule: dict, step_num: int) -> tuple[int, int]:
    """(first, last) 0-based update mini-batch of the active cycle saved when the collector has been
    stepped `step_num` times: the last is the one just done; the first comes from the schedule, since a
    cycle the loop ended mid-way holds fewer than `active`."""
    last = max(step_num - 1, 0)
    cycle = schedule["wait"] + schedule["warmup"] + schedule["active"]
    n = max(last - schedule["skip_first"], 0) // cycle
    return min(schedule["skip_first"] + n * cycle + schedule["wait"] + schedule["warmup"], last), last
