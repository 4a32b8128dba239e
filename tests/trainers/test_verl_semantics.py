"""verl's trainer semantics and metric names: lr schedule in training steps, critic warmup, ReMax's
greedy baseline, loss modes and rollout correction end to end, validation mean@N and logged
generations, and the data metrics against hand-computed values."""

import json
import os

import pytest
import torch

from plait import driver
from plait.trainers.lifecycle import memory_metrics, read_metrics
from plait.trainers.metrics import data_metrics, validation_metrics
from plait.types import RolloutBatch
from plait.workers.actor import lr_factor

T = torch.tensor
QUICK = ("trainer.test_freq=-1", "trainer.save_freq=-1")


def dense_reward(tmp_path):
    """A reward that varies between responses from step 1 (the untrained demo model scores 0 on arithmetic)."""
    (tmp_path / "reward.py").write_text("def length(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return len(solution_str) / 10\n")
    return (f"custom_reward_function.path={tmp_path / 'reward.py'}", "custom_reward_function.name=length")


def run(cfg, out):
    driver.build(cfg, progress=False).run()
    return read_metrics(os.path.join(out, "metrics.jsonl"))


def test_lr_factor_by_hand():
    assert [lr_factor(s, 10, 2) for s in range(4)] == [0.0, 0.5, 1.0, 1.0]  # constant after a linear warmup
    cosine = lambda s: lr_factor(s, 10, 0, "cosine", min_lr_ratio=0.1, num_cycles=0.5)  # noqa: E731
    assert cosine(0) == pytest.approx(1.0)
    assert cosine(5) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: cos(pi/2) = 0
    assert cosine(10) == pytest.approx(0.1)  # the floor
    assert lr_factor(1, 10, 4, "cosine") == pytest.approx(0.25)  # warmup first


@pytest.mark.parametrize("warmup", ["actor_rollout_ref.actor.optim.lr_warmup_steps=2",
                                    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.67"])
def test_warmup_counts_training_steps_not_optimizer_steps(tmp_path, tiny_config, warmup):
    # 2 mini-batches (optimizer steps) per training step; warmup 2 (or int(0.67 * 3)) training steps
    records = run(tiny_config(tmp_path, *QUICK, warmup, "data.train_size=8"), tmp_path)
    assert [r["actor/lr"] for r in records] == pytest.approx([0.0, 5e-4, 1e-3])
    assert [r["training/epoch"] for r in records] == [0, 0, 1]  # 8 rows: 2 batches of 4 per epoch


def test_critic_warmup_trains_only_the_critic_first(tmp_path, tiny_config):
    # verl's rule: the actor trains once step >= critic_warmup, so 2 leaves step 1 to the critic alone
    records = run(tiny_config(tmp_path, *QUICK, "algorithm.adv_estimator=gae", "trainer.critic_warmup=2",
                              "trainer.total_training_steps=2"), tmp_path)
    assert "actor/pg_loss" not in records[0] and "timing_s/update_actor" not in records[0]
    assert "actor/pg_loss" in records[1]
    for key in ("critic/vf_loss", "critic/lr", "critic/vpred_mean", "critic/vf_explained_var"):
        assert all(key in r for r in records), key


def test_remax_generates_a_greedy_baseline(tmp_path, tiny_config):
    [record] = run(tiny_config(tmp_path / "run", *QUICK, *dense_reward(tmp_path), "algorithm.adv_estimator=remax",
                               "trainer.total_training_steps=1"), tmp_path / "run")
    assert "timing_s/gen_max" in record and record["actor/grad_norm"] > 0


@pytest.mark.parametrize("mode", ["gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "sapo", "cispo"])
def test_loss_modes_train(tmp_path, tiny_config, mode):
    [record] = run(tiny_config(tmp_path / "run", *QUICK, *dense_reward(tmp_path),
                               f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}",
                               "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
                               "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=k3+",
                               "trainer.total_training_steps=1"), tmp_path / "run")
    assert record["actor/grad_norm"] > 0 and record["actor/kl_coef"] == 0.001


def test_rollout_correction_metrics_in_decoupled_and_bypass_modes(tmp_path, tiny_config):
    rc = "algorithm.rollout_correction"
    [d] = run(tiny_config(tmp_path / "d", *QUICK, "trainer.total_training_steps=1", f"{rc}.rollout_is=sequence",
                          f"{rc}.rollout_is_batch_normalize=true", f"{rc}.rollout_rs=token_k1,seq_mean_k3",
                          f"{rc}.rollout_rs_threshold='2.0,0.01'"), tmp_path / "d")
    # sync: the rollout samples with the actor's weights, so weights are 1 and nothing is rejected
    assert d["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
    assert d["rollout_corr/rollout_rs_masked_fraction"] == 0.0
    [b] = run(tiny_config(tmp_path / "b", *QUICK, *dense_reward(tmp_path), "trainer.total_training_steps=1", f"{rc}.bypass_mode=true",
                          f"{rc}.loss_type=reinforce", f"{rc}.rollout_is=token"), tmp_path / "b")
    assert "timing_s/old_log_prob" not in b and b["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
    assert b["actor/grad_norm"] > 0


def test_validation_names_and_logged_generations(tmp_path, tiny_config):
    records = run(tiny_config(tmp_path, "trainer.total_training_steps=2", "trainer.test_freq=2",
                              "actor_rollout_ref.rollout.val_kwargs.n=2", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                              "trainer.log_val_generations=3"), tmp_path)
    for key in ("val-core/arithmetic/reward/mean@2", "val-core/arithmetic/reward/best@2/mean",
                "val-aux/arithmetic/reward/worst@2/mean", "val-aux/arithmetic/reward/std@2"):
        assert key in records[0] and key in records[2], key
    lines = [json.loads(x) for x in open(tmp_path / "val_generations.jsonl")]
    assert [x["step"] for x in lines] == [0, 0, 0, 2, 2, 2]
    assert all(isinstance(x["input"], str) and isinstance(x["output"], str) and 0 <= x["score"] <= 1 for x in lines)


def test_validation_metrics_by_hand():
    # source a: prompt 0 scores 1, 0; prompt 1 scores 1, 1. source b: prompt 2 scores 0, .5
    out = validation_metrics(["a", "a", "a", "a", "b", "b"], [0, 0, 1, 1, 2, 2], [1, 0, 1, 1, 0, 0.5])
    assert out == pytest.approx({
        "val-core/a/reward/mean@2": 0.75, "val-core/a/reward/best@2/mean": 1.0,
        "val-aux/a/reward/worst@2/mean": 0.5, "val-aux/a/reward/std@2": 0.25,
        "val-core/b/reward/mean@2": 0.25, "val-core/b/reward/best@2/mean": 0.5,
        "val-aux/b/reward/worst@2/mean": 0.0, "val-aux/b/reward/std@2": 0.25})
    assert validation_metrics(["a"], [0], [0.5]) == {"val-core/a/reward/mean@1": 0.5}


def test_validation_reports_acc_as_the_core_variable_when_the_reward_returns_it():
    # verl's _val_metrics_update: core_var = "acc" if the reward returned it; the score goes to val-aux.
    # Source b's results lack acc (NaN from collect_results): b keeps reward as its core variable.
    nan = float("nan")
    out = validation_metrics(["a", "a", "b"], [0, 0, 1], [1.0, 0.1, 0.5], {"acc": [1.0, 0.0, nan]})
    assert out == pytest.approx({"val-core/a/acc/mean@2": 0.5, "val-aux/a/acc/std@2": 0.5, "val-core/a/acc/best@2/mean": 1.0,
                   "val-aux/a/acc/worst@2/mean": 0.0, "val-aux/a/reward/mean@2": 0.55,
                   "val-aux/a/reward/std@2": 0.45, "val-aux/a/reward/best@2/mean": 1.0,
                   "val-aux/a/reward/worst@2/mean": 0.1, "val-core/b/reward/mean@1": 0.5})


def test_data_metrics_by_hand():
    zeros = torch.zeros(3, 3)
    batch = RolloutBatch(
        prompts=torch.zeros(3, 2, dtype=torch.long), responses=torch.zeros(3, 3, dtype=torch.long),
        response_mask=T([[1.0, 1, 0], [0, 0, 0], [1, 1, 1]]), prompt_mask=T([[1, 1], [0, 1], [1, 1]]),
        rollout_logprobs=zeros, group_ids=T([0, 1, 2]), versions=T([0, 0, 0]), data_sources=["x"] * 3,
        ground_truths=[""] * 3, extra_infos=[{}] * 3, stop_reasons=["eos", "aborted", "length"],
        token_scores=zeros, token_rewards=zeros, advantages=zeros,
        returns=T([[1.0, 2, 0], [0, 0, 0], [3, 4, 5]]), values=T([[1.0, 2, 0], [0, 0, 0], [3, 4, 4]]))
    m = data_metrics(batch, max_prompt_length=2)
    # lengths 2, 0 (aborted), 3
    assert m["response/aborted_ratio"] == pytest.approx(1 / 3)
    assert (m["response_length_non_aborted/mean"], m["response_length_non_aborted/max"],
            m["response_length_non_aborted/min"]) == pytest.approx((2.5, 3, 2))
    assert m["response_length_non_aborted/clip_ratio"] == pytest.approx(0.5)
    assert m["prompt_length/clip_ratio"] == pytest.approx(2 / 3)  # prompt lengths 2, 1, 2
    # valid returns 1 2 3 4 5 (var 2.5), minus values: 0 0 0 0 1 (var .2)
    assert m["critic/vf_explained_var"] == pytest.approx(1 - 0.2 / 2.50001)


def test_memory_metrics_on_this_machine():
    m = memory_metrics()
    assert m["perf/plait_peak_rss_gb"] > 0 and m["perf/cpu_memory_used_gb"] > 0
    if not torch.cuda.is_available():  # without CUDA the allocator peaks are the process's RSS peak
        assert m["perf/max_memory_allocated_gb"] == m["perf/max_memory_reserved_gb"] == m["perf/plait_peak_rss_gb"]


def test_generations_go_to_jsonl_and_tensorboard_text(tmp_path):
    from plait.trainers.tracking import Tracker
    tracker = Tracker(str(tmp_path), ["tensorboard"], "p", "e", progress=False)
    tracker.log_generations([("1+1=", "2", 1.0), ("a|b", "x\ny", 0.0)], step=3)
    tracker.close()
    lines = [json.loads(x) for x in open(tmp_path / "val_generations.jsonl")]
    assert lines == [{"step": 3, "input": "1+1=", "output": "2", "score": 1.0},
                     {"step": 3, "input": "a|b", "output": "x\ny", "score": 0.0}]
    [events] = os.listdir(tmp_path / "tensorboard")
    raw = (tmp_path / "tensorboard" / events).read_bytes()
    assert b"val/generations" in raw and b"| 1 | a\\|b | x y | 0 |" in raw  # one markdown row per sample


def test_config_refuses_bad_algorithm_settings(tmp_path, tiny_config):
    from plait.configtree import ConfigError
    bad = [("actor_rollout_ref.actor.policy_loss.loss_mode=ppo", "loss_mode"),
           ("algorithm.rollout_correction.rollout_rs=seq_max_k1", "rollout_rs"),
           ("algorithm.rollout_correction.loss_type=ppo", "loss_type")]
    for override, key in bad:
        with pytest.raises(ConfigError, match=key):
            tiny_config(tmp_path, override)
    with pytest.raises(ConfigError, match="rollout.n"):
        tiny_config(tmp_path, "algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1")


def test_critic_reports_its_predictions_and_lr(tmp_path):
    """critic/vpred_mean is the masked mean of the values it predicted in its (first) optimizer step:
    with one mini-batch, those are the values before the update."""
    from plait.config import CriticConfig, OptimConfig
    from plait.models import create_tiny_model
    from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig
    from plait.workers.critic import Critic
    model = create_tiny_model(tmp_path / "m", size="xs", seed=0)
    cfg = CriticConfig(optim=OptimConfig(lr=1e-3, total_training_steps=4, lr_warmup_steps=2), ppo_mini_batch_size=2,
                       ppo_micro_batch_size_per_gpu=3, ppo_epochs=1, loss_agg_mode="token-mean")
    session = ProfilerSession(GlobalProfilerConfig(), {"critic": RoleProfilerConfig()}, rank=0)
    critic = Critic(model, cfg, 4, session.for_role("critic"))
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(4) < torch.tensor([4, 2, 1, 3, 4, 1, 2, 3])[:, None]).float()  # [8, 4]
    batch = RolloutBatch(
        prompts=torch.randint(4, 90, (8, 3), generator=g), prompt_mask=torch.ones(8, 3, dtype=torch.long),
        responses=torch.randint(4, 90, (8, 4), generator=g), response_mask=mask, rollout_logprobs=torch.zeros(8, 4),
        group_ids=torch.arange(8) // 4, versions=torch.zeros(8, dtype=torch.long), data_sources=["t"] * 8,
        ground_truths=[""] * 8, extra_infos=[{}] * 8, stop_reasons=["eos"] * 8,
        values=torch.zeros(8, 4), returns=torch.randn(8, 4, generator=g) * mask)
    before = critic.compute_values(batch)
    first = critic.update(batch)
    assert first["critic/vpred_mean"] == pytest.approx(((before * mask).sum() / mask.sum()).item(), rel=1e-4)
    assert first["critic/lr"] == 0.0 and critic.update(batch)["critic/lr"] == pytest.approx(5e-4)  # warmup 2 steps


def test_loss_scale_factor_defaults_to_the_max_response_length(tmp_path, tiny_config):
    assert tiny_config(tmp_path).actor_rollout_ref.actor.loss_scale_factor == 6  # TINY's data.max_response_length
    assert tiny_config(tmp_path, "actor_rollout_ref.actor.loss_scale_factor=100").actor_rollout_ref.actor.loss_scale_factor == 100
