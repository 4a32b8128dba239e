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

The rollouter is the producer thread (producer.py) over this mode's source, the ChunkQueue. Locks: the
queue's Condition guards the queue and the counts; the Rollout worker's own lock keeps a
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

from plait.trainers.lifecycle import StageTimer
from plait.trainers.lm import DataCursor, LMTrainer
from plait.trainers.producer import Producer, RolloutError, Work, rollout_error
from plait.types import RolloutBatch

log = logging.getLogger("plait.trainers")


@dataclass
class Chunk:
    """One rollouter generate call's output, as it crosses to the trainer."""
    batch: RolloutBatch       # gen_batch_size prompts x rollout.n responses
    partial: torch.Tensor     # [batch] bool; finished after a weight sync interrupted it
    cursor_state: dict        # the data cursor just past these prompts (what a checkpoint records)


class ChunkQueue:
    """The producer's source in this mode: chunks of prompts from the data, issued while the staleness count
    has room, and the queue of generated chunks the trainer takes from."""
    wait_span = "wait_capacity"  # the rollouter's wait on the queue bound (or a sync)

    def __init__(self, chunk: int, max_samples: int, seed_of):
        self.chunk, self.max_samples, self.seed_of = chunk, max_samples, seed_of
        self.cond = threading.Condition()
        self.queue: deque[Chunk] = deque()
        self.queued = self.in_flight = self.counted = 0  # prompts; counted: issued since the last sync (+ backlog)
        self.backlog = 0  # queued at the last sync (rollouter/queue_depth)
        self.feed: DataCursor | None = None  # the rollouter's copy of the data cursor (set at start)
        self.next = self.end = 0  # the chunks it issues: next, up to end (the run's last)
        self.done, self.error = False, None  # the rollouter's thread ended; what it failed with

    def ready(self, may_generate: bool) -> bool:
        """Claim now: every chunk was issued (the thread ends, done, even while a sync runs), or one fits the bound."""
        return self.next >= self.end or may_generate and self.counted + self.chunk <= self.max_samples

    def claim(self) -> Work | None:
        """The next chunk's prompts (None: every chunk the run trains on was issued)."""
        if self.next >= self.end:
            return None
        work = Work(self.feed.next(), self.seed_of(self.next) * 64, self.feed.state(), epoch=self.feed.epoch)
        self.next, self.counted, self.in_flight = self.next + 1, self.counted + self.chunk, self.in_flight + self.chunk
        return work

    def finish(self, work: Work, batch: RolloutBatch, partial: torch.Tensor) -> None:
        self.in_flight, self.queued = self.in_flight - self.chunk, self.queued + self.chunk
        self.queue.append(Chunk(batch, partial, work.tag))

    def synced(self) -> None:
        self.backlog, self.counted = self.queued, self.queued + self.in_flight

    def ended(self, error: BaseException | None) -> None:
        self.done, self.error = True, error

    def take(self, step: int) -> Chunk:
        """The oldest chunk; waits (trainer idle) while the queue is empty."""
        with self.cond:
            self.cond.wait_for(lambda: self.queue or self.done)
            self.raise_if_failed()
            if not self.queue:
                raise RolloutError(f"fully_async: the rollouter stopped before producing the samples step {step} needs")
            chunk = self.queue.popleft()
            self.queued -= self.chunk
            return chunk

    def raise_if_failed(self) -> None:
        """Call holding cond."""
        if self.error is not None:
            raise rollout_error("fully_async: the rollouter thread failed", self.error) from self.error


class FullyAsyncTrainer(LMTrainer):
    def __init__(self, cfg, roles, tokenizer, train_data, val_data, reward_fn, targets, tracker):
        super().__init__(cfg, roles, tokenizer, train_data, val_data, reward_fn, targets, tracker)
        a, mini = cfg.async_training, cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        self.chunk = a.gen_batch_size
        self.per_update = mini * a.require_batches                   # verl's required_samples
        self.updates_per_step = a.trigger_parameter_sync_step
        self.partial_rollout = a.partial_rollout
        # The trainer's cursor moves as chunks are consumed, so checkpoints hold only consumed
        # prompts; the rollouter draws from its own copy (`feed`).
        self.cursor = DataCursor(train_data, self.chunk, cfg.data.shuffle, cfg.data.seed)
        self.chunks = ChunkQueue(self.chunk, int(self.per_update * (a.staleness_threshold + 1) * a.trigger_parameter_sync_step),
                                 self.sample_seed)
        self.rollouter = Producer("plait-rollouter", self.chunks, self.client, self.sampling, lambda: self.version)
        self.cycle_start = 0.0
        self.consumed_partial: list[torch.Tensor] = []  # this sync cycle's partial flags

    def total_steps(self) -> int:
        t, per_step = self.cfg.trainer, self.per_update * self.updates_per_step
        return t.total_training_steps or t.total_epochs * self.cursor.batches_per_epoch * self.chunk // per_step

    def start(self) -> None:
        super().start()
        feed = DataCursor(self.cursor.dataset, self.chunk, self.cursor.shuffle, self.cursor.seed)
        feed.load_state(self.cursor.state())  # after a resume: the first prompt not yet trained on
        per_step = self.per_update * self.updates_per_step // self.chunk  # chunks
        self.chunks.feed, self.chunks.next, self.chunks.end = feed, self.version * per_step, self.total_steps() * per_step
        self.cycle_start = time.perf_counter()
        self.rollouter.thread.start()

    def next_batch(self, step: int, timer: StageTimer) -> RolloutBatch:
        """One local update's prompts, oldest first; waits (trainer idle) while the queue is short."""
        with timer.stage("wait_rollout"):
            chunks = [self.chunks.take(step) for _ in range(self.per_update // self.chunk)]
        self.cursor.load_state(chunks[-1].cursor_state)
        self.consumed_partial += [c.partial for c in chunks]
        return RolloutBatch.concat([c.batch for c in chunks])

    def after_update(self, step: int, timer: StageTimer) -> dict[str, float]:
        # the check too while the rollouter waits: its probe never queues behind a generate
        with timer.stage("param_sync"), self.rollouter.sync(cut=self.partial_rollout):
            checked = self.client.push(step)  # waits for a running generate
        self.version = step
        with self.chunks.cond:
            self.chunks.raise_if_failed()
        start, self.cycle_start = self.cycle_start, time.perf_counter()
        partial = torch.cat(self.consumed_partial).float()
        self.consumed_partial = []
        return {"trainer/idle_ratio": timer.times.get("wait_rollout", 0.0) / (self.cycle_start - start),
                "rollouter/idle_ratio": self.rollouter.clock.idle_ratio(start, self.cycle_start),
                "rollouter/queue_depth": self.chunks.backlog, "fully_async/partial/partial_ratio": partial.mean().item(),
                **checked}

    def held(self):
        return self.rollouter.held()

    def close(self) -> None:
        """Stop the rollouter; whatever is queued or in flight now is discarded (see the module docstring)."""
        self.rollouter.close()
        discarded = self.chunks.queued + self.chunks.in_flight
        if discarded:
            log.info("fully_async: discarded %d prompts queued or in flight at stop", discarded)
        super().close()
