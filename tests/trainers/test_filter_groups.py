"""DAPO's dynamic sampling (algorithm.filter_groups): groups whose metric does not vary are dropped and
the mode generates again until a batch's worth of groups has signal, within max_num_gen_batches."""

import os

import pytest

from plait import driver
from plait.errors import RunError
from plait.trainers.lifecycle import StageTimer, read_metrics
from plait.trainers.metrics import filter_values, groups_with_signal

# Odd answers score by the response's characters (varies within a group); even ones all score 0.
PARITY = ("def parity(data_source, solution_str, ground_truth, extra_info=None):\n"
          "    odd = int(ground_truth) % 2\n"
          "    return {'score': float(sum(map(ord, solution_str)) % 7) if odd else 0.0, 'acc': float(odd)}\n"
          "def flat(data_source, solution_str, ground_truth, extra_info=None):\n"
          "    return 1.0\n")


def reward(tmp_path, name):
    (tmp_path / "reward.py").write_text(PARITY)
    return (f"reward.custom_reward_function.path={tmp_path / 'reward.py'}", f"reward.custom_reward_function.name={name}")


def test_groups_with_signal_by_hand():
    # group 7: 1, 1 (no signal); group 3: 0, 1; group 5 alone (kept, as verl keeps a group of one)
    assert groups_with_signal([1.0, 1.0, 0.0, 1.0, 0.5], [7, 7, 3, 3, 5]) == {3, 5}
    assert filter_values("acc", [0.0, 1.0], {"acc": [1.0, 1.0]}) == [1.0, 1.0]
    assert filter_values("reward", [0.0, 1.0], {"acc": [1.0, 1.0]}) == [0.0, 1.0]
    with pytest.raises(RunError, match="filter_groups.metric='pred'.*returned: score, acc"):
        filter_values("pred", [0.0], {"acc": [1.0]})


def test_a_filtered_batch_is_full_and_every_group_varies(tmp_path, tiny_config):
    cfg = tiny_config(tmp_path, *reward(tmp_path, "parity"), "algorithm.filter_groups.enable=true",
                      "algorithm.adv_estimator=grpo")
    lifecycle = driver.build(cfg, progress=False)
    try:
        trainer = lifecycle.trainer
        batch, (scores, extras), metrics = trainer.next_filtered_batch(1, StageTimer())
        groups = batch.group_ids.tolist()
        assert len(batch) == 16 and len(set(groups)) == 4  # train_batch_size 4 groups x rollout.n 4
        assert len(scores) == 16 and extras["acc"] == [1.0] * 16  # only odd answers vary
        for g in set(groups):
            assert len({s for s, h in zip(scores, groups) if h == g}) > 1
        assert metrics["train/num_gen_batches"] >= 2 and metrics["training/filter_groups/evicted_samples"] > 0
    finally:
        lifecycle.shutdown()
    # acc is the same within every group (odd or even answer): nothing ever has signal
    out = tmp_path / "acc"
    cfg = tiny_config(out, *reward(tmp_path, "parity"), "algorithm.filter_groups.enable=true",
                      "algorithm.filter_groups.metric=acc", "algorithm.filter_groups.max_num_gen_batches=3")
    with pytest.raises(RunError, match="3 generated batches gave 0 of 4 prompt groups.*max_num_gen_batches=0"):
        driver.build(cfg, progress=False).run()


def test_filter_groups_trains_and_logs_verls_metrics(tmp_path, tiny_config):
    cfg = tiny_config(tmp_path, *reward(tmp_path, "parity"), "algorithm.filter_groups.enable=true",
                      "algorithm.adv_estimator=grpo", "trainer.total_training_steps=2", "trainer.test_freq=-1")
    driver.build(cfg, progress=False).run()
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert len(records) == 2
    for r in records:
        assert r["train/num_gen_batches"] >= 1 and "training/filter_groups/evicted_samples" in r
        assert r["critic/score/max"] > 0 and "actor/pg_loss" in r


def test_filter_groups_off_is_verls_default_and_plain_scripts_set_it(tiny_config, tmp_path):
    cfg = tiny_config(tmp_path, "algorithm.filter_groups.enable=False")
    assert cfg.algorithm.filter_groups.metric == "reward" and not cfg.algorithm.filter_groups.enable


def test_filter_groups_is_refused_where_it_cannot_apply():
    from plait.config import load_config
    from plait.configtree import ConfigError
    with pytest.raises(ConfigError, match="filter_groups.enable=True: false with trainer.mode=diffusion"):
        load_config(None, ["trainer.mode=diffusion", "algorithm.filter_groups.enable=true"])
    with pytest.raises(ConfigError, match="filter_groups.metric=None: a metric name"):
        load_config(None, ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=null"])


def test_filter_groups_in_one_step_off_takes_the_batch_in_flight(tmp_path, tiny_config):
    cfg = tiny_config(tmp_path, *reward(tmp_path, "parity"), "algorithm.filter_groups.enable=true",
                      "algorithm.adv_estimator=grpo", "trainer.mode=one_step_off", "trainer.placement=separated",
                      "trainer.total_training_steps=2", "trainer.test_freq=-1")
    driver.build(cfg, progress=False).run()
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert len(records) == 2 and all(r["train/num_gen_batches"] >= 1 for r in records)
