"""The language-model pipeline every LM mode shares: data cursor, reward, advantages, update, metrics.

    reward ─▶ [gen_max] ─▶ old_log_prob ─▶ ref ─▶ [teacher] ─▶ values ─▶ adv ─▶ update_critic ─▶ update_actor

With `algorithm.filter_groups.enable` (DAPO's dynamic sampling) the reward runs as batches arrive:
groups whose metric has no variance are dropped and the mode's `next_batch` is asked again until a
batch's worth of groups has signal (`next_filtered_batch`); the pipeline then goes on from old_log_prob.
(gen_max runs only for ReMax: a greedy response per prompt whose score is the baseline.
old_log_prob is skipped in verl's bypass mode: pi_old is then the rollout's own log-prob, and
rollout correction moves into the actor; and when the batch feeds exactly one optimizer step:
the update's own forward then gives pi_old. update_actor waits out `trainer.critic_warmup` steps. teacher
runs with on-policy distillation: the teachers' log-probs of the student's tokens, read by the actor's loss.)

`LMTrainer` implements the lifecycle's Trainer protocol around `learn`; a mode (sync.py,
one_step_off.py, fully_async.py) subclasses it and supplies only where a batch comes from
(`next_batch`), what follows an update (`after_update`, returning the mode's metrics) and how
many local updates make one step (`updates_per_step`). Profiling, timing, checkpoints, validation
and logging are not here: they are the lifecycle's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from plait.algorithms.advantages import (NEEDS_GREEDY_BASELINE, NEEDS_SUM_PI_SQUARED, PER_RESPONSE, compute_advantages,
                                         pf_ppo_weights)
from plait.algorithms.kl import apply_kl_penalty, make_kl_controller
from plait.algorithms.rollout_correction import rollout_correction
from plait.config import PlaitConfig, SamplingConfig
from plait.configtree import ConfigError
from plait.errors import EngineDied, EngineFailed, RunError
from plait.safeload import first_line
from plait.export import HF_DIR, write_export
from plait.data.dataset import PromptDataset, iterate_batches, prompt_batch
from plait.data.rewards import ScoreRequest, Scores
from plait.profiler.samples import SAMPLES, now
from plait.profiler.timeline import TIMELINE, WALL0, union_of
from plait.trainers.lifecycle import StageTimer, StepResult
from plait.trainers.rollout_client import Restarts, RolloutClient
from plait.trainers.metrics import (agent_metrics, data_metrics, filter_values, groups_with_signal, last_token_scores,
                                    loop_scores, masked_mean, merge_results, off_policy_metrics, record_tool_spans,
                                    rollout_probs_diff, session_advantages, session_owners, sessions_of,
                                    validation_metrics, TokenLedger)
from plait.types import PromptBatch, RolloutBatch
from plait.workers.actor import Actor
from plait.workers.critic import Critic
from plait.workers.judge import Judge
from plait.workers.packing import seqlen_metrics
from plait.workers.ref import Ref
from plait.workers.reward_model import RewardModel
from plait.workers.rollout import Rollout
from plait.workers.teacher import Teacher
from plait.workers.weight_sync import SyncCheck, sync_weights


@dataclass
class Roles:
    """The worker groups a language-model trainer drives; ref, critic, reward_model (a classifier), judge (a
    causal LM the reward function asks) and teacher are None when unused (ref also with LoRA: the actor computes
    reference log-probs with its adapters off)."""
    actor: object
    rollout: object
    ref: object | None
    critic: object | None
    reward_model: object | None = None
    judge: object | None = None
    teacher: object | None = None  # on-policy distillation's teachers (plait/workers/teacher.py)


class DataCursor:
    """Where the trainer is in its data: epoch and batch index, all a resume needs."""

    def __init__(self, dataset: PromptDataset, batch_size: int, shuffle: bool, seed: int):
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.epoch, self.index = 0, 0
        self.batches_per_epoch = len(dataset) // batch_size
        if self.batches_per_epoch == 0:
            raise ConfigError("data.train_batch_size", batch_size, f"larger than the training set ({len(dataset)} rows)")
        self._epoch_batches = None

    def next(self) -> PromptBatch:
        if self.index >= self.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        if self._epoch_batches is None or self._epoch_batches[0] != self.epoch:
            self._epoch_batches = (self.epoch, list(iterate_batches(self.dataset, self.batch_size, self.shuffle, self.seed, self.epoch)))
        items = self._epoch_batches[1][self.index]
        self.index += 1
        return prompt_batch(items)

    def state(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]


class LMTrainer:
    """Everything an LM mode shares; subclasses define next_batch and after_update."""

    def __init__(self, cfg: PlaitConfig, roles: Roles, tokenizer, train_data: PromptDataset,
                 val_data: PromptDataset | None, reward_fn: Callable, targets, tracker):
        self.cfg, self.roles, self.tokenizer, self.reward_fn = cfg, roles, tokenizer, reward_fn
        self.val_data, self.targets = val_data, targets
        self.tracker = tracker  # the lifecycle's Tracker (or None): validation lines and generations go there
        self.cursor = DataCursor(train_data, cfg.data.train_batch_size, cfg.data.shuffle, cfg.data.seed)
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
        self.pf_ppo_rng = torch.Generator().manual_seed(cfg.trainer.seed)  # PF-PPO's draws
        r = cfg.actor_rollout_ref.rollout
        self.sampling = SamplingConfig(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, do_sample=r.do_sample)
        self.correction = cfg.algorithm.rollout_correction
        self.updates_per_step = 1  # fully async: several local updates per policy version
        self.keeps_pi_old = False  # separate_async: pi_old is the step's synced weights (Actor.keep_pi_old), not the current
        self.version = 0
        self.sync_check = SyncCheck(roles.actor, roles.rollout, tokenizer) if cfg.trainer.check_weight_sync else None
        self.actor_lock = threading.Lock()  # an update; a restart's weight push (a rollout thread's) waits for it
        self.client = RolloutClient(roles, self.actor_lock, self.sync_check, lambda: self.step, lambda: self.version)
        # restarts of the second models whose worker died: the reward model or judge (score), the teachers
        self.restarts = {"reward": Restarts(), "teacher": Restarts()}
        self.step = 0
        self.ledger = TokenLedger()  # tokens/*: every sampled token once, trained or discarded by cause
        self.model_flops = None  # the policy's FLOPs per token (asked of the actor at start)
        self.routers: list[str] | None = None  # the judge's replicas (host:port), asked at start

    # -- the Trainer protocol -------------------------------------------------------------------

    def total_steps(self) -> int:
        return self.cfg.total_steps(self.cursor.batches_per_epoch)

    def start(self) -> None:
        """Asked once here, not in a step: a step's time is its stages (profiler/analysis/accounting.py);
        the weight-sync check's numerical gap, while the actor and the engine hold the same weights."""
        self.model_flops = self.roles.actor.call(Actor.model_flops)
        if self.roles.judge is not None:
            self.routers = self.roles.judge.call(Judge.addresses)
            print(f"plait: the judge ({self.cfg.reward.reward_model.model_path}, {len(self.routers)} replica(s)) answers "
                  f"the reward function's reward_router_address at {', '.join(self.routers)}", file=sys.stderr)
        if self.sync_check is not None:
            self.sync_check.start()

    def train_step(self, step: int, timer: StageTimer) -> StepResult:
        start, results, samples, lengths = time.perf_counter(), [], 0, []
        self.step = step
        # verl's rule: the actor trains from step critic_warmup on (steps 1..critic_warmup-1 train the critic only)
        update_actor = step >= self.cfg.trainer.critic_warmup
        for _ in range(self.updates_per_step):
            batch, scored, filter_metrics = self.next_filtered_batch(step, timer)
            results.append(self.learn(batch, timer, update_actor, scored))
            results[-1].metrics.update(filter_metrics)
            samples += len(batch)
            lengths += batch.attention_mask.sum(-1).tolist()
        result = merge_results(results)
        result.metrics["training/epoch"] = self.cursor.epoch
        result.metrics.update(self.after_update(step, timer))
        result.metrics.update(self.ledger.step_metrics())
        if "gen" in timer.times:  # generated in this step (sync); prefill + decode cost one forward's FLOPs
            result.metrics["perf/mfu/gen"] = self.model_flops.mfu(self.model_flops.forward(lengths), timer.times["gen"])
        if "old_log_prob" in timer.times:  # one forward over the step's rows, split over the actor's ranks
            result.metrics["perf/mfu/old_log_prob"] = self.model_flops.mfu(
                self.model_flops.forward(lengths) / self.roles.actor.world_size, timer.times["old_log_prob"])
        result.metrics["perf/samples_per_s"] = samples / (time.perf_counter() - start)
        result.metrics["rollout/engine_restarts"] = self.client.restarts_since_logged()  # a rollout thread's too
        if self.roles.judge is not None or self.roles.reward_model is not None:
            result.metrics["reward/model_restarts"] = self.restarts["reward"].since_logged()
        if self.roles.teacher is not None:
            result.metrics["distillation/teacher_restarts"] = self.restarts["teacher"].since_logged()
        if self.cfg.data.filter_overlong_prompts:
            result.metrics["data/filtered_overlong_prompts"] = self.cursor.dataset.filtered
        return result

    def validate(self) -> dict[str, float]:
        from plait.agents.worker import tool_call_rates
        if self.val_data is None:
            return {}
        val = self.cfg.actor_rollout_ref.rollout.val_kwargs
        size = self.cfg.data.val_batch_size or len(self.val_data)
        scores, sources, uids, lengths, samples, extras, infos = [], [], [], [], [], {}, []
        started, total = time.perf_counter(), len(self.val_data)
        for start in range(0, total, size):
            self.live_validation(start, total, size, time.perf_counter() - started)
            prompts = prompt_batch([self.val_data[i] for i in range(start, min(start + size, total))])
            batch = self.client.generate(Rollout.generate, prompts, val, self.cfg.trainer.seed)
            scored, extra = self.score(batch)
            for key, values in extra.items():
                extras.setdefault(key, []).extend(values)
            scores += scored
            sources += batch.data_sources
            uids += batch.group_ids.tolist()
            lengths += batch.attended.sum(-1).tolist()
            infos += batch.agent_infos or []
            if self.cfg.trainer.log_val_generations:
                samples += zip(self.decode(batch.prompts, batch.prompt_mask), self.decode(batch.responses, batch.attended), scored)
        out = validation_metrics(sources, uids, scores, extras)
        out["val-aux/response_length/mean"] = sum(lengths) / max(len(lengths), 1)
        out.update({f"val-aux/{k}": v for k, v in tool_call_rates(infos).items()})  # {} without agent loops
        if samples:
            self.log_val_generations(samples)
        return out

    def live_validation(self, done: int, total: int, size: int, elapsed: float) -> None:
        """A line as each validation batch starts, so a long validation does not look hung: always before
        training (the first one, with nothing else on screen yet), later only once it has run LIVE_AFTER_S."""
        if self.tracker is None or (self.version > 0 and elapsed < LIVE_AFTER_S):
            return
        batches = -(-total // size)
        self.tracker.note(f"plait: validation (policy version {self.version}): batch {done // size + 1}/{batches}, "
                          f"{done}/{total} prompts answered, {elapsed:.0f} s")

    def log_val_generations(self, samples: list[tuple[str, str, float]]) -> None:
        """`trainer.log_val_generations` samples (input, output, score), picked as verl does (sorted,
        then a fixed-seed shuffle), to the tracker's loggers and val_generations.jsonl."""
        samples = sorted(samples, key=lambda s: s[0])
        random.Random(42).shuffle(samples)
        if self.tracker is not None:
            self.tracker.log_generations(samples[:self.cfg.trainer.log_val_generations], step=self.version)

    def save_checkpoint(self, path: str, step: int) -> None:
        try:
            self._save_checkpoint(path, step)
        except RunError as err:  # a Ray worker's failed write (a full disk): the line the in-process save gives
            cause = err.cause
            if not isinstance(cause, OSError):
                raise
            raise RunError(f"checkpoint of step {step} not written to {path}: {cause.strerror or cause}; the previous "
                           f"checkpoint stays latest (the Ray workers were stopped; details in "
                           f"{err.log or 'worker_errors.log'})") from err

    def _save_checkpoint(self, path: str, step: int) -> None:
        os.makedirs(path, exist_ok=True)
        self.roles.actor.call(Actor.save_checkpoint, os.path.join(path, "actor"))
        hf = os.path.join(path, "actor", HF_DIR)
        self.tokenizer.save_pretrained(hf)
        save_image_processor(self.cfg.actor_rollout_ref.model.path, hf)  # a VL policy's: the export loads as one
        if "hf_model" in self.cfg.actor_rollout_ref.actor.checkpoint.save_contents:  # verl's: the policy, ready to serve
            write_export(os.path.join(path, "actor"), hf)
        if self.roles.critic is not None:
            self.roles.critic.call(Critic.save_checkpoint, os.path.join(path, "critic"))
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "version": self.version, "data": self.cursor.state(),
                       "kl_coef": self.kl_ctrl.value}, f)

    def load_checkpoint(self, path: str, step: int) -> None:
        self.roles.actor.call(Actor.load_checkpoint, os.path.join(path, "actor"))
        if self.roles.critic is not None:
            self.roles.critic.call(Critic.load_checkpoint, os.path.join(path, "critic"))
        with open(os.path.join(path, "trainer_state.json")) as f:
            state = json.load(f)
        self.cursor.load_state(state["data"])
        self.kl_ctrl.value = state["kl_coef"]
        self.version = state["version"]
        sync_weights(self.roles.actor, self.roles.rollout, self.version)

    def profile_targets(self):
        return self.targets

    def held(self):
        """Inside, no generation runs on another thread of this process (the modes with a rollout thread say how)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Stop the rollout engine's own processes (vLLM's engine core), and the judge's server. Quietly: the backend
        may be down after the failure that brought us here, and that failure, not this one, is the one to report."""
        for role, method in ((self.roles.rollout, Rollout.close), (self.roles.judge, Judge.close)):
            if role is not None:
                with contextlib.suppress(Exception):
                    role.call(method)

    # -- what the modes change -----------------------------------------------------------------

    def next_batch(self, step: int, timer: StageTimer) -> RolloutBatch:
        raise NotImplementedError

    def after_update(self, step: int, timer: StageTimer) -> dict[str, float]:
        raise NotImplementedError

    def sample_seed(self, step: int) -> int:
        return self.cfg.trainer.seed * 1_000_003 + step

    # -- the shared language-model pipeline -----------------------------------------------------

    def decode(self, ids: torch.Tensor, mask: torch.Tensor) -> list[str]:
        """Text of each row's masked tokens (responses are right-padded, prompts left-padded)."""
        return self.tokenizer.batch_decode([row[m.bool()].tolist() for row, m in zip(ids, mask)], skip_special_tokens=True)

    def score(self, batch: RolloutBatch) -> Scores:
        """The batch's scores. When the reward model's or the judge's worker died (EngineDied: a process of the
        reward pool, on Ray), it is restarted and the call re-issued whole, once per step, as a rollout engine is;
        a second death in that step is one line."""
        while True:  # restart_reward_model raises at the second death in a step
            try:
                return self.score_once(batch)
            except EngineDied as err:
                self.restart_reward_model(err)

    def score_once(self, batch: RolloutBatch) -> Scores:
        if self.roles.reward_model is not None:  # as in verl, a reward model's score replaces the rule reward
            return self.roles.reward_model.call(RewardModel.compute_rm_score, batch), {}
        texts = self.decode(batch.responses, batch.attended)  # tool / user turns included, as verl's reward managers see it
        lengths = batch.attended.sum(-1).long().tolist()
        failure = None
        try:
            scores, extra = self.reward_fn(ScoreRequest(batch.data_sources, texts, batch.ground_truths, batch.extra_infos,
                                                        lengths, self.routers))
        except Exception as err:  # noqa: BLE001 - raised below, unless the judge's death is the cause
            failure = err
        if self.roles.judge is not None:  # its death (EngineDied here), not what the reward function made of it
            self.roles.judge.call(Judge.up)  # (an error, or a default score for a refused request), is the fault
        if failure is not None:
            raise failure
        return loop_scores(batch, scores), extra

    def restart_reward_model(self, err: EngineDied) -> None:
        """Fresh worker processes for the dead reward model or judge (its weights loaded again), once per step; a
        judge's replicas answer at new addresses, which the re-issued reward call hands the reward function.
        Called from the trainer's thread only (the reward stage, validation)."""
        name, group = ("judge", self.roles.judge) if self.roles.judge is not None else ("reward model", self.roles.reward_model)
        self.restart_model("reward", name, group, err)
        if self.roles.judge is not None:
            self.routers = self.roles.judge.call(Judge.addresses)
        where = f"; its replicas answer at {', '.join(self.routers)}" if self.roles.judge is not None else ""
        print(f"plait: warning: the {name} died in step {self.step} ({first_line(err)}); restarted it{where}; the reward "
              "call it died in is re-issued", file=sys.stderr)

    def teacher_log_probs(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The teachers' log-probs of the batch's tokens. When a teacher's worker died (EngineDied: a process of
        the teacher pool, on Ray), the pool is restarted (the teachers loaded again) and the call re-issued whole,
        once per step, as a judge is; a second death in that step is one line."""
        while True:
            try:
                return self.roles.teacher.call(Teacher.compute_teacher_log_prob, batch)
            except EngineDied as err:
                self.restart_model("teacher", "teacher", self.roles.teacher, err)
                print(f"plait: warning: the teacher died in step {self.step} ({first_line(err)}); restarted it; its "
                      "log-prob call is re-issued", file=sys.stderr)

    def restart_model(self, part: str, name: str, group, err: EngineDied) -> None:
        """Fresh worker processes for `group` (a second model, `name` in the error), once per step of `part`."""
        restarts = self.restarts[part]
        if restarts.step == self.step:
            raise EngineFailed(f"the {name} failed again in step {self.step}, after a restart in the same step: "
                               f"{first_line(err)}")
        restarts.step = self.step
        group.recover()
        restarts.count += 1

    def judge_stage(self, since: float, timer: StageTimer) -> dict[str, float]:
        """The judge's engine rounds since `since` (perf_counter, taken in the reward stage; called before it
        ends) as the step's "judge" stage inside reward: their union as timeline spans and timing_s/judge; their
        requests and tokens as judge/* metrics. {} without a judge."""
        if self.roles.judge is None:
            return {}
        # Rounds are timed in wall clock, in the judge's process; clipped to this stage in this process's clock
        # (a round's end is taken after its answers went out, so the reward may finish first).
        until = time.perf_counter()
        rounds = [r for r in self.roles.judge.call(Judge.rounds, since + WALL0) if r.start - WALL0 < until]
        busy = 0.0
        for start, end in union_of([(max(r.start - WALL0, since), min(r.end - WALL0, until)) for r in rounds]):
            TIMELINE.add("trainer", "judge", start, end, timer.version)
            busy += end - start
        timer.times["judge"] = timer.times.get("judge", 0.0) + busy
        requests = sum(r.requests for r in rounds)
        return {"judge/requests": requests, "judge/rounds": len(rounds),
                "judge/requests_per_round": requests / max(len(rounds), 1),
                "judge/prompt_tokens/mean": sum(r.prompt_tokens for r in rounds) / max(requests, 1),
                "judge/response_tokens/mean": sum(r.response_tokens for r in rounds) / max(requests, 1)}

    def greedy_baselines(self, batch: RolloutBatch) -> torch.Tensor:
        """ReMax's baseline [batch]: the score of one greedy response per prompt, generated now."""
        first = {g: i for i, g in reversed(list(enumerate(batch.group_ids.tolist())))}  # group id -> a row
        rows = list(first.values())
        prompts = PromptBatch(prompt_ids=[batch.prompts[i][batch.prompt_mask[i].bool()].tolist() for i in rows],
                              data_sources=[batch.data_sources[i] for i in rows],
                              ground_truths=[batch.ground_truths[i] for i in rows],
                              extra_infos=[batch.extra_infos[i] for i in rows], indices=list(first),
                              multi_modal=[] if batch.multi_modal_inputs is None else
                              [batch.multi_modal_inputs[i] for i in rows])
        greedy = self.client.generate(Rollout.generate, prompts, SamplingConfig(n=1, do_sample=False), self.cfg.trainer.seed)
        scores, _ = self.score(greedy)
        by_group = dict(zip(greedy.group_ids.tolist(), scores))
        return torch.tensor([by_group[g] for g in batch.group_ids.tolist()], dtype=torch.float32)

    def next_filtered_batch(self, step: int, timer: StageTimer) -> tuple[RolloutBatch, Scores | None, dict[str, float]]:
        """The mode's next batch; with algorithm.filter_groups on, DAPO's dynamic sampling: score each
        batch as it arrives, keep the groups whose metric varies, and ask for more batches until as many
        groups as the first batch had are kept (surplus groups dropped), within max_num_gen_batches.
        Returns the batch, its scores when already computed, and verl's metrics for the filter."""
        fg = self.cfg.algorithm.filter_groups
        if not fg.enable:
            return self.next_batch(step, timer), None, {}
        parts, scores, extras, want, kept, dropped, num_gen = [], [], {}, None, 0, 0, 0
        while want is None or kept < want:
            if fg.max_num_gen_batches and num_gen >= fg.max_num_gen_batches:
                raise RunError(f"algorithm.filter_groups: {num_gen} generated batches gave {kept} of {want} prompt groups "
                               f"with a varying {fg.metric!r} (max_num_gen_batches={fg.max_num_gen_batches}); the data may "
                               "be too hard or too easy for the policy: set max_num_gen_batches=0 to keep trying")
            batch = self.next_batch(step, timer)
            num_gen += 1
            SAMPLES.take(batch.sample_ids or [], scoring := now())
            with timer.stage("reward"):
                since = time.perf_counter()
                s, e = self.score(batch)
                judged = self.judge_stage(since, timer)
            SAMPLES.add_many(batch.sample_ids or [], "reward", scoring, now())
            ids = batch.group_ids.tolist()
            want = want or len(set(ids))
            signal = groups_with_signal(filter_values(fg.metric, s, e), ids)
            room = set(sorted(signal, key=ids.index)[:want - kept])  # the first groups to fill the batch
            dropped += len(set(ids)) - len(room)
            rows = [i for i, g in enumerate(ids) if g in room]
            SAMPLES.finish([x for i, x in enumerate(batch.sample_ids or []) if ids[i] not in room], "dropped", now())
            self.ledger.discard("filtered", batch.response_mask[[g not in room for g in ids]])
            kept += len(room)
            parts.append(batch.select(rows))
            scores += [s[i] for i in rows]
            for key in {*extras, *e}:  # NaN where a batch's results lacked the key, as collect_results does
                got = e.get(key)
                extras.setdefault(key, [math.nan] * (len(scores) - len(rows))).extend(
                    [got[i] for i in rows] if got is not None else [math.nan] * len(rows))
        # groups with signal beyond the batch's share count as dropped too (verl: discarded surplus)
        return RolloutBatch.concat(parts), (scores, extras), {"train/num_gen_batches": num_gen,
                                                              "training/filter_groups/evicted_samples": dropped, **judged}

    def learn(self, batch: RolloutBatch, timer: StageTimer, update_actor: bool = True,
              scored: Scores | None = None) -> StepResult:
        cfg, roles = self.cfg, self.roles
        record_tool_spans(batch)
        ids = batch.sample_ids or []
        SAMPLES.take(ids, now())
        metrics, extra = self.reward_stage(batch, timer, scored)
        baselines = None
        if cfg.algorithm.adv_estimator in NEEDS_GREEDY_BASELINE:
            with timer.stage("gen_max"):
                baselines = self.greedy_baselines(batch)
        behind = (self.version - batch.versions).float()  # [batch] policy versions each sample is behind
        metrics.update({"training/staleness/min": behind.min().item(), "training/staleness/mean": behind.mean().item(),
                        "training/staleness/max": behind.max().item()})
        metrics.update(off_policy_metrics(batch, self.version))
        if self.correction.bypass_mode:
            batch.old_logprobs = batch.rollout_logprobs
        elif self.fuses_old_log_prob(batch):
            metrics["actor/old_log_prob_fused"] = 1.0  # pi_old comes from the update's own forward
        else:
            with timer.stage("old_log_prob"):
                metrics.update(self.compute_old_log_prob(batch))
        if cfg.uses_ref:
            with timer.stage("ref"):
                batch.ref_logprobs = self.compute_ref_log_prob(batch)
        if roles.teacher is not None:
            with timer.stage("teacher"):
                batch.teacher_logprobs, batch.teacher_ids = self.teacher_log_probs(batch)
        if roles.critic is not None:
            with timer.stage("values"):
                batch.values = roles.critic.call(Critic.compute_values, batch)
        with timer.stage("adv"):
            metrics.update(self.compute_advantage(batch, baselines, extra))
        if roles.critic is not None:
            with timer.stage("update_critic"):
                metrics.update(roles.critic.call(Critic.update, batch))
        if update_actor:
            with timer.stage("update_actor"), self.actor_lock:
                actor_metrics = roles.actor.call(Actor.update, batch, self.correction)
                if "actor/entropy" in metrics:  # verl's actor/entropy is the pre-update one, when it was computed
                    actor_metrics.pop("actor/entropy")
                metrics.update(actor_metrics)
        SAMPLES.finish(ids, "consumed", now(), staleness=behind.long().tolist())
        self.ledger.trained(batch)
        metrics.update(data_metrics(batch, cfg.data.max_prompt_length))
        metrics.update(agent_metrics(batch))
        self.say_failed_sessions(batch)
        metrics.update(seqlen_metrics(batch.attention_mask))
        num_tokens = int(batch.attention_mask.sum())
        return StepResult(metrics, num_tokens=num_tokens, response_tokens=int(batch.response_mask.sum()))

    def reward_stage(self, batch: RolloutBatch, timer: StageTimer, scored: Scores | None) -> tuple[dict, dict]:
        """The batch's scores (or those dynamic sampling computed), the judge's share of the stage, and the reward
        function's extra values: (metrics, extra)."""
        metrics: dict[str, float] = {}
        scoring = now()
        with timer.stage("reward"):
            since = time.perf_counter()
            scores, extra = self.score(batch) if scored is None else scored
            if scored is None:
                metrics.update(self.judge_stage(since, timer))
            batch.scores = scores
            batch.token_scores = last_token_scores(scores, batch.response_mask)
            for key, values in extra.items():
                finite = [v for v in values if v == v]
                if finite:
                    metrics[f"reward_extra/{key}/mean"] = sum(finite) / len(finite)
        if scored is None:
            SAMPLES.add_many(batch.sample_ids or [], "reward", scoring, now())
        return metrics, extra

    def say_failed_sessions(self, batch: RolloutBatch) -> None:
        """One line per step naming the agent sessions that failed (each cost its own sample)."""
        sessions = sessions_of(batch.agent_infos)
        failed = [s["failure"] for s in sessions if s["failure"] is not None]
        if failed and self.tracker is not None:
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            self.tracker.note(f"plait: {len(failed)} of {len(sessions)} agent sessions failed, each masked out of the loss: "
                              f"{failed[0]}{more}")

    def fuses_old_log_prob(self, batch: RolloutBatch) -> bool:
        """True when the batch feeds exactly one optimizer step (one mini-batch, one epoch) and nothing
        before the update reads pi_old: pi_old is then the policy about to be updated, so the update's
        own forward gives it (detached) and the separate old_log_prob pass is skipped. Rollout
        correction (IS weights, rejection) works on the whole batch's pi_old, so it keeps the pass."""
        actor, c = self.cfg.actor_rollout_ref.actor, self.correction
        return (actor.ppo_epochs == 1 and actor.ppo_mini_batch_size * self.sampling.n >= len(batch) and not self.keeps_pi_old
                and not self.cfg.algorithm.use_kl_in_reward and c.rollout_is is None and c.rollout_rs is None
                and self.cfg.algorithm.adv_estimator not in NEEDS_SUM_PI_SQUARED)

    def compute_old_log_prob(self, batch: RolloutBatch) -> dict[str, float]:
        r = self.cfg.actor_rollout_ref.rollout
        with_sum_pi_squared = self.cfg.algorithm.adv_estimator in NEEDS_SUM_PI_SQUARED
        old_logp, entropy, *sum_pi_squared = self.roles.actor.call(
            Actor.compute_log_prob, batch, r.log_prob_micro_batch_size_per_gpu,
            r.log_prob_max_token_len_per_gpu if r.log_prob_use_dynamic_bsz else None, with_sum_pi_squared, self.keeps_pi_old)
        batch.old_logprobs, batch.sum_pi_squared = old_logp, (sum_pi_squared or [None])[0]
        mask = batch.response_mask
        metrics = {"actor/entropy": masked_mean(entropy, mask), **rollout_probs_diff(old_logp, batch.rollout_logprobs, mask)}
        c = self.correction  # decoupled mode: weights and rejection of pi_old vs pi_rollout, for the whole batch
        batch.rollout_is_weights, loss_mask, corr_metrics = rollout_correction(
            old_logp, batch.rollout_logprobs, mask, c.rollout_is, c.rollout_is_threshold,
            c.rollout_is_batch_normalize, c.rollout_rs, c.rollout_rs_threshold)
        batch.loss_mask = loss_mask if c.rollout_rs is not None else None
        metrics.update(corr_metrics)
        return metrics

    def compute_ref_log_prob(self, batch: RolloutBatch) -> torch.Tensor:
        if self.roles.ref is None:  # LoRA: the reference is the actor's base model, adapters off
            ref = self.cfg.actor_rollout_ref.ref
            return self.roles.actor.call(Actor.compute_ref_log_prob, batch, ref.log_prob_micro_batch_size_per_gpu,
                                         ref.log_prob_max_token_len_per_gpu if ref.log_prob_use_dynamic_bsz else None)
        return self.roles.ref.call(Ref.compute_ref_log_prob, batch)

    def compute_advantage(self, batch: RolloutBatch, baselines: torch.Tensor | None = None,
                          extra: dict[str, list[float]] | None = None) -> dict[str, float]:
        alg, metrics = self.cfg.algorithm, {}
        components = weights = None
        if alg.adv_estimator == "gdpo":  # the reward's result keys, each normalised within groups
            missing = [k for k in alg.gdpo_reward_keys if k not in (extra or {})]
            if missing:
                raise RunError(f"algorithm.gdpo_reward_keys: the reward function returned no {', '.join(missing)} "
                               f"(it returned: {', '.join(['score', *(extra or {})])})")
            components = torch.tensor([extra[k] for k in alg.gdpo_reward_keys], dtype=torch.float32)  # [k, batch]
            weights = None if alg.gdpo_reward_weights is None else torch.tensor(alg.gdpo_reward_weights)
        if alg.use_kl_in_reward:
            batch.token_rewards, kl_metrics = apply_kl_penalty(
                batch.token_scores, batch.old_logprobs, batch.ref_logprobs, batch.response_mask,
                kl_coef=self.kl_ctrl.value, kind=alg.kl_penalty)
            metrics.update(kl_metrics)
            # verl 0.9.1 advances the adaptive controller by the batch's responses (prompts x n), not prompts
            self.kl_ctrl.update(kl_metrics["actor/reward_kl_penalty"], n_steps=len(batch))
        else:
            batch.token_rewards = batch.token_scores
        owner = session_owners(batch.agent_infos)
        if owner is not None and alg.adv_estimator in PER_RESPONSE:
            batch.advantages = batch.returns = session_advantages(alg.adv_estimator, batch, owner, alg.norm_adv_by_std_in_grpo)
        else:
            batch.advantages, batch.returns = compute_advantages(
                alg.adv_estimator, token_rewards=batch.token_rewards, response_mask=batch.response_mask,
                group_ids=batch.group_ids, values=batch.values, gamma=alg.gamma, lam=alg.lam,
                norm_by_std=alg.norm_adv_by_std_in_grpo, baselines=baselines, components=components,
                component_weights=weights, old_logprobs=batch.old_logprobs, sum_pi_squared=batch.sum_pi_squared,
                is_weights=batch.rollout_is_weights)
        if alg.use_pf_ppo:  # PF-PPO: the step trains on its responses drawn again, weighted by score
            weights = pf_ppo_weights(batch.token_scores.sum(-1), alg.pf_ppo.reweight_method, alg.pf_ppo.weight_pow)
            drawn = batch.select(torch.multinomial(weights, len(batch), replacement=True, generator=self.pf_ppo_rng))
            for f in dataclasses.fields(batch):
                setattr(batch, f.name, getattr(drawn, f.name))
        return metrics


def save_image_processor(model_path: str | None, out: str) -> None:
    """Copy the model folder's image processor config (a VL model's preprocessor_config.json) into `out`."""
    source = os.path.join(model_path or "", "preprocessor_config.json")
    if model_path and os.path.isfile(source):
        shutil.copy2(source, os.path.join(out, "preprocessor_config.json"))


LIVE_AFTER_S = 10.0  # a validation running longer says where it is at each batch
