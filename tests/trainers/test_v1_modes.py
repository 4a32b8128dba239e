"""verl 0.9.1's V1 async modes (trainer.v1.trainer_mode colocate_async / separate_async), end to end on the
tiny model, local backend: what each step trains on (recorded as the trainer takes groups from its buffer),
the sampler's strategies, failure refill, partial rollout, a user sampler, crash and resume, verl's metrics.
Ray: tests/trainers/test_async_modes_ray.py; the sampler's rules alone: tests/trainers/test_sampler.py.
"""

import json
import os
import threading
import time

import pytest
import torch

from plait import driver
from plait.cli import main
from plait.trainers.producer import RolloutError
from plait.trainers.lifecycle import read_metrics
from plait.workers.actor import Actor

torch.set_num_threads(1)

MODES = {"colocate_async": ["trainer.v1.trainer_mode=colocate_async"],
         "separate_async": ["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2"]}
VERL_METRICS = ("training/off_policy/trajectory_spans/mean", "training/off_policy/trajectory_staleness/max",
                "training/off_policy/trajectory_staleness_worst/min", "timing_s/gen", "timing_s/update_weights",
                "training/global_step", "training/epoch")


def build(tiny_config, out, *overrides):
    """A lifecycle whose trainer records each batch it learns from: (step, the issue step of each group,
    the groups' uids, their data rows), groups in the order taken."""
    lifecycle = driver.build(tiny_config(out, *overrides), progress=False)
    trainer, taken, issued = lifecycle.trainer, [], {}
    add, learn = trainer.buffer.add, trainer.learn

    def adding(prompt, step, batch=None):
        group = add(prompt, step, batch)
        issued[group.uid] = (group.issued, prompt.indices[0])
        return group

    def recording(batch, timer, *rest):
        uids = list(dict.fromkeys(batch.group_ids.tolist()))
        taken.append((trainer.global_steps, [issued[u][0] for u in uids], uids, [issued[u][1] for u in uids]))
        return learn(batch, timer, *rest)
    trainer.buffer.add, trainer.learn = adding, recording
    return lifecycle, taken


def our_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("plait-")}


@pytest.mark.parametrize("mode", MODES)
def test_v1_mode_trains_each_group_once_with_verls_metrics(tmp_path, tiny_config, mode):
    lifecycle, taken = build(tiny_config, tmp_path, *MODES[mode], "trainer.total_training_steps=4")
    trainer = lifecycle.trainer
    assert trainer.cfg.trainer.mode == mode and trainer.cfg.trainer.placement == (
        "separated" if mode == "separate_async" else "colocated")
    before = {k: v.clone() for k, v in trainer.roles.actor.call(Actor.state_dict).items()}
    lifecycle.run()
    assert any(not torch.equal(before[k], v) for k, v in trainer.roles.actor.call(Actor.state_dict).items())
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    assert all(key in r for r in records[1:] for key in VERL_METRICS)
    updates = 1 if mode == "colocate_async" else 2
    assert [step for step, *_ in taken] == [s for s in (1, 2, 3, 4) for _ in range(updates)]
    assert all(len(uids) == 4 // updates for _, _, uids, _ in taken)
    uids = [u for _, _, us, _ in taken for u in us]
    assert len(uids) == len(set(uids)) == 16  # every group trained once
    # the warmup batch (4 prompts, issued with step 1) runs the buffer one batch ahead: step N takes what step N-1 issued
    assert [issued for step, issued, *_ in taken if step == 4] == [[3] * (4 // updates)] * updates
    assert all(r["training/off_policy/trajectory_staleness/min"] >= 0 for r in records[1:])
    assert lifecycle.trainer.roles.rollout.call(lambda r: r.version) == 4
    assert our_threads() == set()


def test_drop_evicts_groups_past_the_threshold_and_trains_only_fresh_ones(tmp_path, tiny_config):
    """Threshold 1: only groups issued in the step itself may be trained; the warmup's second batch and
    everything issued a step earlier is evicted and replaced by fresh prompts."""
    lifecycle, taken = build(tiny_config, tmp_path, *MODES["separate_async"], "trainer.v1.separate_async.num_warmup_batches=2",
                             "trainer.v1.sampler.max_off_policy_threshold=1", "trainer.total_training_steps=3",
                             "trainer.test_freq=-1")
    lifecycle.run()
    assert all(set(issued) == {step} for step, issued, *_ in taken)  # span 1 only
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    evicted = [r.get("training/off_policy/evicted_samples", 0) for r in records]
    assert sum(evicted) > 0 and all(r.get("training/off_policy/evicted_samples_staleness/min", 2) == 2 for r in records)


def test_wait_never_evicts_and_trains_every_issued_group_in_order(tmp_path, tiny_config):
    lifecycle, taken = build(tiny_config, tmp_path, *MODES["colocate_async"], "trainer.v1.sampler.max_off_policy_strategy=wait",
                             "trainer.v1.sampler.max_off_policy_threshold=2", "trainer.total_training_steps=4",
                             "trainer.test_freq=-1")
    lifecycle.run()
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert not any("training/off_policy/evicted_samples" in r for r in records)
    issued = [i for _, batch, *_ in taken for i in batch]
    assert issued == sorted(issued) and all(step - i + 1 <= 2 for step, batch, *_ in taken for i in batch)


def test_a_failed_generate_call_is_refilled(tmp_path, tiny_config):
    lifecycle, taken = build(tiny_config, tmp_path, *MODES["separate_async"], "trainer.total_training_steps=3",
                             "trainer.test_freq=-1", "data.gen_batch_size=2")
    worker = lifecycle.trainer.roles.rollout.worker
    real, calls = worker._generate, []

    def failing_once(*args):
        calls.append(1)
        if len(calls) == 2:
            raise ValueError("injected generate failure")
        return real(*args)
    worker._generate = failing_once
    lifecycle.run()
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert sum(r.get("training/rollout_failure/evicted_samples", 0) for r in records) == 2
    assert [r["step"] for r in records] == [1, 2, 3]


def test_a_rollout_that_keeps_failing_stops_the_run_with_one_error(tmp_path, tiny_config):
    lifecycle, _ = build(tiny_config, tmp_path, *MODES["colocate_async"], "trainer.total_training_steps=4",
                         "trainer.test_freq=-1")
    worker = lifecycle.trainer.roles.rollout.worker

    def broken(*args):
        raise ValueError("engine gone")
    worker._generate = broken
    start = time.perf_counter()
    with pytest.raises(RolloutError, match="engine gone"):
        lifecycle.run()
    assert time.perf_counter() - start < 30 and our_threads() == set()


def test_partial_rollout_spans_two_versions_and_colocate_never_generates_while_training(tmp_path, tiny_config):
    """Long responses decoded slowly: colocate_async's pause at the end of sampling cuts the running generate,
    which resumes with the next version (trajectory_spans 2); no generate or resume span of the rollout
    overlaps the trainer's training stages."""
    lifecycle, _ = build(tiny_config, tmp_path, *MODES["colocate_async"], "data.max_response_length=24",
                         "actor_rollout_ref.rollout.ignore_eos=true", "trainer.total_training_steps=6",
                         "trainer.test_freq=-1", "data.gen_batch_size=2", "trainer.v1.colocate_async.num_warmup_batches=1.5")
    trainer, engine = lifecycle.trainer, lifecycle.trainer.roles.rollout.worker.engine
    mid, generate = threading.Event(), engine.generate

    def slow_generate(*args, on_forward=None, **kwargs):
        def step(i):  # before each decode step's forward: slow; past the 3rd token the call is mid-generation
            if i >= 3:
                mid.set()
            time.sleep(0.01)
            if on_forward is not None:
                on_forward(i)
        try:
            return generate(*args, on_forward=step, **kwargs)
        finally:
            mid.clear()
    engine.generate = slow_generate
    sample = trainer.sampler.sample

    def while_generating(*args):
        # as in verl, where every issued group is in flight at once, more groups are being generated when the
        # step's batch is ready: the pause then cuts one (on its own the rollouter may be between two calls)
        got = sample(*args)
        mid.wait(timeout=2)
        return got
    trainer.sampler.sample = while_generating
    lifecycle.run()
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert max(r["training/off_policy/trajectory_spans/max"] for r in records) >= 2  # cut once, or again next step
    assert max(r["response_length/max"] for r in records) <= 24
    spans = [json.loads(line) for line in open(os.path.join(tmp_path, "timeline.jsonl"))]
    gen = [(s["start"], s["end"]) for s in spans if s["role"] == "rollout" and s["stage"] in ("generate", "resume")]
    train = [(s["start"], s["end"]) for s in spans if s["role"] == "trainer"
             and s["stage"] in ("reward", "old_log_prob", "adv", "update_actor")]
    assert gen and train
    assert not [(g, t) for g in gen for t in train if g[0] < t[1] - 1e-3 and t[0] < g[1] - 1e-3]


def test_a_user_sampler_with_verls_signature(tmp_path, tiny_config):
    (tmp_path / "newest.py").write_text(
        "from plait.trainers.sampler import ReplayBufferAsync, oldest\n"
        "class NewestFirst(ReplayBufferAsync):\n"
        "    def __init__(self, *, sampler_kwargs, **kwargs):\n"
        "        super().__init__(sampler_kwargs=sampler_kwargs, **kwargs)\n"
        "        self.tag = sampler_kwargs['tag']\n"
        "    def ready(self, global_steps, batch_size):\n"
        "        finished = self.buffer.with_status('finished')\n"
        "        if len(finished) < batch_size or self.buffer.with_status('pending', 'running'):\n"
        "            return None\n"
        "        return sorted(finished, reverse=True)[:batch_size]\n")
    lifecycle, taken = build(tiny_config, tmp_path / "run", *MODES["colocate_async"], "trainer.total_training_steps=3",
                             "trainer.test_freq=-1", f"trainer.v1.sampler.custom_sampler.path={tmp_path / 'newest.py'}",
                             "trainer.v1.sampler.custom_sampler.name=NewestFirst", "+trainer.v1.sampler.sampler_kwargs.tag=x")
    assert type(lifecycle.trainer.sampler).__name__ == "NewestFirst" and lifecycle.trainer.sampler.tag == "x"
    lifecycle.run()
    assert [issued for _, issued, *_ in taken] == [[1] * 4, [2] * 4, [3] * 4]  # the newest, not the warmup's


def test_a_user_sampler_that_does_not_import_is_one_line(tmp_path, tiny_config, capsys):
    (tmp_path / "verl_sampler.py").write_text("from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync\n")
    code = main(["config", "show", "trainer.v1.trainer_mode=colocate_async",
                 f"trainer.v1.sampler.custom_sampler.path={tmp_path / 'verl_sampler.py'}",
                 "trainer.v1.sampler.custom_sampler.name=Mine"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("plait: config error")]
    assert code == 2 and len(lines) == 1 and "trainer.v1.sampler.custom_sampler.path" in lines[0] and "verl" in lines[0]


@pytest.mark.parametrize("mode", MODES)
def test_crash_and_resume_trains_every_step_once(tmp_path, tiny_config, mode):
    """A run that fails in step 3 resumes from step 2's checkpoint: steps 3 and 4 train once each, the finished
    groups the checkpoint held are trained, not generated again, and the in-flight ones are issued again."""
    common = [*MODES[mode], "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1",
              "data.gen_batch_size=2", f"trainer.default_local_dir={tmp_path}"]
    lifecycle, _ = build(tiny_config, tmp_path, *common)
    trainer, learn = lifecycle.trainer, lifecycle.trainer.learn

    def crash_in_step_3(batch, timer, *rest):
        if trainer.global_steps == 3:
            raise KeyboardInterrupt
        out = learn(batch, timer, *rest)
        if trainer.global_steps == 2:  # a finished group in step 2's checkpoint, however loaded the machine is
            trainer.rollouter.pause(False)
            deadline = time.time() + 120
            while time.time() < deadline:
                with trainer.buffer.cond:
                    if trainer.buffer.with_status("finished"):
                        break
                time.sleep(0.01)
            if trainer.colocated:
                trainer.rollouter.pause(True)
        return out
    trainer.learn = crash_in_step_3
    with pytest.raises(KeyboardInterrupt):
        lifecycle.run()
    saved = torch.load(tmp_path / "checkpoints" / "global_step_2" / "groups.pt", weights_only=True)
    finished = {g["index"] for g in saved if g["batch"] is not None}
    in_flight = {g["index"] for g in saved if g["batch"] is None}
    assert finished and our_threads() == set()
    resumed, taken = build(tiny_config, tmp_path, *common)
    generated = []
    generate = resumed.trainer.roles.rollout.worker._generate
    resumed.trainer.roles.rollout.worker._generate = lambda prompts, *a: generated.extend(prompts.indices) or generate(prompts, *a)
    resumed.run()
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [step for step, *_ in taken] == [s for s in (3, 4) for _ in range(1 if mode == "colocate_async" else 2)]
    trained = {i for *_, indices in taken for i in indices}
    assert finished <= trained and not finished & set(generated)  # trained as saved, never generated again
    assert in_flight <= set(generated)                             # issued again
    assert len(trained) == sum(len(indices) for *_, indices in taken)


def test_v1_guide_command_lines(tmp_path, tiny_config):
    """docs/advance/v1_async_trainer.md's overrides (its colocate_async line; its separate_async line with the
    batch sizes kept, GPU counts machinery here and one rollout node, the most plait's rollout takes) train two steps."""
    colocate = ["trainer.use_v1=True", "trainer.v1.trainer_mode=colocate_async", "trainer.v1.colocate_async.num_warmup_batches=1"]
    separate = ["trainer.use_v1=True", "trainer.v1.trainer_mode=separate_async", "trainer.nnodes=2", "trainer.n_gpus_per_node=8",
                "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=8",
                "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "data.train_batch_size=64",
                "actor_rollout_ref.actor.ppo_mini_batch_size=16", "trainer.v1.separate_async.parameter_sync_step=4",
                "trainer.v1.separate_async.num_warmup_batches=1"]
    for name, line in (("colocate", colocate), ("separate", separate)):
        out = tmp_path / name
        lifecycle = driver.build(tiny_config(out, *line, "trainer.total_training_steps=2", "trainer.test_freq=-1",
                                             "data.train_size=256", "actor_rollout_ref.rollout.n=2"), progress=False)
        lifecycle.run()
        assert [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))] == [1, 2]


def test_config_rules(tmp_path, tiny_config, capsys):
    def refused(*overrides):
        code = main(["config", "show", *overrides])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("plait: config error")]
        assert code == 2 and lines, lines
        return lines[0]
    assert "enable_switch" in refused("trainer.v1.trainer_mode=separate_async",
                                      "trainer.v1.separate_async.hybrid_rollout.enable_switch=true")
    assert "parameter_sync_step" in refused("trainer.v1.trainer_mode=separate_async", "data.train_batch_size=8",
                                            "actor_rollout_ref.actor.ppo_mini_batch_size=4")
    assert "trainer.mode" in refused("trainer.v1.trainer_mode=separate_async", "trainer.mode=fully_async")
    assert "max_off_policy_strategy" in refused("trainer.v1.sampler.max_off_policy_strategy=keep")
    assert "filter_groups" in refused("trainer.v1.trainer_mode=colocate_async", "algorithm.filter_groups.enable=true")
    assert main(["config", "show", "trainer.use_v1=false", "trainer.v1.trainer_mode=colocate_async"]) == 0
    assert "has no effect with trainer.use_v1=false" in capsys.readouterr().err
    cfg = tiny_config(tmp_path, "trainer.v1.trainer_mode=colocate_async", "transfer_queue.enable=true",
                      "trainer.v1.separate_async.hybrid_rollout.switch_threshold_ratio=0.5")
    assert cfg.trainer.mode == "colocate_async"
    said = capsys.readouterr().err
    assert "transfer_queue.enable" in said and "switch_threshold_ratio" in said
