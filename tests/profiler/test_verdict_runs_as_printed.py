"""Defects of the verdict (issue 52): a suggestion plait prints runs as printed on the machine that ran it, a
log-prob micro-batch of one is named with its keys, a finished rollouter is not read as waiting, and identical
runs get the same first verdict. Synthetic facts for the rules, short CPU runs of the tiny model for the rest."""

import json
import re
import time

import pytest

from plait import cli
from plait.config import load_config
from plait.profiler.analysis import verdict as V
from plait.trainers.producer import BusyClock
from tests.profiler.test_verdict import BALANCED, facts
from tests.profiler.test_verdict_planted import LONG, ONE_UPDATE, first, planted


def printed(line: str) -> list[str]:
    """The overrides a verdict line says to try, as a user would copy them."""
    return re.search(r"; try (.*?) \(expected: ", line).group(1).split()


def test_the_one_step_off_suggestion_names_the_placement_it_needs():
    v = V.generation_bound(facts({**BALANCED, "gen": 5.0}))
    assert printed(v.line()) == ["trainer.mode=one_step_off", "trainer.placement=separated"]
    separated = V.generation_bound(facts({**BALANCED, "gen": 5.0}, {"trainer.placement": "separated"}))
    assert printed(separated.line()) == ["trainer.mode=one_step_off"]


LOG_PROB_1 = {"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 1,
              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 1}


def test_a_log_prob_micro_batch_of_one_is_named_with_both_keys():
    f = facts({**BALANCED, "old_log_prob": 3.2, "ref": 3.0, "update_actor": 1.5}, LOG_PROB_1)
    v = V.verdicts(f)[0]
    assert (v.rule, v.where) == ("log_prob_cost", "old_log_prob + ref")
    assert v.overrides() == {"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 32,
                             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 32}
    assert v.predicted["log_prob_s"] < 6.2 and v.predicted["step_s"] == pytest.approx(f.step_s - 6.2 + v.predicted["log_prob_s"])
    assert V.log_prob_cost(facts(BALANCED, LOG_PROB_1)) is None  # 1 s of 6.7: not a bottleneck
    assert V.log_prob_cost(facts({**BALANCED, "old_log_prob": 3.2, "ref": 3.0})) is None  # one forward each


CPU_RAY = {"trainer.backend": "ray", "device": "cpu", "trainer.ray.num_cpu_workers": 1, "trainer.ray.cpus_per_worker": 1.0,
           "trainer.placement": "separated", "cpus": 2, "gpus": 0, "trainer.mode": "fully_async"}


def test_a_suggestion_this_machine_cannot_carry_is_not_made():
    trainer_bound = {"trainer/idle_ratio": 0.02, "rollouter/idle_ratio": 0.6}
    on_two = V.async_idle(facts({**BALANCED, "wait_rollout": 0.1}, CPU_RAY, trainer_bound, busy=1.0))
    assert (on_two.key, on_two.value) == ("trainer.ray.num_cpu_workers", 2)
    assert V.cannot_carry(on_two.overrides(), CPU_RAY) == "it needs 3 CPUs and this machine has 2"
    told = V.verdicts(facts({**BALANCED, "wait_rollout": 0.1}, CPU_RAY, trainer_bound, busy=1.0))[0]
    assert told.key == "" and "this machine has 2" in told.line() and "num_cpu_workers=2" not in told.line()
    on_four = V.verdicts(facts({**BALANCED, "wait_rollout": 0.1}, {**CPU_RAY, "cpus": 4}, trainer_bound, busy=1.0))[0]
    assert (on_four.key, on_four.value) == ("trainer.ray.num_cpu_workers", 2)
    local = V.async_idle(facts({**BALANCED, "wait_rollout": 0.1}, {**CPU_RAY, "trainer.backend": "local"}, trainer_bound, busy=1.0))
    assert local.key == "" and "with 2 workers would, but it needs 3 CPUs and this machine has 2" in local.line()
    gpus = {**CPU_RAY, "device": "cuda", "trainer.n_gpus_per_node": 1, "actor_rollout_ref.rollout.n_gpus_per_node": 1,
            "gpus": 2}
    assert V.cannot_carry({"trainer.n_gpus_per_node": 2}, gpus) == "it needs 3 GPUs and this machine has 2"
    assert V.cannot_carry({"trainer.n_gpus_per_node": 2}, {**gpus, "trainer.placement": "colocated"}) is None
    assert V.cannot_carry({"trainer.n_gpus_per_node": 2}, {**gpus, "trainer.nnodes": 2}) is None  # a cluster's count is not known


def test_an_idle_ratio_near_its_threshold_names_no_side():
    """Identical runs' idle ratios differ by a few hundredths: a reading within IDLE_MARGIN of a threshold
    is too close to call, so a run just past it and one just short get the same (no) verdict."""
    settings = {**CPU_RAY, "cpus": 4}
    near = [V.async_idle(facts({**BALANCED, "wait_rollout": 0.1}, settings,
                               {"trainer/idle_ratio": t, "rollouter/idle_ratio": 0.6}, busy=1.0)) for t in (0.08, 0.11)]
    assert near == [None, None]
    assert V.async_idle(facts({**BALANCED, "wait_rollout": 0.1}, settings,
                              {"trainer/idle_ratio": 0.02, "rollouter/idle_ratio": 0.6}, busy=1.0)).rule == "trainer_bound"


def test_a_finished_thread_is_not_idle():
    clock = BusyClock()
    start = time.perf_counter()
    time.sleep(0.05)
    with clock.busy():
        time.sleep(0.05)
    clock.finish()
    time.sleep(0.1)
    ratio = clock.idle_ratio(start, time.perf_counter())  # of the time it still had work to do
    assert 0.3 < ratio < 0.7, ratio  # about half: the tail after its last batch is not a wait (it read ~0.75)
    later = time.perf_counter()
    time.sleep(0.02)
    assert clock.idle_ratio(later, time.perf_counter()) == 0.0


# -- planted runs -------------------------------------------------------------------------------

PLANTED_LOG_PROB = ["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.use_kl_loss=true"]


def test_a_planted_log_prob_micro_batch_of_one_is_named_and_checked_by_diff(tmp_path, tiny_config, capsys):
    before, after = tmp_path / "before", tmp_path / "after"
    v = first(planted(before, tiny_config, *PLANTED_LOG_PROB))
    assert (v["rule"], v["where"]) == ("log_prob_cost", "old_log_prob + ref")
    keys = printed(v["line"])
    assert sorted(keys) == ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",  # the larger saving first
                            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4"]
    planted(after, tiny_config, *PLANTED_LOG_PROB, *keys)
    capsys.readouterr()
    assert cli.main(["profile", "diff", str(before), str(after), "--json"]) == 0
    row = next(p for p in json.loads(capsys.readouterr().out)["predictions"] if p["quantity"] == "log_prob_s")
    print(row)
    assert row["b_measured"] < row["a_measured"] and row["predicted"] == v["predicted"]["log_prob_s"]


def test_the_one_step_off_suggestion_loads_as_printed(tmp_path, tiny_config):
    from tests.conftest import TINY
    from tests.profiler.test_verdict_planted import QUIET
    overrides = [*QUIET, "data.max_response_length=256", *LONG, *ONE_UPDATE]
    v = first(planted(tmp_path / "run", tiny_config, *overrides))
    assert v["key"] == "trainer.mode"
    load_config(None, [*TINY, f"trainer.default_local_dir={tmp_path / 'again'}", *overrides, *printed(v["line"])])


FULLY_ASYNC = ["trainer.mode=fully_async", "trainer.placement=separated", "async_training.staleness_threshold=0",
               "data.max_response_length=80", *LONG, "trainer.total_training_steps=6"]  # idle medians of steps 2-5


def test_identical_fully_async_runs_get_the_same_first_verdict(tmp_path, tiny_config):
    firsts = [first(planted(tmp_path / str(i), tiny_config, *FULLY_ASYNC)) for i in range(3)]
    assert {(v["rule"], v["key"], json.dumps(v["value"])) for v in firsts} == {
        ("async_both_idle", "async_training.staleness_threshold", "1")}


def test_the_last_step_of_a_one_step_off_run_is_not_read_as_waiting(tmp_path, tiny_config):
    """Its generation thread has made the run's last batch: it was done, not idle (it read 1.0 before)."""
    planted(tmp_path, tiny_config, "trainer.mode=one_step_off", "trainer.placement=separated")
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    last = max((r for r in records if "rollouter/idle_ratio" in r), key=lambda r: r["step"])
    assert last["step"] == 4 and last["rollouter/idle_ratio"] < 0.5
