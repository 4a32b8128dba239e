"""Where plait's numbers differed from verl 0.9.1 on the same tensors, now fixed to the release's
behaviour; each on hand-computed values (GSPO's agg mode and RLOO's group of one are in
test_policy_losses.py and test_advantages.py)."""

import os

import pytest
import torch
from torch.testing import assert_close

from plait import driver
from plait.algorithms.kl import kl_estimate
from plait.algorithms.losses import agg_loss
from plait.trainers.lifecycle import read_metrics

T = torch.tensor


def test_token_sum_adds_every_valid_token():
    loss, mask = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), T([[1, 1, 0], [1, 0, 0]])
    assert_close(agg_loss(loss, mask, "token-sum"), T(7.0))  # 1 + 2 + 4


@pytest.mark.parametrize("name", ["k2+", "mse+"])
def test_k2_plus_is_k2_value_and_gradient(name):
    logp = T([[-1.0, -2.0]], requires_grad=True)
    kl = kl_estimate(logp, T([[-1.5, -1.0]]), name)
    assert_close(kl.detach(), T([[0.125, 0.5]]))  # (0.5)^2 / 2, (-1)^2 / 2
    kl.sum().backward()
    assert_close(logp.grad, T([[0.5, -1.0]]))  # d/dlogp of (logp - ref)^2 / 2


def test_adaptive_kl_controller_advances_by_responses(tmp_path, tiny_config):
    # verl 0.9.1: coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * n_steps / horizon, n_steps = prompts x n
    cfg = tiny_config(tmp_path, "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive",
                      "algorithm.kl_ctrl.kl_coef=0.1", "algorithm.kl_ctrl.target_kl=1e-9",
                      "algorithm.kl_ctrl.horizon=100", "algorithm.kl_penalty=abs", "trainer.total_training_steps=2",
                      "trainer.test_freq=-1", "algorithm.adv_estimator=grpo")
    driver.build(cfg, progress=False).run()
    first, second = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert first["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1)
    # the rollout and the actor share the weights at step 1, so the kl is 0 (error -1, clipped to -0.2)
    # or positive after the first update (error +0.2, since target 1e-9): 16 responses per step
    error = -0.2 if first["actor/reward_kl_penalty"] == 0 else 0.2
    assert second["actor/reward_kl_penalty_coeff"] == pytest.approx(0.1 * (1 + error * 16 / 100))


def _loss(mode, logp, old, adv, mask, **knobs):
    from plait.algorithms.losses import PolicyLossKnobs, policy_loss
    logp = T(logp, dtype=torch.float64).requires_grad_()
    loss, metrics = policy_loss(mode, logp, T(old, dtype=torch.float64), T(adv, dtype=torch.float64),
                                T(mask, dtype=torch.float64), PolicyLossKnobs(**knobs))
    loss.backward()
    return loss.item(), metrics, logp.grad


def test_dppo_tv_drops_tokens_whose_probability_moved_past_the_bound():
    import math
    # token 0: p 0.5 -> 0.7 with A=+1 moved up by 0.2 > 0.1: dropped. token 1: p 0.5 -> 0.55 (+0.05): kept,
    # ratio 1.1, loss -1 * 1.1 * log 0.55; token-mean over 2 tokens
    logp, old = [[math.log(0.7), math.log(0.55)]], [[math.log(0.5), math.log(0.5)]]
    loss, metrics, grad = _loss("dppo_tv", logp, old, [[1.0, 1.0]], [[1, 1]], clip_low=0.1, clip_high=0.1)
    assert loss == pytest.approx(-1.1 * math.log(0.55) / 2)
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)
    assert_close(grad, T([[0.0, -1.1 / 2]], dtype=torch.float64))


def test_dro_is_reward_minus_a_quadratic_log_ratio_penalty():
    # -(A logp - beta/2 (logp - old)^2) = -(2 * -1 - 0.5/2 * 0.25) = 2.0625 for one token
    loss, _, grad = _loss("dro", [[-1.0]], [[-1.5]], [[2.0]], [[1]], dro_beta=0.5)
    assert loss == pytest.approx(2.0625)
    assert_close(grad, T([[-2.0 + 0.5 * 0.5]], dtype=torch.float64))  # -A + beta (logp - old)


def test_vectorized_estimators_are_verls_twins():
    from plait.algorithms.advantages import compute_advantages
    rewards, mask, ids = T([[1.0], [3.0], [2.0]]), torch.ones(3, 1), T([0, 0, 1])
    run = lambda name: compute_advantages(name, token_rewards=rewards, response_mask=mask, group_ids=ids,  # noqa: E731
                                          values=None, gamma=1.0, lam=1.0, norm_by_std=True, baselines=None)[0]
    assert_close(run("grpo_vectorized"), run("grpo"))
    assert_close(run("rloo_vectorized"), T([[-2.0], [2.0], [0.0]]))  # 1 - 3, 3 - 1; alone: 0 (rloo keeps 2)
    assert_close(run("rloo"), T([[-2.0], [2.0], [2.0]]))


def test_loss_mode_bypass_mode_selects_verls_bypass():
    from plait.config import load_config
    cfg = load_config(None, ["actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode"])
    assert cfg.algorithm.rollout_correction.bypass_mode and cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "vanilla"


def test_gdpo_normalises_each_reward_component_within_groups_then_whitens():
    import math
    from plait.algorithms.advantages import gdpo
    # component a varies only in group 0 (1, 3), b only in group 1 (2, 4): each gives -+1/sqrt(2) there
    comps = T([[1.0, 3.0, 0.0, 0.0], [0.0, 0.0, 2.0, 4.0]])
    adv, _ = gdpo(comps, T([1.0, 1.0]), torch.ones(4, 1), T([0, 0, 1, 1]))
    # summed: [-r, r, -r, r]; whitened over 4 tokens (unbiased var 2/3): +-sqrt(3)/2
    s = math.sqrt(3) / 2
    assert_close(adv, T([[-s], [s], [-s], [s]]), atol=1e-4, rtol=1e-4)


def test_gdpo_keeps_the_components_of_a_row_whose_first_token_is_masked():
    # verl 0.9.1 places a component at the row's last attended position, whatever the response mask says
    # there; rows 0 and 2 have their first token masked. Side by side with verl's compute_gdpo_outcome_advantage.
    from plait.algorithms.advantages import gdpo
    mask = T([[0, 1, 1], [1, 1, 0], [0, 0, 1], [1, 1, 1]])
    adv, _ = gdpo(T([[1.0, 0.0, 2.0, 1.0], [0.0, 1.0, 3.0, 3.0]]), T([1.0, 0.5]), mask, T([0, 0, 1, 1]))
    # a: +-1/sqrt2 in both groups; b: -+1/sqrt2 in group 0, 0 in group 1; a + b/2 = [r/2, -r/2, r, -r] (r = 0.70711)
    # whitened over the 8 valid tokens: mean -r/4, unbiased var 2.25/7
    r, mean, std = 0.70711, -0.70711 / 4, (2.25 / 7) ** 0.5
    row = [(r / 2 - mean) / std, (-r / 2 - mean) / std, (r - mean) / std, (-r - mean) / std]  # 0.9354, -0.3118, ...
    assert_close(adv, T(row)[:, None] * mask, atol=1e-4, rtol=1e-4)
    assert_close(adv[0], T([0.0, 0.93541, 0.93541]), atol=1e-4, rtol=1e-4)


def test_gdpo_needs_its_reward_keys():
    from plait.config import load_config
    from plait.configtree import ConfigError
    with pytest.raises(ConfigError, match="gdpo_reward_keys=None: the reward components' keys"):
        load_config(None, ["algorithm.adv_estimator=gdpo"])
    cfg = load_config(None, ["algorithm.adv_estimator=gdpo", "+algorithm.gdpo_reward_keys=[format,acc]",
                             "+algorithm.gdpo_reward_weights=[1,2]"])
    assert cfg.algorithm.gdpo_reward_keys == ["format", "acc"] and cfg.algorithm.gdpo_reward_weights == [1.0, 2.0]


def test_gdpo_trains_on_the_reward_functions_components(tmp_path, tiny_config):
    (tmp_path / "reward.py").write_text(
        "def parts(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    code = sum(map(ord, solution_str))\n"
        "    fmt, acc = float(code % 2), float(code % 3 == 0)\n"
        "    return {'score': fmt + acc, 'fmt': fmt, 'acc': acc}\n")
    cfg = tiny_config(tmp_path, f"reward.custom_reward_function.path={tmp_path / 'reward.py'}",
                      "reward.custom_reward_function.name=parts", "algorithm.adv_estimator=gdpo",
                      "+algorithm.gdpo_reward_keys=[fmt,acc]", "trainer.total_training_steps=1", "trainer.test_freq=-1")
    driver.build(cfg, progress=False).run()
    record, = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert "actor/pg_loss" in record and record["critic/advantages/max"] != 0


def test_pf_ppo_weights_as_verl():
    from plait.algorithms.advantages import pf_ppo_weights
    scores = T([1.0, -2.0, 0.0, 2.0])
    assert_close(pf_ppo_weights(scores, "pow", 2.0), T([1.0, 4.0, 0.0, 4.0]) + 1e-8)
    assert_close(pf_ppo_weights(scores, "max_min", 2.0), T([0.0, 1.0, 0.0, 1.0]) + 1e-8)
    assert_close(pf_ppo_weights(scores, "max_random", 2.0), T([0.1, 0.1, 0.1, 0.4]) + 1e-8)


def test_pf_ppo_trains_on_responses_drawn_by_score(tmp_path, tiny_config):
    # verl 0.9.1 applies PF-PPO with gae only; with max_min only the batch's best and worst responses are drawn
    from plait.config import load_config
    from plait.configtree import ConfigError
    with pytest.raises(ConfigError, match="use_pf_ppo=True: false with adv_estimator=grpo"):
        load_config(None, ["algorithm.adv_estimator=grpo", "algorithm.use_pf_ppo=true"])
    (tmp_path / "reward.py").write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return float(sum(map(ord, solution_str)) % 7)\n")  # many distinct scores
    cfg = tiny_config(tmp_path, "algorithm.adv_estimator=gae", "algorithm.use_pf_ppo=true",
                      "algorithm.pf_ppo.reweight_method=max_min", "trainer.total_training_steps=1", "trainer.test_freq=-1",
                      f"reward.custom_reward_function.path={tmp_path / 'reward.py'}", "reward.num_workers=0")
    lifecycle = driver.build(cfg, progress=False)
    seen = []
    compute = lifecycle.trainer.compute_advantage

    def spy(batch, *args):
        before = batch.token_scores.sum(-1).clone()
        metrics = compute(batch, *args)
        seen.append((before, batch.token_scores.sum(-1)))
        return metrics
    lifecycle.trainer.compute_advantage = spy
    lifecycle.run()
    [(before, after)] = seen
    assert len(set(before.tolist())) > 2 and len(after) == 16
    assert set(after.tolist()) <= {before.max().item(), before.min().item()}  # only the extremes are drawn
