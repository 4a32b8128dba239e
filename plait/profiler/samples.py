"""Per-sample lifecycle: where each sample's time went, from the prompt's submission to the update that
trained on it (or the filter that dropped it): `samples.jsonl` in the run's output dir.

One JSON line per span of one sample (a sample is one response: prompt x rollout.n rows):

    {"sample": "0.17.2", "span": "gen", "start": 1796304555.73, "end": 1796304555.74, "step": 3,
     "version": 2, "attrs": {"turn": 1}}

    sample   the row's id, "<epoch>.<prompt index>.<response j>" (RolloutBatch.sample_ids); verl's V1
             modes' "g<group uid>.<j>" (a group's uid is unique in a run); ids of other producers are any
             string they keep for one sample
    span     what the sample was doing; plait writes
               queue      submitted, waiting for the rollout to start it (one_step_off, fully_async)
               gen        in a generate call (agent loops: one per assistant turn, attrs.turn)
               tool       in a tool call (agent loops; attrs.turn)
               resume     finishing after a weight sync cut it short (fully_async partial rollout)
               queued     generated, waiting for the trainer to take it
               reward     being scored (the step's reward stage)
               consumed   instant (start == end): trained on at `step`; attrs.staleness = versions behind
               dropped    instant: removed by algorithm.filter_groups (no signal in its group)
               discarded  instant: the run stopped with it queued or in flight
    start, end  wall-clock seconds; `step` the step during which it was written; `version` the policy
             version it was generated with (null when unknown); `attrs` numbers or strings

How a producer appends a span:
    - in the driver (any thread):  SAMPLES.add(sample_id, span, start, end, version=None, **attrs)
    - wherever a row's info dict travels with the batch (a rollout worker, an agent loop, a session
      gateway in another process):  add_span(info, span, start, end, **attrs) appends to
      info["sample_spans"]; when the batch reaches the trainer, every row's spans are written under its
      sample id (`SAMPLES.from_infos`). Names are free: a gateway adds e.g. "request_queue",
      "prefill", "decode", "agent" (the agent's own time between calls).
    - `now()` is the clock plait's own spans use (wall clock, monotonic within a process).
Spans are buffered and written once per step, like timeline.jsonl. `SAMPLES.take(ids, t)` adds each
sample's `queued` span (from the end of its last span to `t`); `finish(ids, kind, t, ...)` writes the
terminal instant and forgets the sample; `close` marks what is left `discarded`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Optional, Sequence

from plait.profiler.timeline import WALL0

SAMPLES_FILE = "samples.jsonl"
TERMINAL = ("consumed", "dropped", "discarded")


def now() -> float:
    """Wall-clock seconds on the clock of timeline.jsonl (perf_counter anchored once to time.time())."""
    return WALL0 + time.perf_counter()


def add_span(info: dict, span: str, start: float, end: float, **attrs) -> None:
    """Append a span (wall-clock seconds) to a row's info dict: written under the row's sample id when its
    batch reaches the trainer. The one call a producer outside the driver needs."""
    info.setdefault("sample_spans", []).append([span, start, end, attrs])


def sample_ids(epoch: int, prompt_indices: Sequence[int]) -> list[str]:
    """Ids of a generated batch's rows: "<epoch>.<prompt index>.<j>", j counting each prompt's responses."""
    seen: dict[int, int] = {}
    out = []
    for index in prompt_indices:
        j = seen[index] = seen.get(index, -1) + 1
        out.append(f"{epoch}.{index}.{j}")
    return out


class SampleLog:
    """The driver's buffer of sample spans; one file append per step (see the module docstring)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._rows: list[tuple] = []
        self._last: dict[str, float] = {}   # live sample -> end of its last span
        self._versions: dict[str, Optional[int]] = {}
        self._file = None
        self.path: Optional[str] = None

    def open(self, path: str) -> None:
        """Start recording for a run; the file is created at the first flush with spans (a run with no
        samples, diffusion, has none)."""
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._rows, self._last, self._versions, self.path, self._file = [], {}, {}, path, None

    def add(self, sample: str, span: str, start: float, end: float, version: Optional[int] = None, **attrs) -> None:
        if self.path is None:
            return
        with self._lock:
            self._rows.append((sample, span, start, end, version, attrs))
            if span not in TERMINAL:
                self._last[sample] = max(end, self._last.get(sample, end))
                if version is not None:
                    self._versions[sample] = version

    def add_many(self, samples: Sequence[str], span: str, start: float, end: float,
                 versions: Optional[Sequence[int]] = None) -> None:
        for i, sample in enumerate(samples):
            self.add(sample, span, start, end, None if versions is None else versions[i])

    def versions(self, samples: Sequence[str], versions: Sequence[int]) -> None:
        """The policy version each sample is generated with, for spans added without one (from_infos)."""
        with self._lock:
            self._versions.update(zip(samples, versions))

    def from_infos(self, samples: Sequence[str], infos: Optional[Sequence[dict]]) -> None:
        """The spans producers appended to rows' info dicts (add_span)."""
        for sample, info in zip(samples, infos or []):
            for span, start, end, attrs in (info or {}).get("sample_spans", []):
                self.add(sample, span, start, end, self._versions.get(sample), **attrs)

    def take(self, samples: Sequence[str], t: float) -> None:
        """The trainer takes these samples at `t`: each waited `queued` since its last span ended."""
        for sample in samples:
            last = self._last.get(sample)
            if last is not None and t > last:
                self.add(sample, "queued", last, t, self._versions.get(sample))

    def finish(self, samples: Sequence[str], kind: str, t: float, **per_sample: Sequence) -> None:
        """The terminal instant of each sample (consumed, dropped, discarded); per-sample attrs by list."""
        for i, sample in enumerate(samples):
            self.add(sample, kind, t, t, self._versions.get(sample), **{k: v[i] for k, v in per_sample.items()})
            with self._lock:
                self._last.pop(sample, None)
                self._versions.pop(sample, None)

    def flush(self, step: int) -> None:
        with self._lock:
            rows, self._rows = self._rows, []
            if self.path is None or not rows:
                return
            if self._file is None:
                self._file = open(self.path, "a")
            file = self._file
        file.write("".join(json.dumps({"sample": s, "span": span, "start": round(a, 6), "end": round(b, 6), "step": step,
                                       "version": v, "attrs": attrs}) + "\n" for s, span, a, b, v, attrs in rows))
        file.flush()

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed run rewrites them), as the timeline does."""
        if self.path is None or not os.path.exists(self.path):
            return
        with open(self.path) as f:
            keep = [line for line in f if _step_of(line) <= step]
        with open(self.path, "w") as f:
            f.writelines(keep)

    def close(self, step: int) -> None:
        """At the run's end: what is still live was never trained on (`discarded`), then the last flush."""
        self.finish(list(dict.fromkeys([*self._last, *self._versions])), "discarded", now())
        self.flush(step)
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._file, self.path = None, None


def _step_of(line: str) -> float:
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return float("inf")
    return step if isinstance(step, int) else float("inf")


SAMPLES = SampleLog()
