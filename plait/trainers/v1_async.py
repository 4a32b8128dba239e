"""verl 0.9.1's V1 asynchronous modes (`trainer.v1.trainer_mode`): colocate_async and separate_async.

    main thread (lifecycle step N)                        GroupBuffer                rollouter thread
    issue data.train_batch_size prompts, tagged N ───▶ [pending …]  ◀──────── claim the gen_batch_size
    × updates_per_step local updates:                  [running …]               oldest pending groups,
      gen: sampler.sample(N, batch / updates) ◀─────── [finished …] ◀──────── Rollout.generate with the
           the oldest finished groups; it evicts stale                          current weights (a failed
           or failed ones and issues as many fresh ones                          call: its groups failed)
      learn: reward … update_actor
    update_weights: abort the running generate, push version N ──────────▶ resume the cut rows from their
                                                                            tokens with version N

colocate_async: the rollout shares the trainer's devices, so it generates only while the trainer is not
training: after sampling the rollouter is paused (its running generate aborted, waited for) until
update_weights; one local update per step. separate_async: the rollouter runs throughout, paused only for
the weight load; `parameter_sync_step` local updates of ppo_mini_batch_size groups per step, each with
pi_old the weights synced at the step's start (verl's decoupled PPO: Actor.keep_pi_old).

Before step 1, num_warmup_batches x train_batch_size prompts (whole gen_batch_size chunks) are issued too,
so the buffer runs that far ahead of the trainer; the sampler's threshold bounds how stale a group may be
(plait/trainers/sampler.py). Who blocks whom: the trainer waits in `gen` while fewer groups than it takes
are finished (strategy wait: or while a group at the threshold is in flight); the rollouter waits while
nothing is pending or while paused. The buffer's Condition guards the groups and flags; the rollouter never
holds it while generating; the Rollout worker's lock keeps a weight load from racing a generate.

Checkpoints hold the finished groups whole and the pending / running ones as their prompts: a resumed run
puts the finished back (with their issue steps), issues the others again tagged with its first step
(verl#7037), then tops the warmup up. close() aborts the running generate and joins the thread. The
rollouter is the producer thread (producer.py) over this mode's source, the GroupBuffer. A generate call that
fails marks its groups failed (the sampler replaces them) and says so in one line; after MAX_FAILED_CALLS
in a row the rollouter stops and the trainer's wait raises a RolloutError.
"""

from __future__ import annotations

import math
import os
import time

import torch

from plait.modes import COLOCATE_ASYNC, SEPARATE_ASYNC
from plait.safeload import load_tensors
from plait.trainers.lifecycle import StageTimer, StepResult
from plait.data.dataset import prompt_batch
from plait.trainers.lm import DataCursor, LMTrainer
from plait.trainers.producer import Producer
from plait.trainers.sampler import GroupBuffer, build_sampler, merge_sampler_metrics, take
from plait.types import RolloutBatch
from plait.workers.actor import Actor

MAX_FAILED_CALLS = 3


class V1AsyncTrainer(LMTrainer):
    colocated = False  # ColocateAsyncTrainer: generation pauses while the trainer trains

    def __init__(self, cfg, roles, tokenizer, train_data, val_data, reward_fn, targets, tracker):
        super().__init__(cfg, roles, tokenizer, train_data, val_data, reward_fn, targets, tracker)
        batch, self.mode = cfg.data.train_batch_size, COLOCATE_ASYNC if self.colocated else SEPARATE_ASYNC
        node = getattr(cfg.trainer.v1, self.mode)
        self.updates_per_step = 1 if self.colocated else node.parameter_sync_step
        self.keeps_pi_old = self.updates_per_step > 1 and not self.correction.bypass_mode
        self.per_update, self.chunk = batch // self.updates_per_step, cfg.data.gen_batch_size or batch
        self.warmup = math.floor(node.num_warmup_batches * batch / self.chunk) * self.chunk
        self.batches_per_epoch = self.cursor.batches_per_epoch
        self.cursor = DataCursor(train_data, 1, cfg.data.shuffle, cfg.data.seed)  # issues one prompt group at a time
        self.buffer = GroupBuffer(self.mode, self.chunk, self.sampling.n, self.sample_seed)
        self.sampler = build_sampler(cfg, self.mode, self.buffer, self.issue)
        self.global_steps = 1  # the tag of prompts issued now (verl's refill_fn takes only a count)
        self.rollouter = Producer("plait-v1-rollouter", self.buffer, self.client, self.sampling, lambda: self.version,
                                  MAX_FAILED_CALLS)
        self.cycle_start = 0.0
        self.step_metrics: dict[str, float] = {}  # the sampler's, summed over a step's local updates

    def total_steps(self) -> int:
        return self.cfg.total_steps(self.batches_per_epoch)

    def issue(self, count: int) -> None:
        """`count` fresh prompts from the data as pending groups tagged with the current step (verl's refill_fn)."""
        for _ in range(count):
            self.buffer.add(self.cursor.next(), self.global_steps)

    def start(self) -> None:
        super().start()
        self.global_steps = self.version + 1  # the first step this run trains: verl tags the warmup with it
        self.issue(max(0, self.warmup - len(self.buffer.groups)))  # after a resume, what the checkpoint held counts
        self.cycle_start = time.perf_counter()
        self.rollouter.thread.start()

    # -- the trainer side -----------------------------------------------------------------------

    def train_step(self, step: int, timer: StageTimer) -> StepResult:
        self.global_steps = step
        self.issue(self.cfg.data.train_batch_size)  # verl's prepare_step
        if self.keeps_pi_old:
            self.roles.actor.call(Actor.keep_pi_old)
        result = super().train_step(step, timer)
        result.metrics.pop("perf/mfu/gen", None)  # gen here is the wait for the sampler, not generation
        return result

    def next_batch(self, step: int, timer: StageTimer) -> RolloutBatch:
        """One local update's groups, as the sampler picks them; waits (trainer idle) until they are finished."""
        with timer.stage("gen"):
            self.rollouter.pause(False)
            try:
                groups, metrics = take(self.sampler, self.buffer, step, self.per_update)
            finally:
                if self.colocated:  # it shares the trainer's devices: no generation while training
                    self.rollouter.pause(True)
        self.ledger.counts["stale"] += self.buffer.take_stale_tokens()  # the groups its sampler evicted
        merge_sampler_metrics(self.step_metrics, metrics)
        return RolloutBatch.concat([g.batch for g in groups])

    def after_update(self, step: int, timer: StageTimer) -> dict[str, float]:
        with timer.stage("update_weights"), self.rollouter.sync():
            checked = self.client.push(step)  # waits for the cut generate to return; the weight-sync check
        self.version = step
        start, self.cycle_start = self.cycle_start, time.perf_counter()
        metrics, self.step_metrics = self.step_metrics, {}
        return {**metrics, **checked, "trainer/idle_ratio": timer.times.get("gen", 0.0) / (self.cycle_start - start),
                "rollouter/idle_ratio": self.rollouter.clock.idle_ratio(start, self.cycle_start)}

    def save_checkpoint(self, path: str, step: int) -> None:
        super().save_checkpoint(path, step)  # trainer_state's data cursor is past every prompt issued
        torch.save(self.buffer.snapshot(), os.path.join(path, "groups.pt"))

    def load_checkpoint(self, path: str, step: int) -> None:
        """Finished groups back as they were; pending and running ones issued again, tagged step + 1."""
        super().load_checkpoint(path, step)
        saved = os.path.join(path, "groups.pt")
        self.buffer.groups.clear()
        for g in load_tensors(saved) if os.path.exists(saved) else []:
            prompt, batch = prompt_batch([self.cursor.dataset[g["index"]]]), g["batch"] and RolloutBatch(**g["batch"])
            self.buffer.add(prompt, step + 1 if batch is None else g["issued"], batch)

    def held(self):
        return self.rollouter.held()

    def close(self) -> None:
        """Stop the rollouter; what the buffer holds now is dropped (the last checkpoint has its own copy)."""
        self.rollouter.close()
        super().close()


class ColocateAsyncTrainer(V1AsyncTrainer):
    colocated = True

