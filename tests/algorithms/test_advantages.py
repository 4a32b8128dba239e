"""Advantage estimators against numbers worked out by hand in the comments."""

import math

import pytest
import torch
from torch.testing import assert_close

from plait.algorithms.advantages import (ESTIMATORS, compute_advantages, gae, gpg, grpo, grpo_passk,
                                         masked_mean, masked_whiten, opo, reinforce_plus_plus,
                                         reinforce_plus_plus_baseline, remax, rloo, gdpo,
                                         optimal_token_baseline, tir_optimal_token_baseline)

torch.set_num_threads(1)
T = torch.tensor


def whiten_by_hand(values):
    """Unbiased whitening of a flat list, the way masked_whiten should treat valid tokens."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return [(v - mean) / std for v in values]


def test_masked_mean_all_and_per_row_with_empty_row():
    x = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = T([[1, 1, 0], [0, 0, 0]])
    assert_close(masked_mean(x, mask), T(1.5))  # (1 + 2) / 2
    assert_close(masked_mean(x, mask, dim=-1), T([1.5, 0.0]))  # empty row gives 0, not NaN


def test_masked_whiten_unbiased_and_zero_at_padding():
    x = T([[1.0, 2.0, 3.0, 100.0]])
    mask = T([[1, 1, 1, 0]])
    # mean 2, unbiased var (1 + 0 + 1) / 2 = 1
    assert_close(masked_whiten(x, mask), T([[-1.0, 0.0, 1.0, 0.0]]))
    assert_close(masked_whiten(x, torch.zeros_like(mask)), torch.zeros_like(x))  # no NaN
    assert_close(masked_whiten(x, T([[0, 1, 0, 0]])), torch.zeros_like(x))  # one valid token


# Four samples; group 7 holds samples 0, 2, 3 and group 3 holds sample 1 alone.
# Scores are rewards summed over valid tokens (the 5s of sample 1 sit in padding):
#   s = [1, 2, 3, 5]
REWARDS = T([[0.0, 0.0, 1.0], [2.0, 5.0, 5.0], [0.0, 3.0, 0.0], [0.0, 0.0, 5.0]])
MASK = T([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
GROUPS = T([7, 3, 7, 7])


def test_grpo_by_hand():
    eps = 1e-6
    adv, returns = grpo(REWARDS, MASK, GROUPS, eps=eps)
    # group 7: scores 1, 3, 5 -> mean 3, unbiased std sqrt((4 + 0 + 4) / 2) = 2
    # group 3: alone -> mean 0, std 1, so A = s = 2
    a0, a2, a3 = -2 / (2 + eps), 0.0, 2 / (2 + eps)
    a1 = 2 / (1 + eps)
    expected = T([[a0, a0, a0], [a1, 0, 0], [a2, a2, 0], [a3, a3, a3]])
    assert_close(adv, expected)
    assert_close(returns, expected)


def test_dr_grpo_skips_std():
    adv, _ = grpo(REWARDS, MASK.bool(), GROUPS, norm_by_std=False)
    # s - mean: group 7 -> -2, 0, 2; the lone sample keeps its score 2
    assert_close(adv, T([[-2.0, -2, -2], [2, 0, 0], [0, 0, 0], [2, 2, 2]]))


def test_grpo_pair_group_and_identical_scores():
    # scores 1 and 3: mean 2, std sqrt(2) -> A = -+1/sqrt(2); equal scores carry no signal
    rewards = T([[1.0], [3.0], [4.0], [4.0]])
    adv, _ = grpo(rewards, torch.ones(4, 1), T([0, 0, 1, 1]))
    r = 1 / math.sqrt(2)
    assert_close(adv, T([[-r], [r], [0.0], [0.0]]), atol=1e-5, rtol=1e-5)


def test_rloo_by_hand():
    adv, returns = rloo(REWARDS, MASK, GROUPS)
    # group 7: 1 - (3+5)/2 = -3, 3 - (1+5)/2 = 0, 5 - (1+3)/2 = 3; the lone sample keeps its score 2
    # (verl 0.9.1: no baseline for a group of one, the raw score is the advantage)
    expected = T([[-3.0, -3, -3], [2, 0, 0], [0, 0, 0], [3, 3, 3]])
    assert_close(adv, expected)
    assert_close(returns, expected)


def test_reinforce_plus_plus_by_hand():
    rewards = T([[1.0, 0.0, 2.0], [0.0, 3.0, 9.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, returns = reinforce_plus_plus(rewards, mask, gamma=0.5)
    # row 0: t2 = 2, t1 = 0 + 0.5*2 = 1, t0 = 1 + 0.5*1 = 1.5
    # row 1: t2 is padding (its 9 is ignored), t1 = 3, t0 = 0 + 0.5*3 = 1.5
    assert_close(returns, T([[1.5, 1.0, 2.0], [1.5, 3.0, 0.0]]))
    w = whiten_by_hand([1.5, 1.0, 2.0, 1.5, 3.0])  # mean 1.8, var 2.3 / 4
    assert_close(adv, T([[w[0], w[1], w[2]], [w[3], w[4], 0.0]]))


def test_reinforce_plus_plus_carries_over_masked_tokens():
    # the middle token is masked (e.g. tool output): it earns nothing and does not discount
    # t2 = 2, t1 -> 0 (carry 2), t0 = 1 + 0.5*2 = 2
    _, returns = reinforce_plus_plus(T([[1.0, 7.0, 2.0]]), T([[1, 0, 1]]), gamma=0.5)
    assert_close(returns, T([[2.0, 0.0, 2.0]]))


def test_gae_by_hand():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = T([[0.5, 0.5, 0.5], [1.0, 1.0, 7.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    adv, returns = gae(rewards, values, mask, gamma=0.5, lam=0.5)  # gamma*lam = 0.25
    # row 0: d2 = 1 + 0 - 0.5 = 0.5                A2 = 0.5
    #        d1 = 0 + 0.5*0.5 - 0.5 = -0.25        A1 = -0.25 + 0.25*0.5 = -0.125
    #        d0 = 0 + 0.25 - 0.5 = -0.25           A0 = -0.25 + 0.25*-0.125 = -0.28125
    # row 1: t2 padding (value 7 unused), value after t1 is 0
    #        d1 = 2 + 0 - 1 = 1                    A1 = 1
    #        d0 = 0 + 0.5*1 - 1 = -0.5             A0 = -0.5 + 0.25*1 = -0.25
    raw = [-0.28125, -0.125, 0.5, -0.25, 1.0]
    assert_close(returns, T([[-0.28125 + 0.5, -0.125 + 0.5, 0.5 + 0.5], [-0.25 + 1, 1 + 1, 0.0]]))
    w = whiten_by_hand(raw)
    assert_close(adv, T([[w[0], w[1], w[2]], [w[3], w[4], 0.0]]))


def test_gae_carries_over_masked_tokens():
    # t2: d = 1 - 2 = -1, A2 = -1; t1 masked: A and next value (2) carried;
    # t0: d = 0 + 0.5*2 - 1 = 0, A0 = 0 + 0.5*1*(-1) = -0.5
    _, returns = gae(T([[0.0, 5.0, 1.0]]), T([[1.0, 9.0, 2.0]]), T([[1, 0, 1]]), gamma=0.5, lam=1.0)
    assert_close(returns, T([[-0.5 + 1, 0.0, -1 + 2]]))


def test_gae_with_gamma_lam_one_is_return_minus_value():
    rewards = T([[0.0, 0.0, 1.0]])
    values = T([[0.2, 0.4, 0.6]])
    _, returns = gae(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert_close(returns, T([[1.0, 1.0, 1.0]]))  # Monte Carlo return everywhere


def test_compute_advantages_dispatches_to_each_estimator():
    values = torch.rand(4, 3)
    baselines = torch.rand(4)
    PAIRS = T([7, 3, 7, 3])  # grpo_passk needs two samples per group
    components = torch.rand(2, 4)
    old, spsq = -torch.rand(4, 3), torch.rand(4, 3)
    kw = dict(token_rewards=REWARDS, response_mask=MASK, group_ids=PAIRS, components=components, old_logprobs=old,
              sum_pi_squared=spsq)
    direct = {
        "optimal_token_baseline": optimal_token_baseline(REWARDS, MASK, PAIRS, old, spsq),
        "tir_optimal_token_baseline": tir_optimal_token_baseline(REWARDS, MASK, PAIRS, old, spsq),
        "gdpo": gdpo(components, torch.ones(2), MASK, PAIRS, norm_by_std=False),
        "grpo": grpo(REWARDS, MASK, PAIRS, norm_by_std=False),
        "rloo": rloo(REWARDS, MASK, PAIRS),
        "reinforce_plus_plus": reinforce_plus_plus(REWARDS, MASK, gamma=0.9),
        "gae": gae(REWARDS, values, MASK, gamma=0.9, lam=0.8),
        "grpo_passk": grpo_passk(REWARDS, MASK, PAIRS, norm_by_std=False),
        "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline(REWARDS, MASK, PAIRS),
        "remax": remax(REWARDS, MASK, baselines),
        "opo": opo(REWARDS, MASK, PAIRS),
        "gpg": gpg(REWARDS, MASK, PAIRS),
        "grpo_vectorized": grpo(REWARDS, MASK, PAIRS, norm_by_std=False),
        "rloo_vectorized": rloo(REWARDS, MASK, PAIRS, lone_keeps_score=False),
    }
    assert set(direct) == set(ESTIMATORS)
    for name, (adv, ret) in direct.items():
        got_adv, got_ret = compute_advantages(name, **kw, values=values, gamma=0.9, lam=0.8,
                                              norm_by_std=False, baselines=baselines)
        assert_close(got_adv, adv)
        assert_close(got_ret, ret)


def test_compute_advantages_errors():
    kw = dict(token_rewards=REWARDS, response_mask=MASK, group_ids=GROUPS)
    with pytest.raises(ValueError, match="'ppo'.*grpo, grpo_passk, rloo, grpo_vectorized, rloo_vectorized, reinforce_plus_plus"):
        compute_advantages("ppo", **kw)
    with pytest.raises(ValueError, match="gae.*values"):
        compute_advantages("gae", **kw)
    with pytest.raises(ValueError, match="remax.*greedy"):
        compute_advantages("remax", **kw)


def test_grpo_passk_only_the_best_learns():
    # group 0 scores 1, 0, 0.5: best minus second best 0.5; unbiased std 0.5 -> 1
    rewards, mask, groups = T([[1.0], [0.0], [0.5], [0.0], [2.0]]), torch.ones(5, 1), T([0, 0, 0, 1, 1])
    adv, _ = grpo_passk(rewards, mask, groups, norm_by_std=False)
    assert_close(adv, T([[0.5], [0.0], [0.0], [0.0], [2.0]]))
    adv, _ = grpo_passk(rewards, mask, groups)
    assert adv[0, 0].item() == pytest.approx(1.0, rel=1e-5)
    assert adv[4, 0].item() == pytest.approx(2.0 / math.sqrt(2.0), rel=1e-5)  # std of 0, 2 is sqrt(2)
    with pytest.raises(ValueError, match="at least 2"):
        grpo_passk(T([[1.0]]), torch.ones(1, 1), T([7]))


def test_reinforce_plus_plus_baseline_by_hand():
    # group A scores 1, 0 (mean .5) -> .5, -.5; group B alone -> its score 1.
    # valid tokens .5 .5 | -.5 | 1 1: whitened with mean .5, unbiased std sqrt(.375)
    rewards = T([[0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    rewards[1, 0] = 0.0
    rewards[2, 1] = 1.0
    mask = T([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    adv, _ = reinforce_plus_plus_baseline(rewards, mask, T([0, 0, 1]))
    s = math.sqrt(0.375)
    assert_close(adv, T([[0.0, 0.0], [-1 / s, 0.0], [0.5 / s, 0.5 / s]]))


def test_remax_subtracts_the_greedy_score():
    rewards = T([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    mask = T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, ret = remax(rewards, mask, baselines=T([0.4, 1.0]))
    assert_close(ret, T([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]))
    assert_close(adv, T([[0.6, 0.6, 0.6], [0.0, 0.0, 0.0]]))


def test_opo_length_weighted_baseline():
    # group scores 1 (length 1) and 0 (length 3): baseline (1*1 + 3*0) / 4 = .25; alone: its score
    rewards = T([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    mask = T([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv, _ = opo(rewards, mask, T([0, 0, 1]))
    assert_close(adv, T([[0.75, 0.0, 0.0], [-0.25, -0.25, -0.25], [2.0, 2.0, 0.0]]))


def test_gpg_scales_by_the_share_of_nonzero_scores():
    # scores 1 0 | 1 1: 3 of 4 non-zero -> alpha 4/3; group means .5 and 1
    adv, _ = gpg(T([[1.0], [0.0], [1.0], [1.0]]), torch.ones(4, 1), T([0, 0, 1, 1]))
    assert_close(adv, T([[2 / 3], [-2 / 3], [0.0], [0.0]]))
