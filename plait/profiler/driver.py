"""The driver side: StepProfiler, the only profiler object the step lifecycle touches.

    StepProfiler(cfg, last_step, targets)      plan the windows; warn once about unreachable steps
    begin_step(N, version)   ─▶ start_profile on every target     if a window opens at N
    end_step(N)              ─▶ stop_profile, manifest, hook       if the window closes at N
    close(error)             ─▶ close an open window (complete=false), hook if due; idempotent
    note_start(first)        one warning line for listed steps a resumed run starts after
    busy_s                   seconds spent starting, stopping and writing (the run's summary)
    note(line)               one console line as a window's traces are written (it can take many seconds)

A target is one worker process (ProfileTarget): the local backend passes its ProfilerSession,
Ray a proxy that forwards the two calls. The finish hook runs once, after the last window
closes, or at close() when a window opened but the run ended or failed before the hook ran.
A target or manifest failure is reported and never raised into training.
Its own time is on the timeline as trainer spans `profiler_start`, `profiler_stop` and `finish_hook`
(between steps: on Ray a worker answers stop_profile only after its running call, so the trainer may
wait there for a whole generate).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Callable, ContextManager, Optional, Protocol, Sequence

from plait.profiler.config import GlobalProfilerConfig, snapshot_steps
from plait.profiler.hook import run_finish_hook
from plait.profiler.naming import append_manifest
from plait.profiler.schedule import Window, plan

log = logging.getLogger("plait.profiler")


class ProfileTarget(Protocol):
    def start_profile(self, first_step: int, last_step: int, version: int) -> None: ...
    def stop_profile(self, complete: bool) -> list[dict]: ...


class StepProfiler:
    def __init__(self, cfg: GlobalProfilerConfig, last_step: int, targets: Sequence[ProfileTarget],
                 note: Optional[Callable[[str], None]] = None, held: Callable[[], ContextManager] = contextlib.nullcontext):
        """`held()`: inside it no other thread of this process generates. torch's profiler corrupted the heap when
        it stopped while the rollout thread ran ops (fully_async on the local backend: 1 in 16 profiled runs aborted
        in malloc), so windows open and close inside it."""
        self.cfg, self.held = cfg, held
        self.note = note or (lambda line: print(line, file=sys.stderr))
        self.plan = plan((cfg.steps or []) if cfg.tool else [], last_step, cfg.profile_continuous_steps,
                         snapshot_steps(cfg))
        if self.plan.warning:
            log.warning("profiler: %s", self.plan.warning)
        self.targets = list(targets)
        self.open: Optional[Window] = None
        self.opened_any = False
        self.hook_ran = False
        self.busy_s = 0.0

    def note_start(self, first: int) -> None:
        """A run resumed at `first` never reaches listed steps before it: say so once."""
        before = [s for s in (self.cfg.steps or []) if s < first] if self.cfg.tool else []
        if before:
            log.warning("profiler: steps %s come before this run's first step %d (it resumed from a checkpoint); "
                        "they are not profiled", before, first)

    def begin_step(self, step: int, version: int) -> None:
        w = self.plan.window_of(step)
        if self.open is not None or w is None:
            return
        t0 = time.perf_counter()
        # A run resumed inside a planned window opens it at the resume step.
        self.open = Window(step, w.last)
        self.opened_any = True
        with self._held(t0) as t0:
            for target in self.targets:
                try:
                    target.start_profile(self.open.first, self.open.last, version)
                except Exception as err:
                    log.warning("profiler: start_profile failed on %r: %s: %s", target, type(err).__name__, err)
            self._spent("profiler_start", t0)

    def end_step(self, step: int) -> None:
        if self.open is not None and step >= self.open.last:
            self._stop(complete=True)
        if self.open is None and self.plan.hook_step is not None and step >= self.plan.hook_step:
            self._finish()

    def close(self, error: Optional[BaseException] = None) -> None:
        """Run end or failure: close an open window as incomplete, run the hook if still due.

        A window still open here did not reach its last step, so it is incomplete whether or not
        `error` is set; the lifecycle re-raises the error itself.
        """
        if self.open is not None or self.cfg.tool == "torch_memory":
            self._stop(complete=False)  # the run ended before the window's last step; or OOM dumps
        self._finish()

    def _stop(self, complete: bool) -> None:
        t0 = time.perf_counter()
        if self.open is not None:  # writing the traces takes seconds to minutes: the console is not left silent
            steps = f"step {self.open.first}" if self.open.first == self.open.last else \
                f"steps {self.open.first}-{self.open.last}"
            self.note(f"plait: profiler: writing the {self.cfg.tool} traces of {steps} to {self.cfg.save_path} ...")
        self.open = None
        records: list[dict] = []
        with self._held(t0) as t0:
            for target in self.targets:
                try:
                    records.extend(target.stop_profile(complete))
                except Exception as err:
                    log.warning("profiler: stop_profile failed on %r: %s: %s", target, type(err).__name__, err)
            try:
                append_manifest(self.cfg.save_path, records)
            except Exception as err:
                log.warning("profiler: could not write the manifest: %s: %s", type(err).__name__, err)
            self._spent("profiler_stop", t0)

    def _finish(self) -> None:
        if not self.opened_any or self.hook_ran:
            return
        self.hook_ran = True
        if self.cfg.finish_hook_cmd is not None:
            t0 = time.perf_counter()
            run_finish_hook(self.cfg.finish_hook_cmd, self.cfg.save_path, self.cfg.tool)
            self._spent("finish_hook", t0)

    @contextlib.contextmanager
    def _held(self, t0: float):
        """`held()`, its wait for the rollout thread's call a span of its own (the profiler's cost too); yields
        when the profiler's own work starts."""
        with self.held():
            if time.perf_counter() - t0 > 1e-3:
                self._spent("wait_rollout", t0)
            yield time.perf_counter()

    def _spent(self, what: str, t0: float) -> None:
        """The profiler's own time since t0: into busy_s (the run summary) and a timeline span."""
        from plait.profiler.timeline import TIMELINE  # it imports torch; plait.config reads this package first
        end = time.perf_counter()
        self.busy_s += end - t0
        TIMELINE.add("trainer", what, t0, end, None)
