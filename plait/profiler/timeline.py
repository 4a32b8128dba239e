"""Always-on recording: the stage timeline (timeline.jsonl) and per-stage peak memory.

    any thread:  TIMELINE.add(role, stage, start, end, version)     one tuple appended under a lock
                 with TIMELINE.span("rollout", "gen", version): ...  the same, as a context manager
    lifecycle:   TIMELINE.open(<output_dir>/timeline.jsonl)          at run start
                 TIMELINE.flush(step)                                 once per step: ONE file append
                 TIMELINE.close()                                     at run end (flushes what is left)

One record per span: {"step", "role", "stage", "pid", "thread", "start", "end", "version"}, start
and end in wall-clock seconds (perf_counter anchored once to time.time(), so spans of one process
never go backwards). A span belongs to the step during whose flush it was written, so a rollouter
span that ends during step N is a step-N record. TIMELINE is per process, like a logger: a
rollouter thread records without being handed anything, and no span is kept while no file is open.

StagePeaks gives the peak memory of each stage, nested stages included: the peak counters are reset
at every stage entry and read in a finally, and an enclosing stage folds in its inner stages'
peaks. On CUDA: the allocator's peak allocated and reserved bytes of the current device. On CPU
(Linux): the process's peak RSS (ru_maxrss, the kernel's hiwater_rss), reset by writing "5" to
/proc/self/clear_refs (checked on Linux 6.x: ru_maxrss follows the reset, also after threads exit);
where that is refused, the peak since process start, which only shows new highs. The reset takes
the process's memory-map lock, and done at every stage boundary it measurably slowed a concurrent
rollouter thread (fully_async on the local backend made fewer partial rollouts), so once another
thread records spans (an async rollouter in this process) CPU peaks are no longer reset: they
then show only new highs since the last reset.
Both counters are per process (CUDA: per device), so a stage's peak includes whatever other threads
allocated meanwhile (an async mode's rollouter thread on the local backend), and
`ru_maxrss`/`max_memory_allocated` read elsewhere become "since the last stage entry" rather than
"since process start".
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import resource
import sys
import threading
import time
from typing import Optional

import torch

WALL0 = time.time() - time.perf_counter()  # perf_counter + WALL0 = wall clock, monotonic in-process
TIMELINE_FILE = "timeline.jsonl"


def wall(perf: float) -> float:
    return WALL0 + perf


class Timeline:
    def __init__(self):
        self._lock = threading.Lock()
        self._spans: list[tuple] = []
        self.path: Optional[str] = None
        self._file = None  # kept open for appending: an open per step costs more than the write
        self.concurrent = False  # a thread other than the main one recorded a span (an async rollouter)

    def open(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with self._lock:
            if self._file is not None:  # a run that never closed its timeline
                self._file.close()
            self.path, self._spans, self.concurrent = path, [], False
            self._file = open(path, "a")

    def add(self, role: str, stage: str, start: float, end: float, version: Optional[int]) -> None:
        """A span from perf_counter start/end; dropped while no file is open."""
        if self.path is None:
            return
        thread = threading.current_thread()
        name = thread.name
        if thread is not threading.main_thread():
            self.concurrent = True
        with self._lock:
            self._spans.append((role, stage, name, start, end, version))

    @contextlib.contextmanager
    def span(self, role: str, stage: str, version: Optional[int] = None):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(role, stage, start, time.perf_counter(), version)

    def flush(self, step: int) -> None:
        with self._lock:
            spans, self._spans, path = self._spans, [], self.path
        if path is None or not spans:
            return
        head = f'{{"step": {step}, "pid": {os.getpid()}, '
        lines = [f'{head}"role": {_enc(role)}, "stage": {_enc(stage)}, "thread": {_enc(thread)}, '
                 f'"start": {WALL0 + start:.6f}, "end": {WALL0 + end:.6f}, "version": {_enc(version)}}}'
                 for role, stage, thread, start, end, version in spans]  # json.dumps per record costs 10x
        self._file.write("\n".join(lines) + "\n")
        self._file.flush()

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed run rewrites them; a fresh start, all)."""
        if self.path is None or not os.path.exists(self.path):
            return
        keep = [r for r in read_timeline(self.path) if r["step"] <= step]
        self._file.seek(0)
        self._file.truncate()
        self._file.writelines(json.dumps(r) + "\n" for r in keep)
        self._file.flush()

    def close(self, step: int) -> None:
        self.flush(step)
        with self._lock:
            self.path, self.concurrent = None, False
            if self._file is not None:
                self._file.close()
                self._file = None


TIMELINE = Timeline()


@functools.lru_cache(maxsize=1024)
def _enc(value) -> str:
    """JSON of a name or version; there are few distinct ones, so each is encoded once."""
    return json.dumps(value)


def read_timeline(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class StagePeaks:
    """Peak memory (bytes) per stage of one thread's nested stages; see the module docstring."""

    def __init__(self):
        self.cuda = torch.cuda.is_available()
        self._stack: list[dict[str, int]] = []  # running peaks of the open stages, outermost first

    def enter(self) -> None:
        if self._stack:  # what the enclosing stage reached before this one starts
            fold_peaks(self._stack[-1], self._read())
        self._stack.append({})
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        elif not TIMELINE.concurrent:
            _RSS.reset()

    def exit(self) -> dict[str, int]:
        """The closing stage's peaks; folded into the enclosing stage."""
        peaks = fold_peaks(self._stack.pop(), self._read())
        if self._stack:
            fold_peaks(self._stack[-1], peaks)
        return peaks

    def _read(self) -> dict[str, int]:
        if self.cuda:
            return {"peak_allocated": torch.cuda.max_memory_allocated(),
                    "peak_reserved": torch.cuda.max_memory_reserved()}
        return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * RU_MAXRSS_UNIT}


class _PeakRss:
    """Resets the process's peak RSS through a kept-open /proc/self/clear_refs (an open costs more
    than the write); reopened after a fork, since /proc/self is resolved at open time. Without it
    (not Linux, or refused) nothing is reset and ru_maxrss is the peak since process start."""

    def __init__(self):
        self.pid, self.fd = -1, None

    def reset(self) -> None:
        if self.pid != os.getpid():
            self.pid = os.getpid()
            try:
                self.fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
            except OSError:
                self.fd = None
        if self.fd is not None:
            os.write(self.fd, b"5")


RU_MAXRSS_UNIT = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
_RSS = _PeakRss()


def overlap_s(spans: list[dict], stage: str, others: tuple[str, ...]) -> dict[int, float]:
    """Per step: seconds the rollout's spans named in `others` overlap the trainer's `stage` spans
    (wall clock: the async modes' check that generation really runs while the trainer trains)."""
    gens = [s for s in spans if s["role"] == "rollout" and s["stage"] in others]
    out: dict[int, float] = {}
    for u in (s for s in spans if s["role"] == "trainer" and s["stage"] == stage):
        both = sum(max(0.0, min(u["end"], g["end"]) - max(u["start"], g["start"])) for g in gens)
        out[u["step"]] = out.get(u["step"], 0.0) + both
    return out


def fold_peaks(into: dict[str, int], peaks: dict[str, int]) -> dict[str, int]:
    for k, v in peaks.items():
        into[k] = max(into.get(k, 0), v)
    return into


def stage_memory_metrics(peaks: dict[str, dict[str, int]]) -> dict[str, float]:
    """memory/<stage>/<counter>_gb from StageTimer's per-stage peaks."""
    return {f"memory/{stage}/{k}_gb": v / 2**30 for stage, p in peaks.items() for k, v in p.items()}
