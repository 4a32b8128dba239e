"""verl 0.9.1's V1 sampler: which finished prompt groups a step trains on, and which are evicted and replaced.

    GroupBuffer (one Condition)                       ReplayBufferAsync.sample(global_steps, "train", k)
      uid -> Group: the prompt, the step it was          evict: finished groups older than the threshold (drop)
      issued at (verl's prompt tag), its status             and failed groups; refill_fn(as many) issues fresh ones
      pending ─▶ running ─▶ finished | failure           wait:  (strategy wait) while any in-flight group reached
      and its rollout.n responses once finished                 the threshold, and while fewer than k are finished
                                                          take:  the k finished groups issued earliest

A group's span at step N is N - issued + 1: the policy versions from its issue to its training. With
`max_off_policy_strategy=drop` a finished group whose span passes `max_off_policy_threshold` is evicted
(and replaced: one fresh prompt per group); with `wait` the sampler instead waits while any pending or
running group's span has reached the threshold, so it finishes and is trained. A group whose generation
failed is always evicted and replaced. `max_off_policy_threshold: null` turns version control off.
These are the rules of verl's `ReplayBufferAsync` (verl/trainer/ppo/v1/replay_buffer.py), read over plait's
buffer instead of verl's TransferQueue; tests/trainers/test_sampler.py runs verl's own class beside it.

A user sampler (`trainer.v1.sampler.custom_sampler.{path,name}`) is built with verl's keyword arguments
(trainer_mode, trainer_config, max_off_policy_threshold, max_off_policy_strategy, sampler_kwargs, refill_fn)
plus `buffer`, the GroupBuffer, and answers `sample(global_steps, partition_id, batch_size)` with the uids
it takes and its metrics; subclassing ReplayBufferAsync and overriding one rule is the short way.
Left out: DAPO's group filter in the sampler (refused in the V1 async modes; trainer_mode=sync filters, in
lm.next_filtered_batch).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from plait.configtree import ConfigError
from plait.data.rewards import import_user_file
from plait.errors import RunError
from plait.trainers.producer import RolloutError, Work
from plait.types import PromptBatch

log = logging.getLogger("plait.trainers")


@dataclass
class Group:
    """One prompt and its rollout.n responses: verl's unit of sampling, eviction and refill."""
    uid: int
    prompt: Any                   # a one-row PromptBatch
    issued: int                   # the step it was issued at (verl's prompt tag `global_steps`)
    status: str = "pending"       # pending -> running -> finished | failure
    batch: Any = None             # its RolloutBatch once finished


class GroupBuffer:
    """The prompt groups issued and not yet trained on, under one Condition (reentrant: a sampler may
    refill while holding it). The trainer's sampler waits on it; the rollouter fills it: the buffer is the
    producer's source (producer.py), each call its `chunk` oldest pending groups, `n` responses each."""
    wait_span = None  # (the rollouter's waits for pending groups are no span of their own)

    def __init__(self, mode: str = "", chunk: int = 1, n: int = 1, seed_of: Optional[Callable[[int], int]] = None):
        self.mode, self.chunk, self.n, self.seed_of = mode, chunk, n, seed_of  # seed_of(uid): a call's sampling seed
        self.cond = threading.Condition()
        self.groups: dict[int, Group] = {}   # in issue order
        self.next_uid = 0                    # uids are unique in a run (a row of the data may come back next epoch)
        self.error: Optional[BaseException] = None  # set by the rollouter when it fails
        self.stale_tokens = 0.0  # sampled tokens of the groups evicted as stale since the trainer last asked

    def add(self, prompt, issued: int, batch=None) -> Group:
        """A new group (pending, or finished with `batch`, its group ids set to the new uid) with the next uid."""
        with self.cond:
            uid, self.next_uid = self.next_uid, self.next_uid + 1
            if batch is not None:
                batch = batch.replace(group_ids=batch.group_ids.new_full(batch.group_ids.shape, uid))
            self.groups[uid] = Group(uid, prompt, issued, "pending" if batch is None else "finished", batch)
            self.cond.notify_all()
            return self.groups[uid]

    def take_stale_tokens(self) -> float:
        """The sampled tokens of the groups evicted as stale since the last call (the trainer's token ledger)."""
        with self.cond:
            tokens, self.stale_tokens = self.stale_tokens, 0.0
            return tokens

    # -- the producer's source (the methods are called holding `cond`) ---------------------------------

    def ready(self, may_generate: bool) -> bool:
        return may_generate and bool(self.with_status("pending"))

    def claim(self) -> Work:
        """The `chunk` oldest pending groups, now running."""
        groups = [self.groups[u] for u in self.with_status("pending")[:self.chunk]]
        for g in groups:
            g.status = "running"
        ids = [f"g{g.uid}.{j}" for g in groups for j in range(self.n)]  # samples.jsonl: uids are unique in a run
        return Work(PromptBatch.concat([g.prompt for g in groups]), self.seed_of(groups[0].uid) * 64, groups, ids=ids)

    def finish(self, work: Work, batch, partial=None) -> None:
        """`batch` (None: the call failed) holds the groups' rows, n each, in order; each group's rows get its uid
        as group id (a data row may come back in a later epoch)."""
        n = self.n
        for i, g in enumerate(work.tag):
            rows = None if batch is None else batch.select(slice(i * n, i * n + n))
            g.status, g.batch = ("failure", None) if rows is None else (
                "finished", rows.replace(group_ids=rows.group_ids.new_full(rows.group_ids.shape, g.uid)))

    def failed(self, work: Work, err: Exception) -> None:
        log.warning("plait: %s: generating %d prompt groups failed (%s: %s); the sampler replaces them",
                    self.mode, len(work.tag), type(err).__name__, err)
        self.finish(work, None)

    def synced(self) -> None:
        pass

    def ended(self, error: BaseException | None) -> None:
        self.error = error

    def snapshot(self) -> list[dict]:
        """What a checkpoint keeps: each group's dataset row, issue step and, finished, its responses (verl keeps
        the finished groups and issues the pending and running ones again; failed ones are replaced anyway)."""
        with self.cond:
            return [{"index": g.prompt.indices[0], "issued": g.issued,
                     "batch": vars(g.batch) if g.status == "finished" else None}
                    for g in self.groups.values() if g.status != "failure"]

    def tags(self) -> dict[int, dict]:
        """verl's prompt tags: uid -> {"status", "global_steps"}."""
        return {uid: {"status": g.status, "global_steps": g.issued} for uid, g in self.groups.items()}

    def with_status(self, *status: str) -> list[int]:
        return [uid for uid, g in self.groups.items() if g.status in status]

    def remove(self, uids) -> list[Group]:
        with self.cond:
            return [self.groups.pop(uid) for uid in uids]

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the buffer to change (call holding `cond`); RolloutError when the rollouter failed."""
        if self.error is None:
            self.cond.wait(timeout)
        if self.error is not None:
            raise RolloutError(f"the rollouter thread failed: {type(self.error).__name__}: {self.error}") from self.error


def span(global_steps: int, issued: int) -> int:
    """Policy versions from a group's issue to its training at `global_steps` (verl's staleness span)."""
    return global_steps - issued + 1


def stale(tags: dict[int, dict], global_steps: int, threshold: Optional[int]) -> set[int]:
    """Finished groups whose span passes the threshold: the ones `drop` evicts."""
    if threshold is None:
        return set()
    return {u for u, t in tags.items() if t["status"] == "finished" and span(global_steps, t["global_steps"]) > threshold}


def must_wait(tags: dict[int, dict], global_steps: int, threshold: Optional[int]) -> bool:
    """`wait`'s rule: some pending or running group's span has reached the threshold, so it is waited for."""
    return threshold is not None and any(
        t["status"] in ("pending", "running") and span(global_steps, t["global_steps"]) >= threshold for t in tags.values())


def oldest(tags: dict[int, dict], uids, k: int) -> list[int]:
    """The `k` groups of `uids` issued earliest (issue order among groups of one step)."""
    return sorted(uids, key=lambda u: (tags[u]["global_steps"], u))[:k]


class ReplayBufferAsync:
    """verl's asynchronous sampler over a GroupBuffer; `refill_fn(k)` issues k fresh prompts."""

    def __init__(self, trainer_mode: str, trainer_config: Any, max_off_policy_threshold: Optional[int],
                 max_off_policy_strategy: str, sampler_kwargs: dict, refill_fn: Callable[[int], Any],
                 buffer: GroupBuffer, **kwargs):
        self.trainer_mode, self.trainer_config, self.sampler_kwargs = trainer_mode, trainer_config, sampler_kwargs
        self.threshold, self.strategy = max_off_policy_threshold, max_off_policy_strategy
        self.refill_fn, self.buffer = refill_fn, buffer

    def evictions(self, global_steps: int) -> tuple[set[int], set[int]]:
        """(stale, failed) groups to evict now."""
        tags = self.buffer.tags()
        dropped = stale(tags, global_steps, self.threshold) if self.strategy == "drop" else set()
        return dropped, set(self.buffer.with_status("failure"))

    def ready(self, global_steps: int, batch_size: int) -> list[int] | None:
        """The groups to take now, or None to wait."""
        tags = self.buffer.tags()
        if self.strategy == "wait" and must_wait(tags, global_steps, self.threshold):
            return None
        finished = self.buffer.with_status("finished")
        return oldest(tags, finished, batch_size) if len(finished) >= batch_size else None

    def sample(self, global_steps: int, partition_id: str, batch_size: int) -> tuple[list[int], dict]:
        """Wait until `batch_size` groups can be taken, evicting and refilling meanwhile; returns their uids
        (still in the buffer: the caller removes them) and verl's eviction metrics."""
        metrics: dict[str, float] = {}
        with self.buffer.cond:
            while True:
                dropped, failed = self.evictions(global_steps)
                if dropped or failed:
                    count_evictions(metrics, global_steps, [self.buffer.groups[u].issued for u in dropped], len(failed))
                    self.buffer.stale_tokens += sum(  # the trainer's token ledger reads them (take_stale_tokens)
                        float(g.batch.response_mask.sum()) for g in map(self.buffer.groups.get, dropped)
                        if g.batch is not None)  # (verl's parity tests' groups carry no responses)
                    self.buffer.remove(dropped | failed)
                    self.refill_fn(len(dropped | failed))
                    continue
                taken = self.ready(global_steps, batch_size)
                if taken is not None:
                    return taken, metrics
                self.buffer.wait()


def take(sampler, buffer: GroupBuffer, global_steps: int, batch_size: int) -> tuple[list[Group], dict]:
    """The groups `sampler` picks, taken out of the buffer, and its metrics; a user sampler's failure, or its
    picking a group that is not finished, is one RunError line naming it."""
    name = type(sampler).__name__
    try:
        uids, metrics = sampler.sample(global_steps, "train", batch_size)
    except RolloutError:
        raise
    except Exception as err:  # noqa: BLE001 - a user sampler's failure: one line
        raise RunError(f"trainer.v1.sampler: {name}.sample raised {type(err).__name__}: {err}") from err
    with buffer.cond:
        if any(u not in buffer.groups or buffer.groups[u].status != "finished" for u in uids):
            raise RunError(f"trainer.v1.sampler: {name}.sample returned uids that are not finished groups of the buffer")
        return buffer.remove(uids), metrics


def count_evictions(metrics: dict, global_steps: int, issued: list[int], failed: int) -> None:
    """Add one eviction pass to verl's metrics in place: training/off_policy/evicted_samples and the evicted groups'
    spans (evicted_samples_staleness/{mean,max,min}); training/rollout_failure/evicted_samples."""
    new: dict[str, float] = {}
    if issued:
        spans = [span(global_steps, i) for i in issued]
        key = "training/off_policy/evicted_samples"
        new.update({key: len(spans), f"{key}_staleness/mean": sum(spans) / len(spans),
                    f"{key}_staleness/max": max(spans), f"{key}_staleness/min": min(spans)})
    if failed:
        new["training/rollout_failure/evicted_samples"] = failed
    merge_sampler_metrics(metrics, new)


def merge_sampler_metrics(acc: dict, new: dict) -> None:
    """`new` into `acc` in place, as verl sums a step's sampler metrics: counts add up, a `<count>_staleness/mean`
    is weighted by its count, /max and /min keep the extreme."""
    for key, value in new.items():
        if key.endswith("_staleness/mean"):
            count = key.removesuffix("_staleness/mean")
            before, added = acc.get(count, 0), new.get(count, 0)
            acc[key] = (acc.get(key, 0.0) * before + value * added) / (before + added) if before + added else value
    for key, value in new.items():
        if key.endswith("/max"):
            acc[key] = max(acc.get(key, value), value)
        elif key.endswith("/min"):
            acc[key] = min(acc.get(key, value), value)
        elif not key.endswith("_staleness/mean"):
            acc[key] = acc.get(key, 0) + value


def sampler_class(path: Optional[str], name: Optional[str]) -> type:
    """The sampler class: ReplayBufferAsync, or `custom_sampler`'s class imported from its file (ConfigError
    naming the key when the file does not import or has no such class)."""
    if not path:
        return ReplayBufferAsync
    key, file = "trainer.v1.sampler.custom_sampler.path", path.removeprefix("file://")
    if not os.path.isfile(file):
        raise ConfigError(key, path, "no such file: a Python file defining the sampler class")
    module = import_user_file(key, file, f"plait_custom_sampler_{os.path.basename(file).removesuffix('.py')}")
    cls = getattr(module, name, None)
    if not isinstance(cls, type):
        raise ConfigError("trainer.v1.sampler.custom_sampler.name", name, f"no class of that name in {path}")
    return cls


def build_sampler(cfg, mode: str, buffer: GroupBuffer, refill_fn: Callable[[int], Any]):
    """The sampler of `trainer.v1.sampler` for V1 mode `mode`, built with verl's keyword arguments."""
    s = cfg.trainer.v1.sampler
    cls = sampler_class(s.custom_sampler.path, s.custom_sampler.name)
    try:
        return cls(trainer_mode=mode, trainer_config=getattr(cfg.trainer.v1, mode),
                   max_off_policy_threshold=s.max_off_policy_threshold, max_off_policy_strategy=s.max_off_policy_strategy,
                   sampler_kwargs=s.sampler_kwargs, refill_fn=refill_fn, buffer=buffer)
    except Exception as err:  # noqa: BLE001 - the user's constructor: one line
        raise ConfigError("trainer.v1.sampler.custom_sampler.name", s.custom_sampler.name,
                          f"its constructor raised {type(err).__name__}: {err}") from None
