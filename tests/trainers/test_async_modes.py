"""Separated, one-step-off and fully async modes on the local backend, end to end on the tiny model.

Every consumed batch is recorded by wrapping the trainer's `learn`: each sample's version against
the trainer's version at consumption (the staleness bound), and each (prompt, sample) pair (none
lost or duplicated between rollouter and trainer). Stops are checked with threading.enumerate().
"""

import itertools
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from plait import driver
from plait.config import load_config
from plait.configtree import ConfigError
from plait.data.dataset import iterate_batches
from plait.models import create_tiny_model, load_tokenizer
from plait.config import SamplingConfig
from plait.errors import RunError
from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig
from plait.trainers.lifecycle import read_metrics
from plait.trainers.producer import RolloutError
from plait.types import PromptBatch
from plait.workers.actor import Actor
from plait.workers.rollout import Rollout

torch.set_num_threads(1)

FULLY_ASYNC = ["trainer.mode=fully_async", "async_training.trigger_parameter_sync_step=2",
               "async_training.staleness_threshold=1"]
MODES = {"sync": ["trainer.mode=sync"], "one_step_off": ["trainer.mode=one_step_off"], "fully_async": FULLY_ASYNC}


@dataclass
class Consumed:
    trainer_version: int
    versions: list[int]
    groups: list[int]


def build(tiny_config, out, *overrides):
    """A lifecycle whose trainer records every batch it learns from."""
    lifecycle = driver.build(tiny_config(out, "trainer.placement=separated", *overrides), progress=False)
    trainer, seen = lifecycle.trainer, []
    learn = trainer.learn

    def recording(batch, timer, *rest):
        seen.append(Consumed(trainer.version, batch.versions.tolist(), batch.group_ids.tolist()))
        return learn(batch, timer, *rest)
    trainer.learn = recording
    return lifecycle, seen


def our_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("plait-")}


@pytest.mark.parametrize("mode", MODES)
def test_mode_trains_with_bounded_staleness_and_every_sample_once(tmp_path, tiny_config, mode):
    lifecycle, seen = build(tiny_config, tmp_path, *MODES[mode])
    actor = lifecycle.trainer.roles.actor
    before = {k: v.clone() for k, v in actor.call(Actor.state_dict).items()}
    lifecycle.run()
    assert any(not torch.equal(before[k], v) for k, v in actor.call(Actor.state_dict).items())
    assert our_threads() == set()
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert [r["training/policy_version"] for r in records[1:]] == [1, 2, 3]
    assert lifecycle.trainer.roles.rollout.call(lambda r: r.version) == 3

    behind = [[c.trainer_version - v for v in c.versions] for c in seen]
    if mode == "sync":
        assert all(b == 0 for row in behind for b in row)
    elif mode == "one_step_off":  # step 1 is generated on-policy, then every sample is exactly one behind
        assert set(behind[0]) == {0} and all(set(row) == {1} for row in behind[1:])
    else:  # staleness_threshold=1: at most one version behind, and the run did get ahead
        assert all(0 <= b <= 1 for row in behind for b in row)
        assert any(b == 1 for row in behind for b in row)
        assert len(seen) == 3 * 2  # trigger_parameter_sync_step local updates per step
    for key in ("training/staleness/min", "training/staleness/mean", "training/staleness/max", "perf/samples_per_s"):
        assert all(key in r for r in records[1:]), key
    if mode != "sync":
        for key in ("trainer/idle_ratio", "rollouter/idle_ratio", "timing_s/param_sync", "rollout_corr/rollout_is_mean"):
            assert all(key in r for r in records[1:]), key
        assert all(0 <= r["trainer/idle_ratio"] <= 1 and 0 <= r["rollouter/idle_ratio"] <= 1 for r in records[1:])
        assert max(r["training/staleness/max"] for r in records[1:]) == max(max(row) for row in behind)

    # every prompt the trainer consumed appears with exactly rollout.n samples, in the data order
    counts = Counter(g for c in seen for g in c.groups)
    assert set(counts.values()) == {4}
    assert sum(counts.values()) == 3 * 4 * 4  # 3 steps x 4 prompts x n=4, whatever the mode
    cursor = lifecycle.trainer.cursor
    first = list(dict.fromkeys(g for c in seen for g in c.groups))
    order = [b[0].index for b in iterate_batches(cursor.dataset, 1, cursor.shuffle, cursor.seed, epoch=0)]
    assert first == order[:len(first)]


def test_partial_rollouts_resume_with_the_new_weights(tmp_path, tiny_config):
    """Long responses, so syncs land while the rollouter is generating: those samples are aborted,
    finished with the new weights, tagged with that version, and still within the staleness bound."""
    lifecycle, seen = build(tiny_config, tmp_path, "trainer.mode=fully_async", "async_training.staleness_threshold=1",
                            "data.max_response_length=40", "actor_rollout_ref.rollout.ignore_eos=true",
                            "trainer.total_training_steps=5", "trainer.test_freq=-1")
    trainer, engine = lifecycle.trainer, lifecycle.trainer.roles.rollout.worker.engine
    decoding, generate, sync = threading.Event(), engine.generate, trainer.after_update

    class Armed(threading.Event):
        def clear(self):  # the engine clears a stale abort as it starts: from here on an abort counts
            super().clear()
            decoding.set()

    def generate_flagged(*args, **kwargs):
        try:
            return generate(*args, **kwargs)
        finally:
            decoding.clear()

    def sync_mid_generate(step, timer):
        # Timing alone decided whether a sync met a running generate (40 tokens, no EOS): meet one.
        decoding.wait(timeout=5)
        return sync(step, timer)
    engine._abort, engine.generate, trainer.after_update = Armed(), generate_flagged, sync_mid_generate
    # Decode slower than the trainer updates (the rollout's own model copy), so the rollouter is still
    # generating when a sync comes instead of already waiting on capacity, whatever the machine's speed.
    engine.model.register_forward_pre_hook(lambda module, args: time.sleep(0.02))
    lifecycle.run()
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert sum(r["fully_async/partial/partial_ratio"] for r in records) > 0
    assert all(0 <= c.trainer_version - v <= 1 for c in seen for v in c.versions)
    assert max(r["response_length/max"] for r in records) <= 40
    assert our_threads() == set()


def test_staleness_zero_is_on_policy_and_the_pause_rule_holds(tmp_path, tiny_config):
    """staleness_threshold=0: the rollouter stops at one sync period of prompts, so every sample is
    generated with the weights the trainer starts the step from, and the queue never holds more."""
    lifecycle, seen = build(tiny_config, tmp_path, "trainer.mode=fully_async", "async_training.require_batches=2",
                            "async_training.gen_batch_size=1", "trainer.test_freq=-1")
    trainer, depths = lifecycle.trainer, []
    take = trainer.next_batch

    def watched(step, timer):
        with trainer.chunks.cond:
            depths.append(trainer.chunks.queued + trainer.chunks.in_flight)
        return take(step, timer)
    trainer.next_batch = watched
    lifecycle.run()
    assert all(v == c.trainer_version for c in seen for v in c.versions)
    assert trainer.chunks.max_samples == 4 and max(depths) <= 4


def test_resume_continues_exactly(tmp_path, tiny_config):
    """Resuming from step 2's checkpoint of a 4-step run reproduces steps 3 and 4: one_step_off saves
    the batch it generated ahead, fully_async (staleness 0) the data position the trainer consumed."""
    for mode, extra in (("one_step_off", []), ("fully_async", ["async_training.trigger_parameter_sync_step=2"])):
        common = [f"trainer.mode={mode}", *extra, "trainer.total_training_steps=4", "trainer.save_freq=2",
                  "trainer.test_freq=-1"]
        full, part = tmp_path / mode / "full", tmp_path / mode / "part"
        build(tiny_config, full, *common)[0].run()
        resumed, seen = build(tiny_config, part, *common, "trainer.resume_mode=resume_path",
                              f"trainer.resume_from_path={full / 'checkpoints' / 'global_step_2'}")
        resumed.run()
        if mode == "one_step_off":
            assert {seen[0].trainer_version - v for v in seen[0].versions} == {1}  # still one step off
        strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("timing", "perf/", "memory/", "trainer/", "rollouter/"))}  # noqa: E731
        a, b = (read_metrics(os.path.join(d, "metrics.jsonl")) for d in (full, part))
        assert [r["step"] for r in b] == [3, 4]
        for x, y in zip(a[2:], b):
            assert strip(x) == pytest.approx(strip(y), rel=1e-5, abs=1e-6), mode


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_a_failing_generate_in_the_rollout_thread_is_a_clear_error(tmp_path, tiny_config, mode):
    lifecycle, _ = build(tiny_config, tmp_path, *MODES[mode], "trainer.total_training_steps=6", "trainer.test_freq=-1")
    worker = lifecycle.trainer.roles.rollout.worker
    real, calls = worker._generate, itertools.count()

    def failing(*args):
        if next(calls) == 2:
            raise ValueError("injected generate failure")
        return real(*args)
    worker._generate = failing
    start = time.perf_counter()
    with pytest.raises(RolloutError, match="injected generate failure") as info:
        lifecycle.run()
    assert time.perf_counter() - start < 30
    assert isinstance(info.value.__cause__, ValueError)
    assert our_threads() == set()
    assert not (tmp_path / "checkpoints" / "global_step_6").exists()


@pytest.mark.parametrize("mode", ["one_step_off", "fully_async"])
def test_a_trainer_failure_stops_the_rollout_thread(tmp_path, tiny_config, mode):
    """The reward raises on the main thread in step 2, while the next batch is being generated:
    that error surfaces, the generation is aborted and discarded, and no thread is left."""
    (tmp_path / "reward.py").write_text("calls = 0\n"
                                        "def boom(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    global calls\n    calls += 1\n"
                                        "    if calls > 8 * 3:\n        raise KeyError('reward failed')\n"
                                        "    return 0.0\n")
    lifecycle, _ = build(tiny_config, tmp_path / "run", *MODES[mode], "trainer.total_training_steps=6",
                         "trainer.test_freq=-1", f"custom_reward_function.path={tmp_path / 'reward.py'}",
                         "custom_reward_function.name=boom", "reward.num_workers=1")
    with pytest.raises(RunError, match="raised KeyError: 'reward failed'"):
        lifecycle.run()
    assert our_threads() == set()


def test_rollout_resume_continues_a_cut_generation(tmp_path):
    """Greedy: a generation cut after 2 tokens and resumed equals the uncut one; the kept tokens keep
    their log-probs and the resumed rows take the worker's current version."""
    model = create_tiny_model(tmp_path / "m", size="xs", seed=0)
    session = ProfilerSession(GlobalProfilerConfig(), {"rollout": RoleProfilerConfig()}, rank=0)
    tok = load_tokenizer(model)
    rollout = Rollout(model, 8, tok, session.for_role("rollout"))
    prompts = PromptBatch(prompt_ids=[tok.encode("1+2="), tok.encode("33+4=")], data_sources=["a", "a"],
                          ground_truths=["3", "37"], extra_infos=[{}, {}], indices=[0, 1])
    greedy = SamplingConfig(n=2, do_sample=False)
    whole = rollout.generate(prompts, greedy, seed=0)
    cut = whole.replace(responses=whole.responses[:, :2], response_mask=whole.response_mask[:, :2],
                        rollout_logprobs=whole.rollout_logprobs[:, :2] + 0.5,  # marks the kept log-probs
                        stop_reasons=["aborted", "eos", "aborted", "aborted"])
    cut.response_mask[1, 1:] = 0
    rollout.version = 7
    done = rollout.resume(cut, greedy, seed=0)
    for i in (0, 2, 3):
        n = int(whole.response_mask[i].sum())
        assert done.responses[i, :n].tolist() == whole.responses[i, :n].tolist()
        assert done.stop_reasons[i] == whole.stop_reasons[i]
        assert torch.allclose(done.rollout_logprobs[i, :2], whole.rollout_logprobs[i, :2] + 0.5)
        assert torch.allclose(done.rollout_logprobs[i, 2:n], whole.rollout_logprobs[i, 2:n], atol=1e-4)
    assert done.versions.tolist() == [7, 0, 7, 7]
    assert done.stop_reasons[1] == "eos" and int(done.response_mask[1].sum()) == 1


def test_config_rules(tmp_path):
    base = ["demo.model_size=xs"]
    for mode in ("one_step_off", "fully_async"):
        with pytest.raises(ConfigError, match="trainer.placement.*separated"):
            load_config(None, [*base, f"trainer.mode={mode}"])
        cfg = load_config(None, [*base, f"trainer.mode={mode}", "trainer.placement=separated"])
        assert cfg.algorithm.rollout_correction.rollout_is == "token"
    assert load_config(None, [*base, "trainer.placement=separated"]).algorithm.rollout_correction.rollout_is is None
    with pytest.raises(ConfigError, match="async_training.gen_batch_size"):
        load_config(None, [*base, "trainer.mode=fully_async", "trainer.placement=separated",
                           "async_training.gen_batch_size=3"])
    with pytest.raises(ConfigError, match="staleness_threshold"):
        load_config(None, [*base, "async_training.staleness_threshold=-1"])
    with pytest.raises(ConfigError, match="rollout_is"):
        load_config(None, [*base, "algorithm.rollout_correction.rollout_is=tokens"])
    with pytest.raises(ConfigError, match="rollout.profiler.tool_config.torch.discrete"):
        load_config(None, [*base, "trainer.mode=one_step_off", "trainer.placement=separated", "global_profiler.tool=torch",
                           "actor_rollout_ref.rollout.profiler.enable=true",
                           "actor_rollout_ref.rollout.profiler.tool_config.torch.discrete=true"])


def test_fully_async_generation_overlaps_update_actor_on_the_local_backend(tmp_path, tiny_config):
    """The local twin of the Ray backend's overlap test (test_async_modes_ray.py): the rollouter is a
    thread of the driver, and with staleness_threshold=1 it generates the batch of the step after next
    while the trainer updates on this one. On the merged clock of timeline.jsonl some generate span
    overlaps update_actor in steps 2 and 3 (a property of the schedule: right after each sync the
    rollouter may start, and 48 decode calls outlast the stages before the update). Step 1 warms up;
    step 4 has nothing left to generate."""
    from plait.profiler.timeline import ROLLOUT_WORK, overlap_s, read_timeline
    lifecycle, _ = build(tiny_config, tmp_path, *FULLY_ASYNC, "trainer.placement=separated",
                         "trainer.total_training_steps=4", "data.max_response_length=48",
                         "trainer.test_freq=-1", "trainer.val_before_train=false")
    lifecycle.run()
    spans = read_timeline(os.path.join(tmp_path, "timeline.jsonl"))
    overlap = overlap_s(spans, "update_actor", ROLLOUT_WORK)
    print("overlap s per step:", overlap)
    assert sorted(overlap) == [1, 2, 3, 4]
    assert overlap[2] > 0 and overlap[3] > 0, overlap
