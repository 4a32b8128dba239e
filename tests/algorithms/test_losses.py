"""Loss aggregation, PPO policy and value losses, entropy and log-probs on hand-worked numbers."""

import math

import pytest
import torch
from torch.testing import assert_close

from plait.algorithms.losses import (LOSS_AGG_MODES, agg_loss, entropy_from_logits,
                                     ppo_policy_loss, token_logprobs, value_loss)

torch.set_num_threads(1)
T = torch.tensor


def test_agg_loss_modes_by_hand():
    loss = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = T([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row is all padding
    assert_close(agg_loss(loss, mask, "token-mean"), T(7 / 3))  # (1 + 2 + 4) / 3 tokens
    assert_close(agg_loss(loss, mask, "seq-mean-token-sum"), T(7 / 3))  # (3 + 4 + 0) / 3 seqs
    assert_close(agg_loss(loss, mask, "seq-mean-token-mean"), T(5.5 / 3))  # (1.5 + 4 + 0) / 3
    assert_close(agg_loss(loss, mask, "token-mean", num_tokens=14), T(0.5))
    assert_close(agg_loss(loss, mask, "seq-mean-token-sum", num_seqs=7), T(1.0))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_with_global_normalisers_equal_one_big_batch(mode):
    gen = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=gen)
    lengths = T([5, 1, 3, 0, 2, 4])  # uneven lengths and one empty response
    mask = (torch.arange(5)[None, :] < lengths[:, None]).float()  # [6, 5]
    whole = agg_loss(loss, mask, mode)
    chunks = [slice(0, 2), slice(2, 5), slice(5, 6)]
    norm = dict(num_tokens=mask.sum(), num_seqs=6)  # counts of the whole batch
    summed = sum(agg_loss(loss[c], mask[c], mode, **norm) for c in chunks)
    assert_close(summed, whole)
    # local normalisers would weight the micro-batches wrongly: the test can tell them apart
    local = sum(agg_loss(loss[c], mask[c], mode) for c in chunks)
    assert mode == "token-sum" or not torch.allclose(local, whole)  # a sum has no normaliser


def test_agg_loss_unknown_mode():
    with pytest.raises(ValueError, match="'mean'.*token-mean, token-sum, seq-mean-token-sum, seq-mean"):
        agg_loss(torch.ones(1, 1), torch.ones(1, 1), "mean")


def _ppo_case(ratios, advantages, mask, **kw):
    old_logp = torch.full((1, len(ratios)), -1.0, dtype=torch.float64)
    logp = (old_logp + torch.log(T([ratios], dtype=torch.float64))).requires_grad_()
    loss, metrics = ppo_policy_loss(logp, old_logp, T([advantages], dtype=torch.float64),
                                    T([mask]), **kw)
    loss.backward()
    return loss, metrics, logp.grad[0]


def test_ppo_policy_loss_by_hand():
    # clip 0.2 both sides, clip_c 3. Per token L = max(-A*r, -A*clip(r, 0.8, 1.2)):
    #   A=+1 r=1.1 -> -1.1 (inside)        A=+1 r=1.5 -> -1.2 (upper clip)
    #   A=-1 r=0.5 -> 0.8 (lower clip)     A=-1 r=5   -> max(5, 1.2)=5, dual clip -> 3
    #   A=+2 r=0.5 -> max(-1, -1.6) = -1 (no clip)     padding: A=-1 r=10, ignored
    loss, metrics, grad = _ppo_case([1.1, 1.5, 0.5, 5.0, 0.5, 10.0], [1, 1, -1, -1, 2, -1],
                                    [1, 1, 1, 1, 1, 0])
    assert_close(loss, T((-1.1 - 1.2 + 0.8 + 3 - 1) / 5, dtype=torch.float64))
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 5)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 5)
    kl = -sum(math.log(r) for r in [1.1, 1.5, 0.5, 5.0, 0.5]) / 5  # mean of old_logp - logp
    assert metrics["ppo_kl"] == pytest.approx(kl)
    # dL/dlogp = -A*r on unclipped tokens, 0 where a clip (or the dual clip, or padding) holds
    assert_close(grad, T([-1.1, 0, 0, 0, -1.0, 0], dtype=torch.float64) / 5)


def test_ppo_asymmetric_clip_higher():
    # clip_low 0.2, clip_high 0.28: r=1.25 stays inside, r=1.3 is clipped to 1.28,
    # and with A<0 r=0.7 is clipped to 0.8
    loss, metrics, _ = _ppo_case([1.25, 1.3, 0.7], [1, 1, -1], [1, 1, 1],
                                 clip_low=0.2, clip_high=0.28)
    assert_close(loss, T((-1.25 - 1.28 + 0.8) / 3, dtype=torch.float64))
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 3)


def test_ppo_dual_clip_boundary():
    # A=-1, clip_c=3: just under r=3 the ordinary loss (-A*r = r) applies with gradient r;
    # just over, the loss is the constant 3 and the gradient vanishes
    below, m_below, g_below = _ppo_case([3 - 1e-4], [-1], [1])
    above, m_above, g_above = _ppo_case([3 + 1e-4], [-1], [1])
    assert_close(below, T(3 - 1e-4, dtype=torch.float64))
    assert_close(above, T(3.0, dtype=torch.float64))
    assert (m_below["pg_clipfrac_lower"], m_above["pg_clipfrac_lower"]) == (0.0, 1.0)
    assert_close(g_below, T([3 - 1e-4], dtype=torch.float64))
    assert_close(g_above, T([0.0], dtype=torch.float64))
    # dual clip never touches positive advantages: A=+1 r=5 is clipped at -1.2 as usual
    loss, metrics, _ = _ppo_case([5.0], [1], [1])
    assert_close(loss, T(-1.2, dtype=torch.float64))
    assert metrics["pg_clipfrac_lower"] == 0.0
    with pytest.raises(ValueError, match="must be > 1"):
        _ppo_case([1.0], [1], [1], clip_c=1.0)


def test_ppo_is_weights_and_agg_mode():
    # tokens: A=+1 r=1.1 -> -1.1, A=+1 r=1.5 -> -1.2; weights 2 and 0.5
    old_logp = torch.zeros(1, 2)
    logp = torch.log(T([[1.1, 1.5]]))
    adv, mask = T([[1.0, 1.0]]), torch.ones(1, 2)
    loss, _ = ppo_policy_loss(logp, old_logp, adv, mask, is_weights=T([[2.0, 0.5]]))
    assert_close(loss, T((-2.2 - 0.6) / 2))
    loss, _ = ppo_policy_loss(logp, old_logp, adv, mask, agg_mode="seq-mean-token-sum")
    assert_close(loss, T(-2.3))  # one sequence, token sum


def test_ppo_extreme_log_ratio_stays_finite():
    logp = T([[50.0]])  # log-ratio clamped to 20 before exp
    loss, metrics = ppo_policy_loss(logp, T([[0.0]]), T([[-1.0]]), T([[1.0]]))
    assert_close(loss, T(3.0))  # dual clip bound
    assert metrics["pg_clipfrac_lower"] == 1.0


def test_value_loss_by_hand():
    # cliprange 0.5, values clipped into old +- 0.5:
    #   V=1 old=0.8 R=2: clip(V)=1   -> max(1, 1) = 1
    #   V=2 old=0.5 R=3: clip(V)=1   -> max(1, 4) = 4 (clipped branch)
    #   V=2 old=0.5 R=0: clip(V)=1   -> max(4, 1) = 4
    #   padding V=100, ignored
    values = T([[1.0, 2.0, 2.0, 100.0]], requires_grad=True)
    loss, metrics = value_loss(values, T([[0.8, 0.5, 0.5, 0.0]]), T([[2.0, 3.0, 0.0, 0.0]]),
                               T([[1, 1, 1, 0]]), cliprange=0.5)
    assert_close(loss, T(0.5 * (1 + 4 + 4) / 3))
    assert metrics["vf_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # d/dV of 0.5*(V-R)^2/3 = (V-R)/3 on unclipped tokens; 0 where the clipped value won
    assert_close(values.grad, T([[-1 / 3, 0.0, 2 / 3, 0.0]]))


def test_entropy_from_logits():
    logits = T([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3), -1e4, -1e4]],
                [[1000.0, 1000.0, -1000.0, -1000.0], [5.0, 5.0, 5.0, 5.0]]])
    # uniform over 4: ln 4; p = (1/4, 3/4, 0, 0): -(1/4 ln 1/4 + 3/4 ln 3/4);
    # huge logits do not overflow (exp(1000) would): two equal winners give ln 2, up to float32
    # rounding of 1000.69 - 1000; shifted uniform: ln 4
    two = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    assert_close(entropy_from_logits(logits), T([[math.log(4), two], [math.log(2), math.log(4)]]),
                 atol=1e-4, rtol=0)


def test_token_logprobs_by_hand_and_grad():
    logits = T([[[0.0, 0.0, math.log(2)], [math.log(3), 0.0, 0.0]]], requires_grad=True)
    tokens = T([[2, 0]])
    logp = token_logprobs(logits, tokens)
    # probs (1/4, 1/4, 1/2) -> ln 1/2; probs (3/5, 1/5, 1/5) -> ln 3/5
    assert_close(logp, T([[math.log(0.5), math.log(0.6)]]))
    logp.sum().backward()
    # d log p[tok] / d logits = onehot(tok) - softmax
    assert_close(logits.grad, T([[[-0.25, -0.25, 0.5], [0.4, -0.2, -0.2]]]))


def test_token_logprobs_bf16_upcasts():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 3, 50, generator=gen) * 5 + 30).bfloat16()
    tokens = torch.randint(0, 50, (2, 3), generator=gen)
    expected = torch.log_softmax(logits.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    got = token_logprobs(logits, tokens)
    assert got.dtype == torch.float32
    assert_close(got, expected)
