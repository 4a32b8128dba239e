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
(verl#7037), then tops the warmup up. close() aborts the running generate and joins the thread. A generate
call that fails marks its groups failed (the sampler replaces them) and says so in one line; after
MAX_FAILED_CALLS in a row the rollouter stops and the trainer's wait raises a RolloutError.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time

import torch

from plait.errors import RunError
from plait.profiler.timeline import TIMELINE
from plait.safeload import load_tensors
from plait.trainers.async_common import BusyClock, RolloutError
from plait.trainers.lifecycle import StageTimer, StepResult
from plait.trainers.lm import DataCursor, LMTrainer, call_quietly, prompt_batch
from plait.trainers.sampler import Group, GroupBuffer, build_sampler, merge_sampler_metrics
from plait.types import PromptBatch, RolloutBatch
from plait.workers.actor import Actor
from plait.workers.rollout import Rollout
from plait.workers.weight_sync import sync_weights

log = logging.getLogger("plait.trainers")
MAX_FAILED_CALLS = 3


class V1AsyncTrainer(LMTrainer):
    colocated = False  # ColocateAsyncTrainer: generation pauses while the trainer trains

    def __init__(self, cfg, roles, tokenizer, train_data, val_data, reward_fn, targets, tracker):
        super().__init__(cfg, roles, tokenizer, train_data, val_data, reward_fn, targets, tracker)
        batch, self.mode = cfg.data.train_batch_size, "colocate_async" if self.colocated else "separate_async"
        node = getattr(cfg.trainer.v1, self.mode)
        self.updates_per_step = 1 if self.colocated else node.parameter_sync_step
        self.keeps_pi_old = self.updates_per_step > 1 and not self.correction.bypass_mode
        self.per_update, self.chunk = batch // self.updates_per_step, cfg.data.gen_batch_size or batch
        self.warmup = math.floor(node.num_warmup_batches * batch / self.chunk) * self.chunk
        self.batches_per_epoch = self.cursor.batches_per_epoch
        self.cursor = DataCursor(train_data, 1, cfg.data.shuffle, cfg.data.seed)  # issues one prompt group at a time
        self.buffer = GroupBuffer()
        self.sampler = build_sampler(cfg, self.mode, self.buffer, self.issue)
        self.global_steps = 1  # the tag of prompts issued now (verl's refill_fn takes only a count)
        self.next_uid = 0
        self.paused = self.syncing = self.stop = self.generating = False  # guarded by buffer.cond
        self.thread: threading.Thread | None = None
        self.gen_clock, self.cycle_start = BusyClock(), 0.0
        self.step_metrics: dict[str, float] = {}  # the sampler's, summed over a step's local updates

    def total_steps(self) -> int:
        return self.cfg.total_steps(self.batches_per_epoch)

    def issue(self, count: int) -> None:
        """`count` fresh prompts from the data as pending groups tagged with the current step (verl's refill_fn)."""
        with self.buffer.cond:
            for _ in range(count):
                self._add(Group(self.next_uid, self.cursor.next(), self.global_steps))
            self.buffer.cond.notify_all()

    def _add(self, group: Group) -> None:
        group.uid, self.next_uid = self.next_uid, self.next_uid + 1
        self.buffer.groups[group.uid] = group

    def start(self) -> None:
        super().start()
        self.global_steps = self.version + 1  # the first step this run trains: verl tags the warmup with it
        self.issue(max(0, self.warmup - len(self.buffer.groups)))  # after a resume, what the checkpoint held counts
        self.thread = threading.Thread(target=self._rollouter, name="plait-v1-rollouter", daemon=True)
        self.cycle_start = time.perf_counter()
        self.thread.start()

    # -- the rollouter thread -------------------------------------------------------------------

    def _rollouter(self) -> None:
        failed_calls = 0
        try:
            while True:
                with self.buffer.cond:
                    self.buffer.cond.wait_for(lambda: self.stop or (self._may_generate() and self.buffer.with_status("pending")))
                    if self.stop:
                        return
                    groups = [self.buffer.groups[u] for u in self.buffer.with_status("pending")[:self.chunk]]
                    for g in groups:
                        g.status = "running"
                    self.generating = True
                try:
                    batch, failed_calls = self._generate(groups), 0
                except Exception as err:  # noqa: BLE001 - a failed call costs its groups (verl's failure status)
                    failed_calls += 1
                    if self.stop or failed_calls >= MAX_FAILED_CALLS:
                        raise
                    batch = None
                    log.warning("plait: %s: generating %d prompt groups failed (%s: %s); the sampler replaces them",
                                self.mode, len(groups), type(err).__name__, err)
                with self.buffer.cond:
                    self.generating = False
                    if batch is None and self.stop:
                        return
                    n = self.sampling.n
                    for i, g in enumerate(groups):
                        g.status, g.batch = ("failure", None) if batch is None else ("finished", batch.select(slice(i * n, i * n + n)))
                    self.buffer.cond.notify_all()
        except BaseException as err:
            with self.buffer.cond:
                self.buffer.error = err
        finally:
            with self.buffer.cond:
                self.generating = False
                self.buffer.error = self.buffer.error or (None if self.stop else RolloutError("the rollouter stopped"))
                self.buffer.cond.notify_all()

    def _may_generate(self) -> bool:
        return not (self.paused or self.syncing)

    def _generate(self, groups: list[Group]) -> RolloutBatch | None:
        """The groups' responses; cut short by a pause or sync (partial rollout), finished from their tokens
        with the new weights. None when stopped meanwhile."""
        seed = self.sample_seed(groups[0].uid) * 64
        batch = self._call(Rollout.generate, join_prompts([g.prompt for g in groups]), self.sampling, seed)
        while "aborted" in batch.stop_reasons:
            with self.buffer.cond, TIMELINE.span("rollout", "wait_sync", self.version):
                self.generating = False
                self.buffer.cond.notify_all()
                self.buffer.cond.wait_for(lambda: self.stop or self._may_generate())
                if self.stop:
                    return None
                self.generating = True
            seed += 1
            batch = self._call(Rollout.resume, batch, self.sampling, seed)
        uids = torch.tensor([g.uid for g in groups]).repeat_interleave(self.sampling.n)  # [batch] unique across epochs
        return batch.replace(group_ids=uids)

    def _call(self, method, *args) -> RolloutBatch:
        with self.gen_clock.busy(), TIMELINE.span("rollout", method.__name__, self.version):
            return self.roles.rollout.call(method, *args)

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
            self._pause(False)
            try:
                uids, metrics = self.sampler.sample(step, "train", self.per_update)
            except RolloutError:
                raise
            except Exception as err:  # noqa: BLE001 - a user sampler's failure: one line
                raise RunError(f"trainer.v1.sampler: {type(self.sampler).__name__}.sample raised "
                               f"{type(err).__name__}: {err}") from err
            finally:
                if self.colocated:
                    self._pause(True)
        merge_sampler_metrics(self.step_metrics, metrics)
        groups = self.buffer.remove(uids)
        if any(g.status != "finished" for g in groups):
            raise RunError(f"trainer.v1.sampler: {type(self.sampler).__name__}.sample took groups that are not finished")
        return RolloutBatch.concat([g.batch for g in groups])

    def _pause(self, paused: bool) -> None:
        """colocate_async's switch: paused, the running generate is aborted and waited for."""
        with self.buffer.cond:
            self.paused = paused
            self.buffer.cond.notify_all()
        while paused:  # abort again if a generate started just after the abort (the engine clears it at start)
            self.roles.rollout.call(Rollout.abort)
            with self.buffer.cond:
                if self.buffer.cond.wait_for(lambda: not self.generating, timeout=0.05):
                    return

    def after_update(self, step: int, timer: StageTimer) -> dict[str, float]:
        with timer.stage("update_weights"):
            with self.buffer.cond:
                self.syncing = True
            self.roles.rollout.call(Rollout.abort)  # partial rollout: the running generate resumes after the load
            try:
                sync_weights(self.roles.actor, self.roles.rollout, step)  # waits for a running generate to return
            finally:
                with self.buffer.cond:
                    self.syncing = self.paused = False
                    self.buffer.cond.notify_all()
        self.version = step
        start, self.cycle_start = self.cycle_start, time.perf_counter()
        metrics, self.step_metrics = self.step_metrics, {}
        return {**metrics, "trainer/idle_ratio": timer.times.get("gen", 0.0) / (self.cycle_start - start),
                "rollouter/idle_ratio": self.gen_clock.idle_ratio(start, self.cycle_start)}

    def save_checkpoint(self, path: str, step: int) -> None:
        super().save_checkpoint(path, step)  # trainer_state's data cursor is past every prompt issued
        with self.buffer.cond:
            groups = [{"index": g.prompt.indices[0], "issued": g.issued,
                       "batch": vars(g.batch) if g.status == "finished" else None}
                      for g in self.buffer.groups.values() if g.status != "failure"]
        torch.save(groups, os.path.join(path, "groups.pt"))

    def load_checkpoint(self, path: str, step: int) -> None:
        """Finished groups back as they were; pending and running ones issued again, tagged step + 1."""
        super().load_checkpoint(path, step)
        saved = os.path.join(path, "groups.pt")
        self.buffer.groups.clear()
        for g in load_tensors(saved) if os.path.exists(saved) else []:
            batch = None if g["batch"] is None else RolloutBatch(**g["batch"])
            group = Group(0, prompt_batch([self.cursor.dataset[g["index"]]]), step + 1 if batch is None else g["issued"])
            self._add(group)
            if batch is not None:
                group.status, group.batch = "finished", batch.replace(group_ids=torch.full_like(batch.group_ids, group.uid))

    def close(self) -> None:
        """Stop the rollouter; what the buffer holds now is dropped (the last checkpoint has its own copy)."""
        if self.thread is not None:
            with self.buffer.cond:
                self.stop = True
                self.buffer.cond.notify_all()
            while self.thread.is_alive():
                call_quietly(self.roles.rollout, Rollout.abort)
                self.thread.join(0.1)
            self.thread = None
        super().close()


class ColocateAsyncTrainer(V1AsyncTrainer):
    colocated = True


def join_prompts(parts: list[PromptBatch]) -> PromptBatch:
    """One-prompt batches as one batch, in order."""
    media = [m for p in parts for m in (p.multi_modal or [{}] * len(p))]
    return PromptBatch(prompt_ids=[x for p in parts for x in p.prompt_ids],
                       data_sources=[x for p in parts for x in p.data_sources],
                       ground_truths=[x for p in parts for x in p.ground_truths],
                       extra_infos=[x for p in parts for x in p.extra_infos], indices=[x for p in parts for x in p.indices],
                       agent_names=[x for p in parts for x in (p.agent_names or [None] * len(p))],
                       multi_modal=media if any(media) else [])
