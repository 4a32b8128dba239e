"""What both async modes (one_step_off, fully_async) share: the error a generation thread's failure
becomes on the driver, and the clock that measures that thread's idle share (rollouter/idle_ratio)."""

from __future__ import annotations

import contextlib
import threading
import time

from plait.errors import RunError


class RolloutError(RuntimeError):
    """Generation running beside the trainer failed; the cause is chained."""


class RolloutRunError(RolloutError, RunError):
    """The same, when the cause already said itself in one line (a Ray worker's death, a tool pool's
    RunError): the CLI prints the line, no traceback."""


def rollout_error(what: str, err: BaseException) -> RolloutError:
    """`what` failed in the generation thread with `err`: a RunError cause stays one line."""
    if isinstance(err, RunError):
        error = RolloutRunError(f"{what}: {err}")
        error.recoverable = err.recoverable  # a dead worker or engine stays a crash trainer.max_restarts resumes after
        return error
    return RolloutError(f"{what}: {type(err).__name__}: {err}")


class BusyClock:
    """When one thread was busy, so its idle share of any later wall-clock window can be measured."""

    def __init__(self):
        self._lock = threading.Lock()
        self._spans: list[list] = []  # [start, end]; end None while busy
        self.finished: float | None = None  # when the thread had nothing left to do (the run's last batch made)

    @contextlib.contextmanager
    def busy(self):
        span = [time.perf_counter(), None]
        with self._lock:
            self._spans.append(span)
        try:
            yield
        finally:
            span[1] = time.perf_counter()

    def finish(self, at: float | None = None) -> None:
        """The thread has had nothing left to do since `at` (perf_counter; None: now): done, not idle."""
        with self._lock:
            self.finished = time.perf_counter() if at is None else at

    def idle_ratio(self, start: float, end: float) -> float:
        """Idle share of [start, end] up to `finish` (the time it still had work: after it, it is done, not
        idle; a window wholly after it reads 0); spans ending before `start` are dropped (windows move forward)."""
        with self._lock:
            self._spans = [s for s in self._spans if s[1] is None or s[1] > start]
            live = min(end, self.finished) if self.finished is not None else end
            busy = sum(max(0.0, min(live if e is None else e, live) - max(s, start)) for s, e in self._spans)
        return max(0.0, 1.0 - busy / (live - start)) if live > start else 0.0
