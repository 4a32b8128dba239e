"""The V1 async modes' rollouter: a thread that generates a GroupBuffer's pending groups, oldest first.

    loop: wait while paused, syncing or nothing is pending ─▶ claim gen_batch_size pending groups (running)
          ─▶ Rollout.generate with the current weights ─▶ cut short (aborted rows)? wait until neither paused
          nor syncing, Rollout.resume from the tokens so far with the new weights ─▶ finished (or failure)

The trainer drives it: `pause(True)` (colocate_async while it trains: the running generate is aborted and
waited for), `pause(False)`, `syncing` around a weight load, `close()`. A failed generate call marks its
groups failed (the sampler replaces them) in one log line; MAX_FAILED_CALLS in a row stop the thread, and
the trainer's next wait on the buffer raises a RolloutError chained to the cause. The buffer's Condition
guards the flags too; it is never held while generating.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from plait.profiler.timeline import TIMELINE
from plait.trainers.async_common import BusyClock, RolloutError
from plait.trainers.sampler import Group, GroupBuffer
from plait.types import PromptBatch, RolloutBatch
from plait.workers.rollout import Rollout

log = logging.getLogger("plait.trainers")
MAX_FAILED_CALLS = 3


class GroupRollouter:
    def __init__(self, mode: str, buffer: GroupBuffer, abort, sampling, chunk: int, seed_of, version_of, rollout_call):
        """`abort()`: cut the rollout's running generate short (RolloutClient.abort); `seed_of(uid)`: a sampling seed;
        `version_of()`: the trainer's policy version (for the timeline); `rollout_call(method, *args, ids=...)`: a
        generating call on the rollout that records its samples' spans and restarts a dead engine
        (RolloutClient.produce)."""
        self.mode, self.buffer, self.abort, self.sampling, self.chunk = mode, buffer, abort, sampling, chunk
        self.rollout_call = rollout_call
        self.seed_of, self.version_of = seed_of, version_of
        self.paused = self.syncing = self.stop = self.generating = False  # guarded by buffer.cond
        self.clock = BusyClock()
        self.thread = threading.Thread(target=self._run, name="plait-v1-rollouter", daemon=True)

    def pause(self, paused: bool) -> None:
        """Paused, the running generate is aborted and waited for (abort again if one started just after the
        abort: the engine clears a stale abort as a call starts)."""
        with self.buffer.cond:
            self.paused = paused
            self.buffer.cond.notify_all()
        while paused:
            self.abort()
            with self.buffer.cond:
                if self.buffer.cond.wait_for(lambda: not self.generating, timeout=0.05):
                    return

    @contextlib.contextmanager
    def sync(self):
        """Around a weight load: the running generate is cut (partial rollout) and resumes after it, unpaused."""
        with self.buffer.cond:
            self.syncing = True
        self.abort()
        try:
            yield
        finally:
            with self.buffer.cond:
                self.syncing = self.paused = False
                self.buffer.cond.notify_all()

    def close(self) -> None:
        with self.buffer.cond:
            self.stop = True
            self.buffer.cond.notify_all()
        while self.thread.is_alive():
            with contextlib.suppress(Exception):  # the backend may be down after the failure that stops us
                self.abort()
            self.thread.join(0.1)

    @property
    def may_generate(self) -> bool:
        return not (self.paused or self.syncing)

    def _run(self) -> None:
        failed_calls, error = 0, None
        try:
            while True:
                with self.buffer.cond:
                    self.buffer.cond.wait_for(lambda: self.stop or (self.may_generate and self.buffer.with_status("pending")))
                    if self.stop:
                        return
                    groups, self.generating = self.buffer.claim(self.chunk), True
                try:
                    batch, failed_calls = self._generate(groups), 0
                except Exception as err:  # noqa: BLE001 - a failed call costs its groups (verl's failure status)
                    failed_calls, batch = failed_calls + 1, None
                    if self.stop or failed_calls >= MAX_FAILED_CALLS:
                        raise
                    log.warning("plait: %s: generating %d prompt groups failed (%s: %s); the sampler replaces them",
                                self.mode, len(groups), type(err).__name__, err)
                with self.buffer.cond:
                    self.generating = False
                    if batch is None and self.stop:
                        return
                    self.buffer.finish(groups, batch, self.sampling.n)
        except BaseException as err:
            error = err
        finally:
            with self.buffer.cond:
                self.generating = False
                self.buffer.error = error or (None if self.stop else RolloutError("the rollouter stopped"))
                self.buffer.cond.notify_all()

    def _generate(self, groups: list[Group]) -> RolloutBatch | None:
        """The groups' responses; cut short by a pause or sync, finished from their tokens with the new
        weights. None when stopped meanwhile."""
        seed = self.seed_of(groups[0].uid) * 64
        ids = [f"g{g.uid}.{j}" for g in groups for j in range(self.sampling.n)]  # samples.jsonl: uids are unique in a run
        batch = self._call(Rollout.generate, PromptBatch.concat([g.prompt for g in groups]), self.sampling, seed, ids=ids)
        while "aborted" in batch.stop_reasons:
            with self.buffer.cond, TIMELINE.span("rollout", "wait_sync", self.version_of()):
                self.generating = False
                self.buffer.cond.notify_all()
                self.buffer.cond.wait_for(lambda: self.stop or self.may_generate)
                if self.stop:
                    return None
                self.generating = True
            seed += 1
            batch = self._call(Rollout.resume, batch, self.sampling, seed)
        return batch

    def _call(self, method, *args, **ids) -> RolloutBatch:
        stage = "gen" if method is Rollout.generate else "resume"  # gen: the name its worker's range has (one name)
        with self.clock.busy(), TIMELINE.span("rollout", stage, self.version_of()):
            return self.rollout_call(method, *args, **ids)
