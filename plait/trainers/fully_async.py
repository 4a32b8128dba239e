"""Fully asynchronous training: a streaming rollouter fills a bounded queue while the trainer learns.

    rollouter thread                                   queue of chunks       main thread (trainer, step N)
    ┌▶ claim gen_batch_size prompts                                          ┌▶ take require_batches x ppo_mini_batch_size
    │    waits while a sync is under way, or while                           │    prompts (waits while the queue is short:
    │    queued + in flight (counted since the last                          │    trainer idle)
    │    sync) + the chunk > max_samples: rollouter idle                     │  learn: reward … update_actor (one local update)
    │  Rollout.generate with the current weights                             └─ × trigger_parameter_sync_step
    │  cut short by a sync (partial_rollout)?                                param_sync: abort the rollout, push the actor's
    │    wait for the sync, Rollout.resume from the                            weights = version N (waits for the rollout's
    │    tokens so far with the new weights                                    running call to return), reset the count to
    └─ append the chunk ─────────────────▶ [c][c][c] ──────────────────▶      queued + in flight, wake the rollouter

    max_samples = ppo_mini_batch_size x require_batches x (staleness_threshold + 1) x trigger_parameter_sync_step

This is verl's rule (its rollouter's staleness_samples, reset at each sync to queued + running, paused at
max_required_samples): with staleness_threshold=1 the rollouter is one sync period ahead, so right after
a sync it generates the batch of the step after next and then, if it is faster than the trainer, waits
in wait_capacity (the trainer is the bottleneck; generating more would break the staleness bound). Its
generation overlaps update_actor when it outlasts the stages before the update (reward, old_log_prob).

One lifecycle step is one policy version: `trigger_parameter_sync_step` local updates, then a
sync. Samples are counted in prompts (each carries rollout.n responses), as verl counts them. The
count bounds staleness: a sample is at most ceil(staleness_threshold) versions behind the trainer
that consumes it (`training/staleness/max`). A sample finished after a sync by `Rollout.resume`
takes the version that finished it and is counted as partial. Off-policy correction: truncated
importance weights between the actor's recomputed old log-probs and the rollout's
(`algorithm.rollout_correction`, token level by default); unlike verl, pi_old is the actor before
each local update rather than a saved copy of the synced weights.

Stopping. The rollouter issues exactly the prompts the remaining steps consume, so a run that ends
normally has nothing queued or in flight: the thread ends by itself and `close()` joins it. A run
that ends early (an error, Ctrl-C) sets `stop`, aborts the running generate and joins; queued and
in-flight chunks are discarded on purpose (a checkpoint holds only what the trainer consumed, so a
resume generates them again). A rollouter exception is raised on the driver as a RolloutError at
the trainer's next take or sync, chained to its cause.

Locks: one Condition guards the queue and the counts; the Rollout worker's own lock keeps a
weight load from racing a generate. The rollouter never holds the Condition while generating,
and the trainer never holds it while learning or syncing, so neither can deadlock the other.
On the local backend the rollouter thread runs the decode itself; on Ray it waits on the
separated rollout process, whose `abort` runs out of band (a control thread beside the one that
runs calls), so a sync cuts the running chunk short there too.
Timeline (timeline.jsonl): the rollouter's generate/resume calls (spans `gen`, `resume`) and its waits (wait_capacity: the
queue bound; wait_sync: a sync under way) are spans of role "rollout" with the version it holds.
Profiling: the rollouter's `gen` stages fall into the trainer step's window and are recorded with
its policy version, N-1 for step N, the version the rollout generates with during step N.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch

from plait.profiler.timeline import TIMELINE
from plait.trainers.async_common import BusyClock, RolloutError, rollout_error
from plait.trainers.lifecycle import StageTimer
from plait.trainers.lm import DataCursor, LMTrainer, call_quietly
from plait.types import RolloutBatch
from plait.workers.rollout import Rollout

log = logging.getLogger("plait.trainers")


@dataclass
class Chunk:
    """One rollouter generate call's output, as it crosses to the trainer."""
    batch: RolloutBatch       # prompts x rollout.n responses
    prompts: int
    partial: torch.Tensor     # [batch] bool; finished after a weight sync interrupted it
    cursor_state: dict        # the data cursor just past these prompts (what a checkpoint records)


class FullyAsyncTrainer(LMTrainer):
    def __init__(self, cfg, roles, tokenizer, train_data, val_data, reward_fn, targets, tracker):
        super().__init__(cfg, roles, tokenizer, train_data, val_data, reward_fn, targets, tracker)
        a, mini = cfg.async_training, cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        self.chunk = a.gen_batch_size
        self.per_update = mini * a.require_batches                   # verl's required_samples
        self.updates_per_step = a.trigger_parameter_sync_step
        self.max_samples = int(self.per_update * (a.staleness_threshold + 1) * a.trigger_parameter_sync_step)
        self.partial_rollout = a.partial_rollout
        # The trainer's cursor moves as chunks are consumed, so checkpoints hold only consumed
        # prompts; the rollouter draws from its own copy (`feed`).
        self.cursor = DataCursor(train_data, self.chunk, cfg.data.shuffle, cfg.data.seed)
        self.cond = threading.Condition()
        self.queue: deque[Chunk] = deque()
        self.queued = self.in_flight = self.counted = 0  # prompts; counted: issued since the last sync (+ backlog)
        self.syncing = self.stop = self.finished = False
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.gen_clock = BusyClock()
        self.cycle_start = 0.0
        self.consumed_partial: list[torch.Tensor] = []  # this sync cycle's partial flags

    def total_steps(self) -> int:
        t, per_step = self.cfg.trainer, self.per_update * self.updates_per_step
        return t.total_training_steps or t.total_epochs * self.cursor.batches_per_epoch * self.chunk // per_step

    # -- the rollouter thread -------------------------------------------------------------------

    def start(self) -> None:
        super().start()
        feed = DataCursor(self.cursor.dataset, self.chunk, self.cursor.shuffle, self.cursor.seed)
        feed.load_state(self.cursor.state())  # after a resume: the first prompt not yet trained on
        per_step = self.per_update * self.updates_per_step // self.chunk  # chunks
        first, last = self.version * per_step, self.total_steps() * per_step
        self.thread = threading.Thread(target=self._rollouter, args=(feed, range(first, last)),
                                       name="plait-rollouter", daemon=True)
        self.cycle_start = time.perf_counter()
        self.thread.start()

    def _rollouter(self, feed: DataCursor, chunks: range) -> None:
        try:
            for i in chunks:
                with self.cond, TIMELINE.span("rollout", "wait_capacity", self.version):
                    self.cond.wait_for(lambda: self.stop or (not self.syncing and self.counted + self.chunk <= self.max_samples))
                    if self.stop:
                        return
                    prompts, state = feed.next(), feed.state()
                    self.counted += self.chunk
                    self.in_flight += self.chunk
                seed = self.sample_seed(i) * 64  # +1 per resume: distinct from every other chunk's seeds
                batch = self._call(Rollout.generate, prompts, self.sampling, seed, epoch=feed.epoch)
                partial = torch.zeros(len(batch), dtype=torch.bool)
                while "aborted" in batch.stop_reasons:  # a sync cut it short: finish with the new weights
                    with self.cond, TIMELINE.span("rollout", "wait_sync", self.version):
                        self.cond.wait_for(lambda: self.stop or not self.syncing)
                        if self.stop:
                            return
                    partial |= torch.tensor([r == "aborted" for r in batch.stop_reasons])
                    seed += 1
                    batch = self._call(Rollout.resume, batch, self.sampling, seed)
                with self.cond:
                    self.in_flight -= self.chunk
                    self.queued += self.chunk
                    self.queue.append(Chunk(batch, self.chunk, partial, state))
                    self.cond.notify_all()
        except BaseException as err:
            with self.cond:
                self.error = err
        finally:
            self.gen_clock.finish()  # what follows is the run's end, not a wait on the trainer
            with self.cond:
                self.finished = True
                self.cond.notify_all()

    def _call(self, method, *args, epoch: int = 0) -> RolloutBatch:
        stage = "gen" if method is Rollout.generate else "resume"  # gen: the name its worker's range has
        with self.gen_clock.busy(), TIMELINE.span("rollout", stage, self.version):
            return self.client.produce(method, *args, epoch=epoch)

    # -- the trainer side -----------------------------------------------------------------------

    def next_batch(self, step: int, timer: StageTimer) -> RolloutBatch:
        """One local update's prompts, oldest first; waits (trainer idle) while the queue is short."""
        chunks = []
        with timer.stage("wait_rollout"):
            for _ in range(self.per_update // self.chunk):
                with self.cond:
                    self.cond.wait_for(lambda: self.queue or self.finished)
                    self._raise_if_failed()
                    if not self.queue:
                        raise RolloutError("fully_async: the rollouter stopped before producing the samples "
                                           f"step {step} needs")
                    chunk = self.queue.popleft()
                    self.queued -= chunk.prompts
                chunks.append(chunk)
        self.cursor.load_state(chunks[-1].cursor_state)
        self.consumed_partial += [c.partial for c in chunks]
        return RolloutBatch.concat([c.batch for c in chunks])

    def after_update(self, step: int, timer: StageTimer) -> dict[str, float]:
        with timer.stage("param_sync"):
            with self.cond:
                self.syncing = True
            if self.partial_rollout:
                self.client.abort()
            try:  # the check too while the rollouter waits: its probe never queues behind a generate
                checked = self.client.push(step)  # waits for a running generate
            finally:
                with self.cond:
                    self.syncing = False
                    backlog = self.queued
                    self.counted = self.queued + self.in_flight
                    self.cond.notify_all()
        self.version = step
        with self.cond:
            self._raise_if_failed()
        start, self.cycle_start = self.cycle_start, time.perf_counter()
        partial = torch.cat(self.consumed_partial).float()
        self.consumed_partial = []
        return {"trainer/idle_ratio": timer.times.get("wait_rollout", 0.0) / (self.cycle_start - start),
                "rollouter/idle_ratio": self.gen_clock.idle_ratio(start, self.cycle_start),
                "rollouter/queue_depth": backlog, "fully_async/partial/partial_ratio": partial.mean().item(), **checked}

    def _raise_if_failed(self) -> None:
        """Call holding self.cond."""
        if self.error is not None:
            err = self.error
            raise rollout_error("fully_async: the rollouter thread failed", err) from err

    def close(self) -> None:
        """Stop the rollouter; whatever is queued or in flight now is discarded (see the module docstring)."""
        if self.thread is None:
            return
        with self.cond:
            self.stop = True
            discarded = self.queued + self.in_flight
            self.cond.notify_all()
        if self.thread.is_alive():
            call_quietly(self.roles.rollout, Rollout.abort)
        self.thread.join()
        self.thread = None
        if discarded:
            log.info("fully_async: discarded %d prompts queued or in flight at stop", discarded)
        super().close()
