"""Sync mode end to end on the tiny model: GRPO and PPO learn, resume is exact, user data works."""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from plait import driver
from plait.trainers.lifecycle import read_metrics
from plait.workers.actor import Actor

STEP_KEYS = ["critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "response_length/mean",
             "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
             "perf/throughput", "perf/time_per_step", "timing_s/gen", "timing_s/reward", "timing_s/old_log_prob",
             "timing_s/adv", "timing_s/update_actor", "timing_s/update_weights", "timing_s/step",
             "training/epoch", "actor/lr", "prompt_length/clip_ratio", "response/aborted_ratio",
             "response_length_non_aborted/mean", "perf/max_memory_allocated_gb", "perf/max_memory_reserved_gb",
             "perf/cpu_memory_used_gb", "perf/plait_peak_rss_gb", "rollout_corr/kl"]


def run(cfg):
    lifecycle = driver.build(cfg, progress=False)
    return lifecycle, lifecycle.run()


def test_grpo_changes_parameters_and_logs_verl_metrics(tmp_path, tiny_config):
    cfg = tiny_config(tmp_path)
    lifecycle = driver.build(cfg, progress=False)
    actor = lifecycle.trainer.roles.actor
    before = {k: v.clone() for k, v in actor.call(Actor.state_dict).items()}
    lifecycle.run()
    after = actor.call(Actor.state_dict)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # step 0: validation before training
    for key in STEP_KEYS:
        assert all(key in r for r in records[1:]), key
    assert "val-core/arithmetic/reward/mean@1" in records[0] and "val-core/arithmetic/reward/mean@1" in records[2]
    assert "timing_s/testing" in records[2] and "timing_s/save_checkpoint" in records[3]
    assert os.path.isfile(tmp_path / "checkpoints" / "global_step_3" / "actor" / "model.pt")
    assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "3"


def test_ppo_with_critic_and_kl_terms(tmp_path, tiny_config):
    # a dense reward so the critic has non-zero returns to fit from step 1
    (tmp_path / "reward.py").write_text("def length(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return len(solution_str) / 10\n")
    cfg = tiny_config(tmp_path / "run", "algorithm.adv_estimator=gae", "trainer.total_training_steps=2",
                      f"custom_reward_function.path={tmp_path / 'reward.py'}", "custom_reward_function.name=length",
                      "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true",
                      "algorithm.kl_ctrl.type=adaptive", "critic.optim.lr=1e-2")
    run(cfg)
    last = read_metrics(os.path.join(tmp_path, "run", "metrics.jsonl"))[-1]
    for key in ["critic/vf_loss", "critic/values/mean", "critic/returns/mean", "timing_s/values",
                "timing_s/update_critic", "timing_s/ref", "actor/kl_loss", "actor/reward_kl_penalty",
                "actor/reward_kl_penalty_coeff"]:
        assert key in last, key
    assert last["critic/values/mean"] != 0.0  # the zero-initialised head has been trained


def _strip(record):
    return {k: v for k, v in record.items()  # wall-clock measures differ between any two runs
            if not k.startswith(("timing", "perf/", "memory/")) and not k.endswith("/idle_ratio")}


def test_resume_reproduces_the_next_step_of_an_uninterrupted_run(tmp_path, tiny_config):
    full, part = tmp_path / "full", tmp_path / "part"
    run(tiny_config(full, "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1"))
    run(tiny_config(part, "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=-1"))
    run(tiny_config(part, "trainer.total_training_steps=4", "trainer.save_freq=2", "trainer.test_freq=-1"))
    a = read_metrics(os.path.join(full, "metrics.jsonl"))
    b = read_metrics(os.path.join(part, "metrics.jsonl"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert _strip(a[2]) == pytest.approx(_strip(b[2]), rel=1e-5, abs=1e-6)
    assert _strip(a[3]) == pytest.approx(_strip(b[3]), rel=1e-5, abs=1e-6)


def test_user_parquet_and_custom_reward_function(tmp_path, tiny_config):
    rows = [{"data_source": "mine", "prompt": [{"role": "user", "content": f"say {i}"}], "ability": "echo",
             "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}} for i in range(8)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:4]), tmp_path / "val.parquet")
    (tmp_path / "reward.py").write_text(
        "def my_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    assert data_source == 'mine'\n"
        "    return {'score': 0.25 + 0.5 * (ground_truth in solution_str), 'length': len(solution_str)}\n")
    out = tmp_path / "run"
    cfg = tiny_config(out, f"data.train_files=[{tmp_path / 'train.parquet'}]", f"data.val_files=[{tmp_path / 'val.parquet'}]",
                      f"custom_reward_function.path={tmp_path / 'reward.py'}", "custom_reward_function.name=my_score",
                      "trainer.total_training_steps=2")
    run(cfg)
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert "val-core/mine/reward/mean@1" in records[0]
    assert all(0.25 <= r["critic/score/mean"] <= 0.75 for r in records[1:])
    assert "reward_extra/length/mean" in records[1]


def test_bypass_mode_skips_the_recompute_and_trains_the_same(tmp_path, tiny_config):
    """In sync mode the rollout samples with the actor's weights, so its log-probs are pi_old: bypass
    mode drops the old_log_prob forward and the first update is the recomputed one, to rounding."""
    common = ("trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.save_freq=-1")
    run(tiny_config(tmp_path / "recompute", *common))
    run(tiny_config(tmp_path / "bypass", *common, "algorithm.rollout_correction.bypass_mode=true"))
    [a] = read_metrics(os.path.join(tmp_path, "recompute", "metrics.jsonl"))
    [b] = read_metrics(os.path.join(tmp_path, "bypass", "metrics.jsonl"))
    assert "timing_s/old_log_prob" in a and "timing_s/old_log_prob" not in b
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/ppo_kl",
                *(f"training/rollout_probs_diff_{s}" for s in ("max", "mean", "std"))):  # on every path
        assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), key


def test_one_optimizer_step_per_batch_fuses_pi_old_and_trains_the_same(tmp_path, tiny_config):
    """One mini-batch x one epoch: pi_old comes from the update's own forward (flagged, no
    old_log_prob stage) and the step equals the one with the separate pass, to rounding."""
    common = ("trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.save_freq=-1")
    run(tiny_config(tmp_path / "recompute", *common))
    run(tiny_config(tmp_path / "fused", *common, "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"))
    [a] = read_metrics(os.path.join(tmp_path, "recompute", "metrics.jsonl"))
    [b] = read_metrics(os.path.join(tmp_path, "fused", "metrics.jsonl"))
    assert "timing_s/old_log_prob" in a and "actor/old_log_prob_fused" not in a
    assert "timing_s/old_log_prob" not in b and b["actor/old_log_prob_fused"] == 1.0
    for key in ("critic/score/mean", "global_seqlen/real_tokens",
                *(f"training/rollout_probs_diff_{s}" for s in ("max", "mean", "std"))):  # the fused path logged the mean only
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    run(tiny_config(tmp_path / "corrected", *common, "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                    "algorithm.rollout_correction.rollout_is=token"))
    [c] = read_metrics(os.path.join(tmp_path, "corrected", "metrics.jsonl"))
    assert "timing_s/old_log_prob" in c  # rollout correction needs the whole batch's pi_old first
    assert 0 < b["perf/mfu/actor"] < 1 and 0 < b["perf/mfu/gen"] < 1 and b["global_seqlen/padding_ratio"] >= 0


def test_packing_dynamic_batches_and_checkpointing_keys_train_the_same(tmp_path, tiny_config):
    """verl's use_remove_padding / use_dynamic_bsz / *_max_token_len_per_gpu /
    enable_gradient_checkpointing reach the workers and leave the step's numbers unchanged."""
    common = ("trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.save_freq=-1", "algorithm.adv_estimator=gae")
    run(tiny_config(tmp_path / "plain", *common, "actor_rollout_ref.model.use_remove_padding=false"))
    fast = driver.build(tiny_config(
        tmp_path / "fast", *common, "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=30",
        "critic.model.use_remove_padding=true", "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=40"),
        progress=False)
    layout = fast.trainer.roles.actor.call(lambda actor: actor.layout)
    assert layout.remove_padding and layout.max_token_len == 40
    assert fast.trainer.roles.critic.call(lambda critic: critic.model.remove_padding)
    fast.run()
    [a] = read_metrics(os.path.join(tmp_path, "plain", "metrics.jsonl"))
    [b] = read_metrics(os.path.join(tmp_path, "fast", "metrics.jsonl"))
    for key in ("actor/entropy", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
