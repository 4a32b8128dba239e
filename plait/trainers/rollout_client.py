"""The rollout client: the one caller of the rollout worker's generating calls, for every LM mode.

    a mode's next_batch / rollout thread ─▶ produce(generate | resume)   a training batch, its samples' spans
    validation, greedy baselines         ─▶ generate(method, ...)         any generating call
    after_update                         ─▶ abort(), push(version)        cut a running generate; new weights + check
                                                 │
                           EngineDied (vLLM's engine core, the rollout's own Ray worker process died)
                                                 ▼
                           restart(): the engine restarted with the current weights, once per step, the call
                           re-issued; a second death in a step is EngineFailed, one line

Two threads may meet one death (a rollout thread's generate and the trainer's weight push): the first to take
`lock` repairs it; the other sees the count move (`seen`) and only re-issues its call. The count rises once the
repair is done, so a call that began while it ran counts as meeting the same death. Left out: the reward
side's restarts (the judge's, the reward model's: LMTrainer.score).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Callable

from plait.errors import EngineDied, EngineFailed
from plait.profiler.samples import SAMPLES, now, sample_ids
from plait.safeload import first_line
from plait.types import RolloutBatch
from plait.workers.rollout import Rollout
from plait.workers.weight_sync import SyncCheck, sync_weights


class RolloutClient:
    def __init__(self, roles, actor_lock: threading.Lock, sync_check: SyncCheck | None,
                 step_of: Callable[[], int], version_of: Callable[[], int]):
        """`roles`: the trainer's (rollout and actor groups); `actor_lock`: held by the trainer while it updates (a
        restart pushes the weights of one version); `step_of()`, `version_of()`: the trainer's step and policy version."""
        self.roles, self.actor_lock, self.sync_check = roles, actor_lock, sync_check
        self.step_of, self.version_of = step_of, version_of
        self.lock = threading.Lock()
        self.restarts, self.restart_step, self.logged = 0, -1, 0  # the run's count, the step of the last, the count logged

    def generate(self, method, *args):
        """A rollout call that generates (generate, resume). When its engine died, the engine is restarted with the
        current weights and the call re-issued whole (same prompts, same seed), once per step."""
        while True:  # restart raises at the second death in a step
            seen = self.restarts
            try:
                return self.roles.rollout.call(method, *args)
            except EngineDied as err:
                self.restart(err, seen)

    def produce(self, method, *args, epoch: int = 0, submitted: float | None = None,
                ids: list[str] | None = None) -> RolloutBatch:
        """Rollout.generate (or resume) for training, with its samples' spans (profiler/samples.py): a generated
        batch's rows get their ids (`ids`, else "<epoch>.<prompt>.<j>"), a `queue` span from `submitted`, and a
        `gen` span of the call (agent loops: their own per-turn `gen` and `tool` spans); a resume adds a `resume`
        span to the rows it finished."""
        started = now()
        batch = self.generate(method, *args)
        ended = now()
        if method is Rollout.resume:
            rows = [i for i, r in enumerate(args[0].stop_reasons) if r == "aborted"]
            SAMPLES.add_many([batch.sample_ids[i] for i in rows] if batch.sample_ids else [], "resume", started, ended)
            return batch
        batch.sample_ids = ids if ids is not None else sample_ids(epoch, batch.group_ids.tolist())
        versions = batch.versions.tolist()
        if submitted is not None and started > submitted:
            SAMPLES.add_many(batch.sample_ids, "queue", submitted, started, versions)
        infos = batch.agent_infos or [None] * len(batch)
        own = [i for i, info in enumerate(infos) if info and info.get("sample_spans")]  # a producer's own spans
        SAMPLES.versions(batch.sample_ids, versions)
        SAMPLES.from_infos([batch.sample_ids[i] for i in own], [infos[i] for i in own])
        rest = [i for i, info in enumerate(infos) if not (info and info.get("sample_spans"))]
        SAMPLES.add_many([batch.sample_ids[i] for i in rest], "gen", started, ended, [versions[i] for i in rest])
        return batch

    def push(self, version: int, share: bool = False) -> dict[str, float]:
        """The actor's weights to the rollout as policy `version`, then the weight-sync check; its metrics."""
        while True:  # the engine may die during the sync too
            seen = self.restarts
            try:
                sync_weights(self.roles.actor, self.roles.rollout, version, share)
                return {} if self.sync_check is None else self.sync_check.after_sync(version)
            except EngineDied as err:
                self.restart(err, seen)

    def abort(self) -> None:
        """Cut the rollout's running generate short (a weight sync comes). A dead engine has nothing to cut: its death
        is met, and the engine restarted, by the next call that needs it (generate, push)."""
        try:
            self.roles.rollout.call(Rollout.abort)
        except EngineDied:
            pass

    def restart(self, err: EngineDied, seen: int) -> None:
        """Restart the dead engine with the current weights, once per step; `seen`: the count when the failed call
        began (moved since: another thread repaired this death already, the call is only re-issued)."""
        with self.lock:
            if self.restarts != seen:
                return
            step, version = self.step_of(), self.version_of()
            if self.restart_step == step:
                raise EngineFailed(f"the rollout engine failed again in step {step}, after a restart in the same "
                                   f"step: {first_line(err)}")
            self.restart_step = step
            print(f"plait: warning: the rollout engine died in step {step} ({first_line(err)}); restarting it with "
                  f"the current weights (policy version {version}); the call it died in is re-issued", file=sys.stderr)
            self.roles.rollout.recover(Rollout.restart_engine)
            with self.actor_lock:  # not mid-update: the weights of one version
                sync_weights(self.roles.actor, self.roles.rollout, self.version_of())
            self.restarts += 1

    def restarts_since_logged(self) -> int:
        """Restarts since the last step's record (rollout/engine_restarts): a rollout thread's between steps too."""
        restarts = self.restarts
        since, self.logged = restarts - self.logged, restarts
        return since


@dataclass
class Restarts:
    """A second model's restarts (the reward model or judge, the teachers): the run's count, the step of the last
    one (restarted once a step), the count last logged."""
    count: int = 0
    step: int = -1
    logged: int = 0

    def since_logged(self) -> int:
        new, self.logged = self.count - self.logged, self.count
        return new
