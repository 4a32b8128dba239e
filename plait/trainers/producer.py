"""The producer: the one rollout thread of every overlapping mode, over the source of work its mode plugs in.

    loop: wait while paused, syncing or the source has nothing to claim ─▶ claim one call's work ─▶
          Rollout.generate with the current weights (through the rollout client) ─▶ cut short by a pause or
          sync? wait until neither, Rollout.resume from the tokens so far with the new weights ─▶ hand the
          batch (and which rows were cut) back to the source

Sources: fully_async's chunk queue (fully_async.py; claiming nothing more ends the thread) and the V1 modes'
group buffer (sampler.py). The trainer drives the thread: `pause` (colocate_async while it trains: the running
generate is aborted and waited for), `sync()` around a weight push, `close()`. A failed call costs its work
(`source.failed`) until `max_failed_calls` in a row; then the thread ends and hands the error to the source,
whose next wait raises it as a RolloutError chained to the cause. Locks: the source's Condition guards the
source and the flags here; it is never held while generating, and `sync` pushes the weights outside it.
Also here, for every async mode (one_step_off too): RolloutError and BusyClock (a thread's idle share).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch

from plait.errors import RunError
from plait.profiler.timeline import TIMELINE
from plait.types import PromptBatch, RolloutBatch
from plait.workers.rollout import Rollout


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


@dataclass
class Work:
    """One generate call's worth, as a source hands it out and gets it back with its batch."""
    prompts: PromptBatch
    seed: int                      # +1 per resume: distinct from every other call's seeds
    tag: object                    # the source's own (fully_async: the data cursor past the prompts; V1: the groups)
    epoch: int = 0                 # samples.jsonl ids: "<epoch>.<prompt>.<j>", or `ids` when given
    ids: list[str] | None = None


class Producer:
    def __init__(self, name: str, source, client, sampling, version_of, max_failed_calls: int = 1):
        """`source`: cond, wait_span (the timeline's name for the wait for work, or None) and, called holding cond,
        ready(may_generate), claim() -> Work | None (None: no more), finish(work, batch, partial), failed(work, err),
        synced(), ended(error | None); `client`: the RolloutClient; `version_of()`: the trainer's policy version."""
        self.source, self.cond, self.client, self.sampling, self.version_of = source, source.cond, client, sampling, version_of
        self.max_failed_calls = max_failed_calls
        self.paused = self.syncing = self.stop = self.generating = self.holding = False  # guarded by cond
        self.clock = BusyClock()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def pause(self, paused: bool) -> None:
        """Paused, the running generate is aborted and waited for (abort again if one started just after the
        abort: the engine clears a stale abort as a call starts)."""
        with self.cond:
            self.paused = paused
            self.cond.notify_all()
        while paused:
            self.client.abort()
            with self.cond:
                if self.cond.wait_for(lambda: not self.generating, timeout=0.05):
                    return

    @contextlib.contextmanager
    def held(self):
        """Inside, no generate runs: the running one is waited for (not cut), none starts. Around a profiler
        window's start and stop (lifecycle's Trainer.held)."""
        with self.cond:
            self.holding = True
            self.cond.wait_for(lambda: self.stop or not self.generating)
        try:
            yield
        finally:
            with self.cond:
                self.holding = False
                self.cond.notify_all()

    @contextlib.contextmanager
    def sync(self, cut: bool = True):
        """Around a weight push: no call starts; `cut`: the running one is aborted (partial rollout), else the push
        waits for it. After it, unpaused, the source learns of it (`synced`) in the same hold of the lock."""
        with self.cond:
            self.syncing = True
        if cut:
            self.client.abort()
        try:
            yield
        finally:
            with self.cond:
                self.syncing = self.paused = False
                self.source.synced()
                self.cond.notify_all()

    def close(self) -> None:
        """Stop the thread: the running generate is aborted; its work is dropped."""
        with self.cond:
            self.stop = True
            self.cond.notify_all()
        while self.thread.is_alive():
            with contextlib.suppress(Exception):  # the backend may be down after the failure that stops us
                self.client.abort()
            self.thread.join(0.1)

    def _run(self) -> None:
        failed_calls, error = 0, None
        try:
            while (work := self._claim()) is not None:
                try:
                    (batch, partial), failure, failed_calls = self._generate(work), None, 0
                except Exception as err:  # noqa: BLE001 - a failed call costs its work (verl's failure status)
                    batch, partial, failure, failed_calls = None, None, err, failed_calls + 1
                    if self.stop or failed_calls >= self.max_failed_calls:
                        raise
                with self.cond:
                    self.generating = False
                    if failure is not None:
                        self.source.failed(work, failure)
                    elif batch is None:  # stopped meanwhile
                        return
                    else:
                        self.source.finish(work, batch, partial)
                    self.cond.notify_all()
        except BaseException as err:
            error = err
        finally:
            self.clock.finish()  # what follows is the run's end, not a wait on the trainer
            with self.cond:
                self.generating = False
                self.source.ended(error)
                self.cond.notify_all()

    def _claim(self) -> Work | None:
        """The source's next work once it has some and generation may run; None when stopped or it has no more."""
        waiting = self.source.wait_span and TIMELINE.span("rollout", self.source.wait_span, self.version_of())
        with self.cond, waiting or contextlib.nullcontext():
            self.cond.wait_for(lambda: self.stop or self.source.ready(not (self.paused or self.syncing or self.holding)))
            work = None if self.stop else self.source.claim()
            self.generating = work is not None
            return work

    def _generate(self, work: Work) -> tuple[RolloutBatch | None, torch.Tensor | None]:
        """The work's responses, and which rows a pause or sync cut short (finished from their tokens with the new
        weights); (None, None) when stopped meanwhile."""
        seed = work.seed
        batch = self._call(Rollout.generate, work.prompts, self.sampling, seed, epoch=work.epoch, ids=work.ids)
        partial = torch.zeros(len(batch), dtype=torch.bool)  # [batch]
        while "aborted" in batch.stop_reasons:
            with self.cond, TIMELINE.span("rollout", "wait_sync", self.version_of()):
                self.generating = False
                self.cond.notify_all()
                self.cond.wait_for(lambda: self.stop or not (self.paused or self.syncing or self.holding))
                if self.stop:
                    return None, None
                self.generating = True
            partial |= torch.tensor([r == "aborted" for r in batch.stop_reasons])
            seed += 1
            batch = self._call(Rollout.resume, batch, self.sampling, seed)
        return batch, partial

    def _call(self, method, *args, **names) -> RolloutBatch:
        stage = "gen" if method is Rollout.generate else "resume"  # gen: the name its worker's range has (one name)
        with self.clock.busy(), TIMELINE.span("rollout", stage, self.version_of()):
            return self.client.produce(method, *args, **names)
