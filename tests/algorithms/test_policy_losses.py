"""verl's policy loss modes (gspo, gpg, clip_cov, kl_cov, geo_mean) and seq-mean-token-sum-norm,
each on hand-worked numbers."""

import math

import pytest
import torch
from torch.testing import assert_close

from plait.algorithms.losses import (POLICY_LOSSES, PolicyLossKnobs, agg_loss, policy_loss,
                                     ppo_policy_loss)

torch.set_num_threads(1)
T = torch.tensor


def _run(mode, logp, old_logp, adv, mask, **knobs):
    logp = T(logp, dtype=torch.float64).requires_grad_()
    loss, metrics = policy_loss(mode, logp, T(old_logp, dtype=torch.float64), T(adv, dtype=torch.float64),
                                T(mask, dtype=torch.float64), PolicyLossKnobs(**knobs))
    loss.backward()
    return loss.item(), metrics, logp.grad


def test_seq_mean_token_sum_norm_divides_by_a_constant_length():
    loss = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = T([[1, 1, 0], [1, 0, 0]])
    # token sums 3 and 4; each / 3 (padded length), then the mean over 2 sequences
    assert_close(agg_loss(loss, mask, "seq-mean-token-sum-norm"), T(7 / 6))
    assert_close(agg_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=10), T(0.35))


def test_vanilla_mode_is_the_ppo_loss():
    logp, old, adv, mask = T([[-1.0, -0.5]]), T([[-1.2, -0.2]]), T([[1.0, -1.0]]), T([[1.0, 1.0]])
    got, _ = policy_loss("vanilla", logp, old, adv, mask, PolicyLossKnobs(clip_low=0.1, clip_high=0.3))
    want, _ = ppo_policy_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.3)
    assert_close(got, want)


def test_gspo_clips_the_sequence_ratio():
    # seq 0: log ratios 0.1, 0.3 -> s = e^0.2 = 1.2214 > 1.2 with A=+1: clipped to -1.2, no gradient
    # seq 1: one token, log ratio -0.1 -> s = e^-0.1 = 0.9048 with A=-1: loss 0.9048 (inside)
    args = ([[-1.0, -1.0], [-1.0, -1.0]], [[-1.1, -1.3], [-0.9, -5.0]], [[1.0, 1.0], [-1.0, -1.0]], [[1, 1], [1, 0]])
    loss, metrics, grad = _run("gspo", *args, agg_mode="seq-mean-token-mean")
    assert loss == pytest.approx((-1.2 + math.exp(-0.1)) / 2)  # seq-mean-token-mean
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 3)
    # d/dlogp of -A * s_t where d s_t / d logp = s: the unclipped token gets s / 1 token / 2 seqs
    assert_close(grad, T([[0.0, 0.0], [math.exp(-0.1) / 2, 0.0]], dtype=torch.float64))
    # verl 0.9.1 aggregates GSPO with actor.loss_agg_mode (token-mean by default): 3 valid tokens
    loss, _, grad = _run("gspo", *args)
    assert loss == pytest.approx((-1.2 - 1.2 + math.exp(-0.1)) / 3)
    assert_close(grad, T([[0.0, 0.0], [math.exp(-0.1) / 3, 0.0]], dtype=torch.float64))
    loss, _, _ = _run("gspo", *args, agg_mode="token-sum")
    assert loss == pytest.approx(-1.2 - 1.2 + math.exp(-0.1))


def test_gpg_is_plain_policy_gradient():
    loss, metrics, grad = _run("gpg", [[-1.0, -2.0]], [[0.0, 0.0]], [[2.0, 2.0]], [[1, 1]])
    assert loss == pytest.approx(3.0)  # (2*1 + 2*2) / 2 tokens
    assert_close(grad, T([[-1.0, -1.0]], dtype=torch.float64))


def test_clip_cov_detaches_the_token_with_covariance_in_the_window():
    # ratio 1 everywhere (nothing PPO-clipped). A mean 0, logp mean -2:
    # cov = A * (logp + 2) = [3*1, 0.5*(-1), 0, 0] = [3, -0.5, 0, 0]; only token 0 is in (1, 5)
    loss, metrics, grad = _run("clip_cov", [[-1.0, -3.0, -2.0, -2.0]], [[-1.0, -3.0, -2.0, -2.0]],
                               [[3.0, 0.5, -1.75, -1.75]], [[1, 1, 1, 1]])
    assert loss == pytest.approx((0 - 0.5 + 1.75 + 1.75) / 4)
    assert metrics["pg_clipfrac"] == pytest.approx(0.25)
    assert grad[0, 0] == 0.0 and grad[0, 1] == pytest.approx(-0.5 / 4)


def test_kl_cov_penalises_the_top_covariance_token():
    # log ratios [0.1, 0, 0, 0]; cov as above picks token 0: -3 e^0.1 + 0.1 * |0.1|
    loss, metrics, _ = _run("kl_cov", [[-1.0, -3.0, -2.0, -2.0]], [[-1.1, -3.0, -2.0, -2.0]],
                            [[3.0, 0.5, -1.75, -1.75]], [[1, 1, 1, 1]], ppo_kl_coef=0.1)
    assert loss == pytest.approx((-3 * math.exp(0.1) + 0.01 - 0.5 + 1.75 + 1.75) / 4)
    assert metrics["ppo_kl"] == pytest.approx(0.025)  # mean |log ratio|


def test_geo_mean_clips_log_ratios_pessimistically():
    # seq 0, A=+1: log ratios [0.3, -0.1] -> [0.2, -0.1], mean 0.05; loss -e^0.05
    # seq 1, A=-1: log ratios [-0.3, 0.1] -> [-0.2, 0.1], mean -0.05; loss +e^-0.05
    loss, metrics, _ = _run("geo_mean", [[0.3, -0.1], [-0.3, 0.1]], [[0.0, 0.0], [0.0, 0.0]],
                            [[1.0, 1.0], [-1.0, -1.0]], [[1, 1], [1, 1]])
    assert loss == pytest.approx((-math.exp(0.05) + math.exp(-0.05)) / 2)
    assert metrics["pg_clipfrac"] == pytest.approx(0.25)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(0.25)


def test_sapo_gates_the_ratio_smoothly():
    # r = e^0.5 with A = +1 (tau_pos 1): -(4/1) sigmoid(e^0.5 - 1); r = 1 with A = -2 (tau_neg 2): 2 * (4/2) * 0.5
    loss, metrics, grad = _run("sapo", [[0.5, 0.0]], [[0.0, 0.0]], [[1.0, -2.0]], [[1, 1]], tau_pos=1.0, tau_neg=2.0)
    sig = 1 / (1 + math.exp(-(math.exp(0.5) - 1)))
    assert loss == pytest.approx((-4 * sig + 2.0) / 2)  # seq-mean-token-mean over one sequence of 2 tokens
    # at r = 1 the gate's slope is 1, so the gradient is PPO's: -A * r / 2 tokens = 1
    assert grad[0, 1].item() == pytest.approx(1.0)
    assert grad[0, 0].item() == pytest.approx(-4 * sig * (1 - sig) * math.exp(0.5) / 2)


def test_cispo_weights_log_probs_by_the_clipped_ratio():
    # r = e^0.5 (clipped to 1.2) with A = 1; r = 1 with A = 1: loss -(1.2 * logp0 + 1 * logp1) / 2
    loss, metrics, grad = _run("cispo", [[-0.5, -1.0]], [[-1.0, -1.0]], [[1.0, 1.0]], [[1, 1]])
    assert loss == pytest.approx(-(1.2 * -0.5 + 1.0 * -1.0) / 2)
    assert_close(grad, T([[-0.6, -0.5]], dtype=torch.float64))  # the clipped token keeps its gradient
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)


def test_unknown_mode_names_the_valid_ones():
    assert set(POLICY_LOSSES) == {"vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "geo_mean", "sapo", "cispo",
                                 "dppo_tv", "dppo_kl", "dro"}
    with pytest.raises(ValueError, match="'ppo'.*vanilla, gspo"):
        policy_loss("ppo", *[torch.zeros(1, 1)] * 4, PolicyLossKnobs())
