"""Always-on recording: the stage timeline (timeline.jsonl) and per-stage peak memory.

    any thread:  TIMELINE.add(role, stage, start, end, version)     one tuple appended under a lock
                 with TIMELINE.span("rollout", "gen", version): ...  the same, as a context manager
    lifecycle:   TIMELINE.open(<output_dir>/timeline.jsonl)          at run start
                 TIMELINE.flush(step)                                 once per step: ONE file append
                 TIMELINE.close()                                     at run end (flushes what is left)

One record per span: {"step", "role", "stage", "pid", "thread", "tid", "start", "end", "version"} (and
"session" where the span belongs to a served client: a Tinker training client or sampler, plait/serving/tinker),
start and end in wall-clock seconds (perf_counter anchored once to time.time(), so spans of one
process never go backwards), `tid` the OS thread id (the one torch traces name their threads by).
Worker processes of the Ray backend record their own stage spans (RANK_SPANS below, every step, not
only inside profiler windows); they reach the driver with each call's reply and are written here with
the worker's pid and `"rank"`. A span belongs to the step during whose flush it was written, so a rollouter
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

WALL0 = time.time() - time.perf_counter()  # perf_counter + WALL0 = wall clock, monotonic in-process
TIMELINE_FILE = "timeline.jsonl"
ROLLOUT_WORK = ("gen", "resume")  # the rollouter's generating spans (a timeline before this release: "generate")
COLLECTIVES = ("all_reduce", "all_gather")
NULL_SPAN = contextlib.nullcontext()  # what a disabled recorder (and a profiler between windows) hands out: shared  # a rank's waits for the others (RANK_SPANS.collective)


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

    def add(self, role: str, stage: str, start: float, end: float, version: Optional[int],
            session: Optional[str] = None) -> None:
        """A span from perf_counter start/end; dropped while no file is open. `session`: the served client it is for."""
        if self.path is None:
            return
        thread = threading.current_thread()
        name = thread.name
        if thread is not threading.main_thread():
            self.concurrent = True
        with self._lock:
            self._spans.append((role, stage, name, start, end, version, None, threading.get_native_id(), None, session))

    def add_remote(self, pid: int, spans: list[tuple]) -> None:
        """A worker process's spans (RankSpans.take: role, stage, thread, tid, start, end, rank; perf_counter
        of that process shifted to wall clock there), written with its pid and rank."""
        if self.path is None or not spans:
            return
        with self._lock:
            self._spans.extend((role, stage, thread, start - WALL0, end - WALL0, None, pid, tid, rank, None)
                               for role, stage, thread, tid, start, end, rank in spans)

    @contextlib.contextmanager
    def span(self, role: str, stage: str, version: Optional[int] = None, session: Optional[str] = None):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(role, stage, start, time.perf_counter(), version, session)

    def flush(self, step: int) -> None:
        with self._lock:
            spans, self._spans, path = self._spans, [], self.path
        if path is None or not spans:
            return
        me = os.getpid()
        lines = [f'{{"step": {step}, "pid": {pid or me}, "role": {_enc(role)}, "stage": {_enc(stage)}, '
                 f'"thread": {_enc(thread)}, "tid": {tid}, "start": {WALL0 + start:.6f}, "end": {WALL0 + end:.6f}, '
                 f'"version": {_enc(version)}' + (f', "rank": {rank}' if rank is not None else "")
                 + (f', "session": {json.dumps(session)}}}' if session is not None else "}")
                 for role, stage, thread, start, end, version, pid, tid, rank, session in spans]  # json.dumps per record costs 10x
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

    def rank_metrics(self) -> dict[str, float]:
        """rank_metrics of the workers' spans buffered now (this step's)."""
        with self._lock:
            spans = [(role, stage, rank, pid, tid, start, end)
                     for role, stage, _, start, end, _, pid, tid, rank, _ in self._spans if rank is not None]
        return rank_metrics(rank_stages(spans))

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


def rank_stages(spans: list[tuple]) -> dict[tuple[str, str], dict[int, list[float]]]:
    """(role, stage) -> rank -> [seconds in the stage, seconds of it in collectives], from workers' spans
    (role, stage, rank, pid, tid, start, end) of one step; a collective counts in the stages around it."""
    threads: dict[tuple, list[tuple]] = {}
    for span in spans:
        threads.setdefault((span[3], span[4]), []).append(span)
    out: dict[tuple[str, str], dict[int, list[float]]] = {}
    for group in threads.values():
        waits = [(s, e) for _, stage, _, _, _, s, e in group if stage in COLLECTIVES]
        for role, stage, rank, _, _, a, b in group:
            if stage in COLLECTIVES:
                continue
            acc = out.setdefault((role, stage), {}).setdefault(rank, [0.0, 0.0])
            acc[0] += b - a
            acc[1] += sum(min(b, e) - max(a, s) for s, e in waits if s < b and e > a)
    return out


def rank_metrics(stages: dict[tuple[str, str], dict[int, list[float]]]) -> dict[str, float]:
    """Per role and stage run by two ranks or more: ranks/<role>/<stage>/rank<r>_s (seconds),
    .../rank<r>_wait_s (of which in collectives, waiting for the others), .../skew (the slowest rank's
    own work, stage less waits, over the median rank's) and .../slowest_rank."""
    out = {}
    for (role, stage), per_rank in stages.items():
        if len(per_rank) < 2:
            continue
        prefix = f"ranks/{role}/{stage}"
        for r, (total, wait) in sorted(per_rank.items()):
            out[f"{prefix}/rank{r}_s"], out[f"{prefix}/rank{r}_wait_s"] = total, wait
        work = {r: max(total - wait, 0.0) for r, (total, wait) in per_rank.items()}
        median = sorted(work.values())[(len(work) - 1) // 2]  # of two ranks: the faster one
        slow = max(work, key=work.get)
        out[f"{prefix}/skew"] = work[slow] / median if median > 0 else 1.0
        out[f"{prefix}/slowest_rank"] = slow
    return out


class RankSpans:
    """A worker process's own spans, recorded every step once `enable`d (the Ray backend's hosts): a
    perf_counter pair and a list append per stage, handed to the driver with each call's reply (`take`).
    `collective(name)` marks a wait for the other ranks (an all-reduce), inside the open stage's role."""

    def __init__(self):
        self.rank: Optional[int] = None
        self._spans: list[tuple] = []
        self._roles: list[str] = []  # roles of the open stages, innermost last

    def enable(self, rank: int) -> None:
        self.rank = rank

    def stage(self, role: str, stage: str):
        return _RankSpan(self, role, stage) if self.rank is not None else NULL_SPAN

    def collective(self, name: str):
        if self.rank is None or not self._roles:
            return NULL_SPAN
        return _RankSpan(self, self._roles[-1], name)

    def take(self) -> list[tuple]:
        spans, self._spans = self._spans, []
        return spans


class _RankSpan:
    __slots__ = ("rec", "role", "stage", "start")

    def __init__(self, rec: RankSpans, role: str, stage: str):
        self.rec, self.role, self.stage = rec, role, stage

    def __enter__(self):
        self.rec._roles.append(self.role)
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> bool:
        end = time.perf_counter()
        self.rec._roles.pop()
        thread = threading.current_thread()
        self.rec._spans.append((self.role, self.stage, thread.name, thread.native_id, WALL0 + self.start,
                                WALL0 + end, self.rec.rank))
        return False


RANK_SPANS = RankSpans()


def read_timeline(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class StagePeaks:
    """Peak memory (bytes) per stage of one thread's nested stages; see the module docstring."""

    def __init__(self):
        import torch  # here, not at the top: `plait profile report` reads this module and needs no torch
        self.cuda = torch.cuda.is_available()
        self._cuda = torch.cuda
        self._stack: list[dict[str, int]] = []  # running peaks of the open stages, outermost first

    def enter(self) -> None:
        if self._stack:  # what the enclosing stage reached before this one starts
            fold_peaks(self._stack[-1], self._read())
        self._stack.append({})
        if self.cuda:
            self._cuda.reset_peak_memory_stats()
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
            return {"peak_allocated": self._cuda.max_memory_allocated(),
                    "peak_reserved": self._cuda.max_memory_reserved()}
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
    gens = [s for s in spans if s["role"] == "rollout" and s["stage"] in others and s.get("rank") is None]
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


def union_of(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping (start, end) spans merged: the time any of them covers, once (replicas judging at once; a server's jobs)."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
