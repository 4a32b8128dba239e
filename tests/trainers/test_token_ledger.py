"""The token ledger (trainers/metrics.py TokenLedger): on every step of every LM mode, tokens/generated =
tokens/trained + tokens/discarded exactly, the discarded split by cause; DAPO's filter and verl's V1 drop
strategy show as their causes; tokens/no_signal counts the trained tokens of groups with equal rewards."""

import os

import pytest

from plait import driver
from plait.profiler.analysis.alarms import alarms
from plait.trainers.lifecycle import read_metrics

from tests.profiler.test_samples import EVERY_LM_MODE
from tests.trainers.test_filter_groups import reward

QUIET = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.total_training_steps=3"]
CASES = {**EVERY_LM_MODE, "fully_async_staleness_0": ["trainer.mode=fully_async", "trainer.placement=separated",
                                                       "async_training.staleness_threshold=0"],
         "separate_async_drop": [*EVERY_LM_MODE["separate_async"], "trainer.v1.separate_async.num_warmup_batches=2",
                                 "trainer.v1.sampler.max_off_policy_threshold=1"]}


def steps(tmp_path, tiny_config, *overrides) -> list[dict]:
    driver.build(tiny_config(tmp_path, *QUIET, *overrides), progress=False).run()
    return [r for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl")) if r["step"] >= 1]


def assert_balanced(r: dict) -> None:
    causes = sum(r[f"tokens/discarded/{c}"] for c in ("filtered", "stale", "rejected"))
    assert r["tokens/generated"] == r["tokens/trained"] + r["tokens/discarded"] and r["tokens/discarded"] == causes
    assert r["tokens/trained"] > 0 and 0 <= r["tokens/no_signal"] <= r["tokens/trained"]


@pytest.mark.parametrize("case", list(CASES))
def test_the_ledger_balances_on_every_step(case, tmp_path, tiny_config):
    records = steps(tmp_path, tiny_config, *CASES[case])
    assert len(records) == 3
    for r in records:
        assert_balanced(r)
    if case == "sync":  # every response trained: the step's 16 rows' sampled tokens
        assert all(r["tokens/trained"] == pytest.approx(16 * r["response_length/mean"]) for r in records)
        assert all(r["tokens/discarded"] == 0 for r in records)
    if case == "separate_async_drop":  # the groups its sampler evicted as stale are the waste
        assert sum(r["tokens/discarded/stale"] for r in records) > 0
        assert all(r["tokens/discarded/stale"] > 0 for r in records if r.get("training/off_policy/evicted_samples"))
        [waste] = [a for a in alarms([], records, {}) if a.rule == "waste"]  # the profile says so, with its key
        assert waste.key == "trainer.v1.sampler.max_off_policy_threshold" and "most as stale" in waste.what
    else:
        assert not [a for a in alarms([], records, {}) if a.rule == "waste"]


def test_filtered_groups_and_groups_without_signal_are_counted(tmp_path, tiny_config):
    records = steps(tmp_path, tiny_config, *reward(tmp_path, "parity"), "algorithm.filter_groups.enable=true",
                    "algorithm.adv_estimator=grpo")
    for r in records:
        assert_balanced(r)
        assert (r["tokens/discarded/filtered"] > 0) == (r["training/filter_groups/evicted_samples"] > 0)
    assert sum(r["tokens/discarded/filtered"] for r in records) > 0
    flat = steps(tmp_path / "flat", tiny_config, "reward.custom_reward_function.path=" + write_constant(tmp_path),
                 "reward.custom_reward_function.name=one")
    assert all(r["tokens/no_signal"] == r["tokens/trained"] for r in flat)  # an always-1 reward: nothing to learn


def write_constant(tmp_path) -> str:
    path = tmp_path / "one.py"
    path.write_text("def one(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    return str(path)
