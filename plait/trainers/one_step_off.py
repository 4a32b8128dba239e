"""One-step-off-policy training: the rollout generates batch n+1 while the actor trains on batch n.

    main thread (lifecycle step n, trainer)            generation thread (one call at a time)
    next_batch:   take batch n (step 1: generate it now)
                  submit gen(n+1) ───────────────────▶ Rollout.generate with version n-1
    learn(n):     reward … update_actor                  (runs on the rollout's own model copy,
                  (batch n was made with version n-2)     or its own Ray process)
    after_update: wait for gen(n+1) ◀─────────────────  done
                  param_sync: actor weights → rollout = version n

Who blocks whom: the trainer blocks in `wait_rollout` when generating is slower than learning
(trainer idle); the generation thread sits idle when learning is slower (its `wait_trainer` spans). Weights change only in
param_sync, after gen(n+1) has returned, so a load never races a generate (and the Rollout
worker's lock would make it wait if it did). Every sample is exactly one version behind the
trainer that consumes it, except at step 1 and at the first step after a resume without a saved
batch, which generate on-policy. The rollout's log-probs correct for that: truncated importance
weights min(pi_old / pi_rollout, C) multiply the PPO loss, pi_old being the actor's recomputed
log-prob before the update (`algorithm.rollout_correction`, token level by default).

On the local backend the generation thread runs the decode itself (torch releases the GIL in its
kernels, Python overhead does not); on Ray it only waits on the separated rollout process. The
next batch, already generated when a checkpoint is written, is saved with it, so a resumed run
continues exactly one step off. Profiling: the rollout's `gen` stage runs inside the trainer
step's window (same process, same wall clock) and is recorded with the window's policy version,
which is n-1 for step n, the version the rollout generates with during step n.
"""

from __future__ import annotations

import contextlib
import os
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from plait.profiler.samples import now
from plait.profiler.timeline import TIMELINE
from plait.safeload import load_tensors
from plait.trainers.producer import BusyClock, rollout_error
from plait.trainers.lifecycle import StageTimer
from plait.trainers.lm import LMTrainer
from plait.types import PromptBatch, RolloutBatch
from plait.workers.rollout import Rollout


class OneStepOffTrainer(LMTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pool: ThreadPoolExecutor | None = None  # the generation thread, between start() and close()
        self.pending: Future | None = None           # gen(n+1) while batch n trains
        self.ready: RolloutBatch | None = None       # gen(n+1) once done, until next_batch takes it
        self.gen_clock = BusyClock()
        self.cycle_start = 0.0                       # wall time of the last param_sync's end
        self.gen_free_since = 0.0                    # when the generation thread last became idle

    def start(self) -> None:
        super().start()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="plait-one-step-off-gen")
        self.cycle_start = self.gen_free_since = time.perf_counter()

    def next_batch(self, step: int, timer: StageTimer) -> RolloutBatch:
        batch, self.ready = self.ready, None
        if batch is None and self.pending is not None:  # asked again within a step (filter_groups): the one in flight
            with timer.stage("gen"):
                batch, self.pending = self.pending.result(), None
        if batch is None:  # step 1 (or a resume without a saved batch): nothing was generated ahead
            with timer.stage("gen"):
                batch = self._generate(self.cursor.next(), self.sample_seed(step), self.cursor.epoch)
        if step < self.total_steps():
            self.pending = self.pool.submit(self._generate_ahead, self.cursor.next(), self.sample_seed(step + 1),
                                            self.cursor.epoch, now())
        else:  # the last batch was made: the generation thread has been done since, not waiting on the trainer
            self.gen_clock.finish(self.gen_free_since)
        return batch

    def _generate(self, prompts: PromptBatch, seed: int, epoch: int, submitted: float | None = None) -> RolloutBatch:
        with self.gen_clock.busy():
            return self.client.produce(Rollout.generate, prompts, self.sampling, seed, epoch=epoch, submitted=submitted)

    def _generate_ahead(self, prompts: PromptBatch, seed: int, epoch: int, submitted: float) -> RolloutBatch:
        """On the generation thread: the next step's batch, a `gen` span on its own lane."""
        self._waited_for_trainer()
        try:
            with TIMELINE.span("rollout", "gen", self.version):
                return self._generate(prompts, seed, epoch, submitted)
        finally:
            self.gen_free_since = time.perf_counter()

    def _waited_for_trainer(self) -> None:
        """On the generation thread: its idle time since the last generate (or start) is a
        `wait_trainer` span: nothing was submitted, the trainer was still learning (until the run's last batch
        was made: after that the thread is done, the timeline's `finished`)."""
        end = self.gen_clock.finished or time.perf_counter()
        if end > self.gen_free_since:
            TIMELINE.add("rollout", "wait_trainer", self.gen_free_since, end, self.version)

    @contextlib.contextmanager
    def held(self):
        """The batch in flight made first (generation starts only from this, the main, thread)."""
        if self.pending is not None:
            futures.wait([self.pending])
        yield

    def after_update(self, step: int, timer: StageTimer) -> dict[str, float]:
        if self.pending is not None:
            with timer.stage("wait_rollout"):
                pending, self.pending = self.pending, None
                try:
                    self.ready = pending.result()
                except Exception as err:
                    raise rollout_error(f"one_step_off: generating the batch for step {step + 1} failed in the "
                                        "generation thread", err) from err
        with timer.stage("param_sync"):
            checked = self.client.push(step)
        self.version = step
        start, self.cycle_start = self.cycle_start, time.perf_counter()
        wall = self.cycle_start - start
        waited = timer.times.get("gen", 0.0) + timer.times.get("wait_rollout", 0.0)
        return {"trainer/idle_ratio": waited / wall, "rollouter/idle_ratio": self.gen_clock.idle_ratio(start, self.cycle_start),
                **checked}

    def save_checkpoint(self, path: str, step: int) -> None:
        super().save_checkpoint(path, step)
        if self.ready is not None:  # its prompts are already past the saved data cursor
            torch.save(vars(self.ready), os.path.join(path, "next_batch.pt"))

    def load_checkpoint(self, path: str, step: int) -> None:
        super().load_checkpoint(path, step)
        saved = os.path.join(path, "next_batch.pt")
        self.ready = RolloutBatch(**load_tensors(saved)) if os.path.exists(saved) else None

    def close(self) -> None:
        """Stop the generation thread; a generation still running (the step raised) is aborted and discarded."""
        if self.pool is None:
            return
        if self.pending is not None and not self.pending.done():
            with contextlib.suppress(Exception):  # the backend may be down after the failure that stops us
                self.client.abort()
        self.pool.submit(self._waited_for_trainer)  # its idle tail, on its own thread's lane
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.pool, self.pending = None, None
        super().close()
