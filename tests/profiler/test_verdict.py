"""The verdict's rules, one by one, on small synthetic facts (medians a run would have recorded):
each fires on its planted cause with the right key and a bound computed from the measured parts,
and stays silent just below its threshold or without a cause; the ranking keeps one line per key."""

import json
import os

import pytest

from plait.profiler.analysis import verdict as V
from plait.profiler.analysis.accounting import StepTime
from plait.profiler.timeline import read_timeline

SYNC = {"trainer.mode": "sync", "trainer.placement": "colocated", "data.train_batch_size": 8,
        "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 32, "actor_rollout_ref.actor.ppo_epochs": 1,
        "actor_rollout_ref.actor.use_dynamic_bsz": False, "actor_rollout_ref.model.use_remove_padding": True,
        "actor_rollout_ref.model.enable_gradient_checkpointing": False, "reward.num_workers": 0,
        "reward.custom_reward_function.path": None, "trainer.test_freq": 5, "trainer.save_freq": 10,
        "global_profiler.steps": None, "memory_capacity_gb": 80.0}


def facts(seconds: dict, settings=None, metrics=None, wall=None, rollouter=None, busy=0.0, peak=None) -> V.Facts:
    """Facts of a steady run whose every step spends `seconds` per trainer part."""
    step = sum(seconds.values())
    return V.Facts(steps=4, step_s=step, trainer={k: v / step for k, v in seconds.items()}, trainer_s=dict(seconds),
                   rollouter=rollouter or {}, rollout_busy_s=busy, metrics=metrics or {}, wall=wall or {},
                   settings={**SYNC, **(settings or {})}, memory_peak=peak)


BALANCED = {"gen": 1.0, "reward": 0.3, "old_log_prob": 1.0, "adv": 0.1, "update_actor": 3.0, "update_weights": 0.2,
            "log": 0.05, "unattributed": 0.05}


def test_a_balanced_run_gets_no_verdict():
    assert V.verdicts(facts(BALANCED)) == []


def test_generation_bound_sync_run_is_told_to_overlap_with_the_bound():
    f = facts({**BALANCED, "gen": 5.0})
    v = V.generation_bound(f)
    assert (v.where, v.key, v.value) == ("gen (rollout)", "trainer.mode", "one_step_off")
    train = 0.3 + 1.0 + 0.1 + 3.0 + 0.2
    assert v.predicted["step_s"] == pytest.approx(f.step_s - min(5.0, train))  # the overlap hides the shorter side
    assert "32 responses per step" in v.driver
    assert V.verdicts(f)[0].rule == "generation_bound"
    assert V.generation_bound(facts({**BALANCED, "gen": 2.0})) is None  # 2.0 / 6.7: below GEN_SHARE, overlap hides 30 %-
    training = V.generation_bound(facts({**BALANCED, "gen": 3.0}))    # 3.0 / 7.7 < GEN_SHARE, but overlap hides 39 %
    assert (training.rule, training.where, training.key) == ("training_bound", "training (reward to update_actor)", "trainer.mode")
    assert V.generation_bound(facts({**BALANCED, "gen": 5.0}, {"trainer.mode": "one_step_off"})) is None


def test_the_overlap_prediction_adds_the_old_log_prob_pass_and_counts_the_cpus_both_sides_need():
    """Measured on SmolLM2 (2 CPUs, 2 torch threads): a sync run without an old_log_prob pass (one on-policy update),
    gen 5.5 s and training 11.5 s of a 17 s step, was told one_step_off would take about 11.5 s; it took 19.7 s: the
    mode ran an old_log_prob forward (6.8 s) and both sides shared the 2 cores. The prediction now counts both."""
    fused = {"gen": 5.5, "reward": 0.1, "update_actor": 11.3, "update_weights": 0.1}
    added = 11.3 / V.UPDATE_OVER_FORWARD  # the forward one_step_off needs for pi_old
    # even with CPUs to spare, 11.5 + 3.8 s of training against 17 s saves 10 %, under OVERLAP_SAVING: nothing said
    assert V.generation_bound(facts(fused, {"device": "cpu", "cpus": 16, "trainer.num_threads": 2})) is None
    v = V.generation_bound(facts({**fused, "gen": 12.0}, {"device": "cpu", "cpus": 16, "trainer.num_threads": 2}))
    assert v.inputs["old_log_prob_added_s"] == pytest.approx(added)
    assert v.predicted["step_s"] == pytest.approx(11.5 + added)  # the training side, now the longer
    assert any("old_log_prob pass one_step_off needs" in e for e in v.evidence)
    assert V.generation_bound(facts({**fused, "gen": 12.0, "old_log_prob": 3.0})).inputs["old_log_prob_added_s"] == 0
    # the same run on 2 CPUs at 2 threads a side: (gen + training) x 2 / 2, no faster than serial: nothing said
    assert V.generation_bound(facts(fused, {"device": "cpu", "cpus": 2, "trainer.num_threads": 2})) is None
    # at 1 thread a side the 2 CPUs hold both: the longer side bounds the step
    one = V.generation_bound(facts({**BALANCED, "gen": 5.0}, {"device": "cpu", "cpus": 2, "trainer.num_threads": 1}))
    assert one.predicted["step_s"] == pytest.approx(5.0 + 0.1)  # gen, and the lifecycle's parts
    # between: 4 CPUs at 3 threads a side, (5 + 4.6) x 3 / 4 = 7.2 s bounds it, said in the evidence
    three = V.generation_bound(facts({**BALANCED, "gen": 5.0}, {"device": "cpu", "cpus": 4, "trainer.num_threads": 3}))
    assert three.predicted["step_s"] == pytest.approx((5.0 + 4.6) * 3 / 4 + 0.1)
    assert "both sides share the cores" in three.evidence[-1]


def test_an_old_log_prob_pass_that_recomputes_the_rollouts_log_probs_is_told_bypass_mode():
    """The demo (measured): old_log_prob 22 % of a 0.155 s step while the rollout's probabilities matched the actor's
    to 7e-7; with bypass mode the rerun's step was 0.118 s against the 0.121 s predicted."""
    demo = {"gen": 0.026, "reward": 0.003, "old_log_prob": 0.034, "adv": 0.001, "update_actor": 0.079,
            "update_weights": 0.003, "log": 0.002, "unattributed": 0.007}
    close = {"training/rollout_probs_diff_max": 7e-7}
    v = V.old_log_prob_bypass(facts(demo, metrics=close))
    assert (v.where, v.key, v.value) == ("old_log_prob", "algorithm.rollout_correction.bypass_mode", True)
    assert v.predicted["step_s"] == pytest.approx(0.155 - 0.034) and v.saving == pytest.approx(0.034 / 0.155)
    assert [x.rule for x in V.verdicts(facts(demo, metrics=close))] == ["old_log_prob_bypass"]
    # not when the rollout's numbers differ (a bf16 engine: pi_old would change), nor async (pi_old is not the
    # rollout's policy there), nor already on, nor with an estimator that needs the pass, nor without the metric
    assert V.old_log_prob_bypass(facts(demo, metrics={"training/rollout_probs_diff_max": 3e-3})) is None
    for settings in ({"trainer.mode": "one_step_off"}, {"algorithm.rollout_correction.bypass_mode": True},
                     {"algorithm.adv_estimator": "optimal_token_baseline"}):
        assert V.old_log_prob_bypass(facts(demo, settings, close)) is None, settings
    assert V.old_log_prob_bypass(facts(demo)) is None
    assert V.old_log_prob_bypass(facts({**demo, "old_log_prob": 0.015}, metrics=close)) is None  # 11 %: under 15 %


ASYNC = {"trainer.mode": "fully_async", "async_training.staleness_threshold": 0,
         "async_training.trigger_parameter_sync_step": 1, "actor_rollout_ref.rollout.n_gpus_per_node": 2,
         "trainer.n_gpus_per_node": 4}
TRAIN = {"reward": 0.2, "old_log_prob": 1.0, "update_actor": 2.6, "param_sync": 0.2}


def test_async_idle_pair_reads_verl_7601s_table():
    both = facts({**TRAIN, "wait_rollout": 3.5}, ASYNC, {"trainer/idle_ratio": 0.45, "rollouter/idle_ratio": 0.5}, busy=3.9)
    v = V.async_idle(both)
    assert (v.rule, v.key, v.value) == ("async_both_idle", "async_training.staleness_threshold", 1)
    assert v.predicted["step_s"] == pytest.approx(max(4.0, 3.9))
    stale = facts({**TRAIN, "wait_rollout": 3.5}, {**ASYNC, "async_training.staleness_threshold": 1},
                  {"trainer/idle_ratio": 0.45, "rollouter/idle_ratio": 0.5}, busy=3.9)
    assert (V.async_idle(stale).key, V.async_idle(stale).value) == ("async_training.trigger_parameter_sync_step", 2)
    gpu_ray = {**ASYNC, "trainer.backend": "ray", "device": "cuda", "actor_rollout_ref.rollout.name": "vllm",
               "actor_rollout_ref.rollout.tensor_model_parallel_size": 2}
    rollout = V.async_idle(facts({**TRAIN, "wait_rollout": 4.0}, gpu_ray, {"trainer/idle_ratio": 0.5, "rollouter/idle_ratio": 0.02},
                                 busy=8.0))
    assert (rollout.rule, rollout.key, rollout.value) == ("rollout_bound", "actor_rollout_ref.rollout.tensor_model_parallel_size", 4)
    assert rollout.predicted["step_s"] == pytest.approx(max(4.0, 8.0 / 2))
    trainer = V.async_idle(facts({**TRAIN, "wait_rollout": 0.1}, gpu_ray, {"trainer/idle_ratio": 0.02, "rollouter/idle_ratio": 0.6},
                                 rollouter={"gen": 0.4, "wait_capacity": 0.6}, busy=1.6))
    assert (trainer.rule, trainer.key, trainer.value) == ("trainer_bound", "trainer.n_gpus_per_node", 8)
    assert "wait_capacity 60 %" in trainer.driver
    unsplit = V.async_idle(facts({**TRAIN, "wait_rollout": 0.1}, gpu_ray, {"trainer/idle_ratio": 0.02, "rollouter/idle_ratio": 0.6},
                                 busy=1.6))  # no wait_* parts recorded: no empty list in the sentence
    assert unsplit.driver == "training (4 s per step)"
    assert V.async_idle(facts(TRAIN, ASYNC, {"trainer/idle_ratio": 0.2, "rollouter/idle_ratio": 0.2})) is None
    assert V.async_idle(facts(TRAIN, SYNC, {"trainer/idle_ratio": 0.9, "rollouter/idle_ratio": 0.0})) is None
    # verl's V1 modes (plait/modes.py): separate_async overlaps the two sides like one_step_off; colocate_async
    # pauses its rollouter while training by design, so its pair is no overlap to read
    v1 = {**gpu_ray, "trainer.mode": "separate_async"}
    assert V.async_idle(facts({**TRAIN, "wait_rollout": 4.0}, v1, {"trainer/idle_ratio": 0.5, "rollouter/idle_ratio": 0.02},
                              busy=8.0)).rule == "rollout_bound"
    colocated = {**gpu_ray, "trainer.mode": "colocate_async"}
    assert V.async_idle(facts({**TRAIN, "wait_rollout": 4.0}, colocated, {"trainer/idle_ratio": 0.5,
                                                                        "rollouter/idle_ratio": 0.02}, busy=8.0)) is None


def test_device_keys_are_suggested_only_where_they_act():
    """verl #7601's device suggestions consult the run's backend and device (config_verl's no-effect tables)."""
    idle = {"trainer/idle_ratio": 0.02, "rollouter/idle_ratio": 0.6}
    starved = {"trainer/idle_ratio": 0.5, "rollouter/idle_ratio": 0.02}
    local = V.async_idle(facts({**TRAIN, "wait_rollout": 0.1}, {**ASYNC, "trainer.backend": "local", "device": "cpu"}, idle, busy=1.6))
    assert local.key == "" and "local backend" in local.expected and "try: " in local.line()
    cpu_ray = {**ASYNC, "trainer.backend": "ray", "device": "cpu", "trainer.ray.num_cpu_workers": 2}
    trainer = V.async_idle(facts({**TRAIN, "wait_rollout": 0.1}, cpu_ray, idle, busy=1.6))
    assert (trainer.key, trainer.value) == ("trainer.ray.num_cpu_workers", 4)  # not trainer.n_gpus_per_node: no effect on CPU
    rollout = V.async_idle(facts({**TRAIN, "wait_rollout": 4.0}, cpu_ray, starved, busy=8.0))
    assert (rollout.key, rollout.value) == ("actor_rollout_ref.rollout.n_gpus_per_node", 4)  # CPU slots of its process
    hf_gpu = V.async_idle(facts({**TRAIN, "wait_rollout": 4.0}, {**cpu_ray, "device": "cuda"}, starved, busy=8.0))
    assert hf_gpu.key == "" and "one GPU" in hf_gpu.expected
    unknown = V.async_idle(facts({**TRAIN, "wait_rollout": 0.1}, ASYNC, idle, busy=1.6))  # a summary without backend
    assert unknown.key == ""
    from plait.config_verl import CPU_RAY_NO_EFFECT, LOCAL_BACKEND_NO_EFFECT
    for v in (local, trainer, rollout, hf_gpu, unknown):
        assert v.key not in LOCAL_BACKEND_NO_EFFECT or v.key == "actor_rollout_ref.rollout.n_gpus_per_node"
        assert v.key not in CPU_RAY_NO_EFFECT


def test_a_long_response_tail_suggests_a_cap_or_partial_rollout():
    tail = {"response_length/p99": 900.0, "response_length/median": 100.0, "response_length/max": 1000.0}
    v = V.response_tail(facts({**BALANCED, "gen": 4.0}, metrics=tail))
    assert (v.key, v.value) == ("data.max_response_length", 200)
    assert v.predicted["generation_s"] == pytest.approx(4.0 * 200 / 1000)  # decode steps follow the longest response
    async_ = V.response_tail(facts({**TRAIN, "wait_rollout": 3.0}, {**ASYNC, "async_training.partial_rollout": False},
                                   {**tail, "trainer/idle_ratio": 0.4}, busy=6.0))
    assert (async_.key, async_.value) == ("async_training.partial_rollout", True)
    assert V.response_tail(facts({**BALANCED, "gen": 4.0}, metrics={**tail, "response_length/p99": 250.0})) is None


def test_a_slow_reward_asks_for_reward_workers():
    f = facts({**BALANCED, "reward": 4.0}, {"reward.custom_reward_function.path": "/r.py"})
    v = V.reward_bound(f)
    assert (v.where, v.key, v.value) == ("reward", "reward.num_workers", 8)
    assert v.predicted["reward_s"] == pytest.approx(4.0 / 8)
    assert "32 reward calls per step" in v.driver and "in the trainer's process" in v.driver
    more = V.reward_bound(facts({**BALANCED, "reward": 4.0}, {"reward.custom_reward_function.path": "/r.py", "reward.num_workers": 4}))
    assert more.value == 8 and more.predicted["reward_s"] == pytest.approx(2.0)
    assert V.reward_bound(facts({**BALANCED, "reward": 4.0})) is None  # the built-in scorer: no workers to add
    assert V.reward_bound(facts(BALANCED, {"reward.custom_reward_function.path": "/r.py"})) is None


def test_a_busy_judge_asks_for_fuller_rounds_unseeded_rounds_or_shorter_verdicts():
    judged = {**BALANCED, "reward": 1.0, "judge": 3.0}  # the judge's engine rounds, nested in reward
    full = {"judge/requests": 64.0, "judge/rounds": 8.0, "judge/requests_per_round": 8.0,
            "judge/response_tokens/mean": 40.0}
    custom = {"reward.custom_reward_function.path": "/r.py", "reward.num_workers": 8,
              "reward.reward_model.rollout.response_length": 512}
    v = V.judge_bound(facts(judged, custom, full))
    assert (v.where, v.key, v.value) == ("judge", "reward.num_workers", 16)
    assert v.predicted["judge_s"] == pytest.approx(1.5) and "64 judge requests in 8 engine rounds" in v.driver
    assert V.verdicts(facts(judged, custom, full))[0].rule == "judge_bound"
    seeded = V.judge_bound(facts(judged, {**custom, "reward.reward_model.rollout.full_determinism": True}, full))
    assert (seeded.key, seeded.value) == ("reward.reward_model.rollout.full_determinism", False)
    assert seeded.predicted["judge_s"] == pytest.approx(3.0 / 8)
    cut = {**full, "judge/requests_per_round": 2.0, "judge/response_tokens/mean": 500.0}
    short = V.judge_bound(facts(judged, custom, cut))
    assert (short.key, short.value) == ("reward.reward_model.rollout.response_length", 256)
    assert V.judge_bound(facts(judged, custom, {**cut, "judge/response_tokens/mean": 100.0})) is None  # no cause
    assert V.judge_bound(facts({**judged, "judge": 1.0}, custom, full)) is None  # below JUDGE_SHARE


def test_weight_sync_share_names_its_knob():
    v = V.weight_sync(facts({**TRAIN, "param_sync": 2.0}, ASYNC))
    assert (v.key, v.value) == ("async_training.trigger_parameter_sync_step", 2)
    sep = V.weight_sync(facts({**BALANCED, "update_weights": 2.0}, {"trainer.placement": "separated"}))
    assert (sep.key, sep.value) == ("trainer.placement", "colocated")
    assert V.weight_sync(facts({**BALANCED, "update_weights": 2.0})) is None  # colocated already
    assert V.weight_sync(facts(TRAIN, ASYNC)) is None                          # 0.2 of 4.0: below SYNC_SHARE


def test_update_cost_finds_its_cause():
    tiny = {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1}
    v = V.update_cost(facts({**BALANCED, "update_actor": 9.0}, tiny))
    assert (v.key, v.value) == ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 4)
    # update_actor 9 s at 32 micro-batches, old_log_prob 1 s at 1: a forward is 1 micro-batch's fixed cost c plus
    # the batch's token work w: 9 / 3 = 32 c + w and 1 = c + w, so c = 2 / 31; the suggested 4 samples make 8
    c = 2 / 31
    assert v.predicted["update_s"] == pytest.approx(3 * (8 * c + (1 - c)))
    assert "32 micro-batches" in v.driver and "8 micro-batches per epoch instead of 32" in v.expected
    fused = V.update_cost(facts({**BALANCED, "update_actor": 9.0, "old_log_prob": 0.0}, tiny))  # no forward to split by
    assert fused.predicted["update_s"] == pytest.approx(9.0 * 8 / 32) and "the most it can save" in fused.expected
    overhead_free = V.update_cost(facts({**BALANCED, "update_actor": 3.0, "old_log_prob": 1.0, "gen": 0.1}, tiny))
    assert overhead_free is None  # 3 forwards' worth at 32 micro-batches: no fixed cost to save
    dyn = V.update_cost(facts({**BALANCED, "update_actor": 9.0}, {"actor_rollout_ref.actor.use_dynamic_bsz": True,
                                                                  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 1024},
                              {"global_seqlen/real_tokens": 16384.0}))  # the step's 16k tokens in 16 budgets of 1k
    assert (dyn.key, dyn.value) == ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 4096)
    pad = V.update_cost(facts({**BALANCED, "update_actor": 9.0}, {"actor_rollout_ref.model.use_remove_padding": False},
                              {"global_seqlen/padding_ratio": 0.6}))
    assert (pad.key, pad.value) == ("actor_rollout_ref.model.use_remove_padding", True)
    ckpt = V.update_cost(facts({**BALANCED, "update_actor": 9.0}, {"actor_rollout_ref.model.enable_gradient_checkpointing": True},
                               peak={"gb": 20.0, "stage": "update_actor", "metric": "m", "step": 2}))
    assert (ckpt.key, ckpt.value) == ("actor_rollout_ref.model.enable_gradient_checkpointing", False)
    assert V.update_cost(facts({**BALANCED, "update_actor": 9.0})) is None  # one micro-batch, packed, no recompute
    full = {"gb": 70.0, "stage": "update_actor", "metric": "m", "step": 2}  # larger micro-batches would not fit
    assert V.update_cost(facts({**BALANCED, "update_actor": 9.0}, tiny, peak=full)) is None


def test_memory_near_the_device_limit_names_the_stage_and_key():
    peak = {"gb": 76.0, "stage": "update_actor", "metric": "memory/update_actor/peak_allocated_gb", "step": 3}
    v = V.memory_full(facts(BALANCED, peak=peak))
    assert (v.where, v.key, v.value) == ("memory in update_actor", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 16)
    olp = V.memory_full(facts(BALANCED, peak={**peak, "stage": "old_log_prob"}))  # null: the whole batch (32) at once
    assert (olp.key, olp.value) == ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", 16)
    assert V.verdicts(facts(BALANCED, peak=peak))[0].rule == "memory_full"  # saves no time, still said
    assert V.memory_full(facts(BALANCED, peak={**peak, "gb": 60.0})) is None


def test_validation_checkpoint_and_profiler_shares_of_the_wall_time():
    wall = {"total": 110.0, "startup": 10.0, "steps": 50.0, "validation": 40.0, "checkpoints": 5.0, "profiler": 5.0}
    v = V.overhead(facts(BALANCED, wall=wall))
    assert [(x.key, x.value) for x in v] == [("trainer.test_freq", 30)]  # 40 s every 5 steps -> 6.7 s: 10 % of 66.7
    assert v[0].predicted["spent_s"] == pytest.approx(40.0 * 5 / 30)
    costly = {**wall, "validation": 5.0, "profiler": 40.0}
    assert V.overhead(facts(BALANCED, {"global_profiler.steps": [2, 4, 6], "global_profiler.tool": "torch"}, wall=costly)) == []
    prof = profiler_facts({"global_profiler.steps": [2, 4, 6], "global_profiler.tool": "torch"}, costly)
    line = V.profiler_line(prof)  # the profiler's cost: a line of its own, never a verdict
    assert (line["key"], line["value"]) == ("global_profiler.steps", [2]) and line["line"].startswith("profiler: 3 windows")
    assert V.verdicts(prof) == []
    token = V.profiler_line(profiler_facts({"global_profiler.steps": [2], "actor_rollout_ref.rollout.profiler.enable": True},
                                           costly))
    assert token["key"] == V.TOKEN_END
    short = V.profiler_line(profiler_facts({"global_profiler.steps": [2], "actor_rollout_ref.rollout.profiler.enable": True,
                                            "data.max_response_length": 24}, costly))
    assert short["key"] == ""  # responses of <= 32 tokens: a 32-token bound would cut nothing
    assert V.overhead(facts(BALANCED, {"trainer.test_freq": -1}, wall=wall)) == []  # only val_before_train: no frequency


def profiler_facts(settings: dict, wall: dict) -> V.Facts:
    f = facts(BALANCED, settings, wall=wall)
    f.profiler = {"windows": 3, "start_s": 0.5, "stop_s": 39.0, "hook_s": 0.5, "total_s": 40.0, "steps": 3, "slowdown": 1.3}
    return f


def test_unattributed_time_is_never_ignored():
    v = V.unattributed(facts({**BALANCED, "unattributed": 2.0}))
    assert v.rule == "unattributed" and v.key == "" and "see the Gantt" in v.line()
    assert V.unattributed(facts(BALANCED)) is None


def test_the_line_ranking_and_one_verdict_per_key():
    f = facts({**BALANCED, "gen": 6.0, "reward": 3.0}, {"reward.custom_reward_function.path": "/r.py"},
              wall={"total": 100.0, "startup": 0.0, "validation": 30.0})
    got = V.verdicts(f)
    assert [v.rule for v in got] == sorted([v.rule for v in got], key=lambda r: -next(x.saving for x in got if x.rule == r))
    assert len({v.key for v in got}) == len(got) <= 3
    line = got[0].line()
    assert line.startswith(f"{got[0].where} is ") and "% of the step (median over the steps); driven by" in line
    assert "; try " in line and "(expected: " in line


def test_facts_come_from_accounted_steps_and_records():
    steps = [StepTime(i, float(i), 2.0, {"trainer (MainThread)": {"gen": 1.5, "update_actor": 0.5, "unattributed": 0.0},
                                         "rollout (plait-rollouter)": {"gen": 1.0, "wait_capacity": 1.0}}) for i in (1, 2, 3)]
    f = V.facts(steps, [{"step": i, "trainer/idle_ratio": 0.1 * i} for i in (1, 2, 3)], {"settings": {"trainer.mode": "sync"}})
    assert (f.step_s, f.trainer["gen"], f.rollout_busy_s, f.metrics["trainer/idle_ratio"]) == (2.0, 0.75, 1.0, pytest.approx(0.25))
    assert f.basis == "median over the steps, after the first (warm-up)"  # steps 2 and 3
    assert V.report(f)["thresholds"]["MIN_SAVING"] == V.MIN_SAVING


FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "verdict")


@pytest.mark.parametrize("name, rule, key", [
    ("fully_async_staleness0", "async_both_idle", "async_training.staleness_threshold"),
    ("sync_slow_reward", "reward_bound", "reward.num_workers"),
    ("sync_tiny_micro_batch", "update_cost", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")])
def test_recorded_runs_from_timeline_to_verdict(name, rule, key):
    """Files of three tiny planted runs (tests/fixtures/verdict: timeline.jsonl, metrics.jsonl and
    summary.json, captured as recorded): the whole path, accounting to facts to the ranked verdict."""
    folder = os.path.join(FIXTURES, name)
    spans = read_timeline(os.path.join(folder, "timeline.jsonl"))
    metrics = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    summary = json.load(open(os.path.join(folder, "summary.json")))
    f = V.of_run(spans, metrics, summary)
    assert f.steps == 3 and sum(f.trainer_s.values()) == pytest.approx(f.step_s, rel=0.2)  # steps 2-4: 1 warms up
    got = V.verdicts(f)
    assert (got[0].rule, got[0].key) == (rule, key)
    assert json.loads(json.dumps(V.report(f)))["verdicts"][0]["line"] == got[0].line()


def test_a_rule_that_cannot_read_its_settings_is_named_and_the_others_still_speak():
    f = facts({**BALANCED, "reward": 4.0}, {"reward.custom_reward_function.path": "/r.py", "reward.num_workers": "four"})
    judged = V.report(f)
    assert judged["skipped_rules"] and judged["skipped_rules"][0].startswith("reward_bound: TypeError")
    assert V.verdicts(facts({**BALANCED, "gen": 6.0}, {"reward.num_workers": "four"}))[0].rule == "generation_bound"


def test_no_verdict_suggests_a_key_that_does_nothing_on_this_run():
    """memory in gen suggests rollout.max_num_seqs: vLLM's, nothing with the hf engine, which the verdict knows
    from the engine table plait names such keys by at start."""
    peak = {"gb": 76.0, "stage": "gen", "metric": "memory/gen/peak_allocated_gb", "step": 3}
    vllm = V.verdicts(facts(BALANCED, {"actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.rollout.max_num_seqs": 64},
                            peak=peak))[0]
    assert (vllm.key, vllm.value) == ("actor_rollout_ref.rollout.max_num_seqs", 32)
    hf = V.verdicts(facts(BALANCED, {"actor_rollout_ref.rollout.name": "hf", "actor_rollout_ref.rollout.max_num_seqs": 64},
                          peak=peak))[0]
    assert hf.rule == "memory_full" and hf.key == "" and "rollout.name=hf" in hf.line()
    assert V.no_effect_here("trainer.n_gpus_per_node", {"trainer.backend": "local"})
    assert V.no_effect_here("trainer.n_gpus_per_node", {"trainer.backend": "ray", "device": "cpu"})
    assert V.no_effect_here("trainer.n_gpus_per_node", {"trainer.backend": "ray", "device": "cuda"}) is None
    assert V.no_effect_here("actor_rollout_ref.rollout.max_num_seqs", {}) is None  # unknown engine: not claimed


def test_counts_in_a_line_agree_with_their_noun():
    """issue 52: "micro-batches of 1 samples"."""
    one = V.update_cost(facts({**BALANCED, "update_actor": 9.0}, {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1}))
    assert "micro-batches of 1 sample per optimizer step" in one.line()
    two = V.update_cost(facts({**BALANCED, "update_actor": 9.0}, {"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2}))
    assert "micro-batches of 2 samples per optimizer step" in two.line()
    both = V.async_idle(facts({**TRAIN, "wait_rollout": 3.5}, ASYNC, {"trainer/idle_ratio": 0.45, "rollouter/idle_ratio": 0.5},
                              busy=3.9))
    assert "samples up to 1 version behind" in both.line()


def test_the_step_time_leaves_out_the_warm_up_and_reads_steps_without_validation_and_checkpoints():
    """issue 52: the step-time median counted step 1's warm-up and the validation and checkpoint inside steps."""
    lane = "trainer (MainThread)"
    part = lambda **extra: {lane: {"gen": 0.4, "update_actor": 0.6, **extra}}  # noqa: E731
    steps = [StepTime(1, 0.0, 5.0, part(unattributed=4.0)),                           # warm-up
             StepTime(2, 5.0, 1.0, part()),
             StepTime(3, 6.0, 4.0, part(testing=2.0, save_checkpoint=1.0)),           # test_freq, save_freq
             StepTime(4, 10.0, 1.0, part())]
    f = V.facts(steps, [], {})
    assert (f.steps, f.step_s, f.step_p90) == (3, 1.0, 1.0)
    assert "testing" not in f.trainer and f.trainer["update_actor"] == pytest.approx(0.6)
    assert f.basis == "median over the steps, after the first (warm-up)"
    only = V.facts(steps[:1], [], {})  # one step: it is all there is
    assert (only.steps, only.step_s) == (1, 5.0)


def _cycle(step: int, wall: float, **extra: float) -> StepTime:
    return StepTime(step, float(step), wall + sum(extra.values()),
                    {"trainer (MainThread)": {"update_actor": wall, **extra}})


def test_a_profiled_steps_ratio_reads_steady_steps_and_is_unsaid_over_noise():
    """issue 52: "a profiled step's own time was Rx" read 0.18x-1.18x on identical runs: the unprofiled side held the
    warm-up (and validation / checkpoint cycles), and one step or noisy steps were compared as if steady."""
    spans = [{"role": "trainer", "stage": "profiler_start", "start": 0.0, "end": 0.1}]
    # warm-up 10 s, step 2 profiled (2.2 s), steps 3-5 about 2 s, step 4 with a 6 s validation
    steps = [_cycle(1, 10.0), _cycle(2, 2.2, profiler_stop=5.0), _cycle(3, 2.0), _cycle(4, 2.0, testing=6.0),
             _cycle(5, 2.1)]
    p = V.profiler_cost(steps, {2}, spans)
    assert p["slowdown"] == pytest.approx(2.2 / 2.0) and p["unsaid"] is None and p["steps"] == 1
    # the same run with the steady steps' times spread 50 %: nothing said, and why
    noisy = V.profiler_cost(steps[:2] + [_cycle(3, 1.5), _cycle(4, 2.0), _cycle(5, 2.5)], {2}, spans)
    assert noisy["slowdown"] is None and noisy["unsaid"] == "the unprofiled steps' own times spread 50 % (over 20 %)"
    # profiling steps 2-3 of 3: only the warm-up is unprofiled (it read 0.18x)
    few = V.profiler_cost(steps[:3], {2, 3}, spans)
    assert few["slowdown"] is None and few["unsaid"].startswith("fewer than two unprofiled steps")
    first = V.profiler_cost(steps, {1}, spans)
    assert first["slowdown"] is None and first["unsaid"] == "the only profiled step was the run's first (its warm-up)"
    f = facts(BALANCED, wall={"total": 30.0, "startup": 2.0})
    f.profiler = noisy
    assert "how much slower a profiled step ran is not said: the unprofiled steps' own times spread 50 %" in \
        V.profiler_line(f)["line"]
