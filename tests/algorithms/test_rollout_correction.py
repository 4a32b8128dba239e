"""Rollout correction: truncated IS weights, batch normalisation and rejection masks by hand."""

import math

import pytest
import torch
from torch.testing import assert_close

from plait.algorithms.rollout_correction import is_weights, parse_rs, rejection_mask, rollout_correction

torch.set_num_threads(1)
T = torch.tensor
ln = math.log


def test_token_is_weights_truncate_and_report_the_applied_weights():
    log_ratio, mask = T([[ln(3.0), ln(0.5), 5.0]]), T([[1.0, 1.0, 0.0]])
    w, m = is_weights(log_ratio, mask, "token", threshold=2.0)
    assert_close(w, T([[2.0, 0.5, 0.0]]))
    assert m["rollout_is_mean"] == pytest.approx(1.25)  # (2 + .5) / 2: verl 0.9.1 reports the truncated weights
    assert (m["rollout_is_max"], m["rollout_is_min"]) == pytest.approx((2.0, 0.5))
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(0.5)  # the raw 3 > 2
    # ESS on the applied weights: [2, .5] / 1.25 = [1.6, .4]; 1 / mean of squares 1.36
    assert m["rollout_is_eff_sample_size"] == pytest.approx(1 / 1.36)


def test_batch_normalize_token_and_sequence_levels():
    w, m = is_weights(T([[ln(3.0), ln(0.5)]]), T([[1.0, 1.0]]), "token", 2.0, batch_normalize=True)
    assert_close(w, T([[1.6, 0.4]]))  # [2, .5] / 1.25
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(1.25)
    # sequences: ln2 + ln2 -> 4; ln .5 (one token) -> .5. The mean is over sequences, (4 + .5) / 2,
    # not over tokens (4 + 4 + .5) / 3
    log_ratio, mask = T([[ln(2.0), ln(2.0)], [ln(0.5), 3.0]]), T([[1.0, 1.0], [1.0, 0.0]])
    w, m = is_weights(log_ratio, mask, "sequence", 5.0, batch_normalize=True)
    assert_close(w, T([[4 / 2.25, 4 / 2.25], [0.5 / 2.25, 0.0]]))
    w, _ = is_weights(log_ratio, mask, "sequence", 3.0)
    assert_close(w, T([[3.0, 3.0], [0.5, 0.0]]))  # the sequence weight 4 truncated to 3


def test_token_k1_rejection_keeps_ratios_inside_the_bounds():
    # k1 = -log_ratio must lie in [ln .5, ln 2]: -ln3 below, 0 inside, -ln.4 = ln2.5 above
    mask, m = rejection_mask(T([[ln(3.0), 0.0, ln(0.4)]]), torch.ones(1, 3), "token_k1", 2.0)
    assert_close(mask, T([[0.0, 1.0, 0.0]]))
    assert m["rollout_rs_masked_fraction"] == pytest.approx(2 / 3)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(1.0)
    # the old name "token" with explicit bounds "0.2_4": all three now pass
    mask, _ = rejection_mask(T([[ln(3.0), 0.0, ln(0.4)]]), torch.ones(1, 3), "token", "0.2_4")
    assert_close(mask, torch.ones(1, 3))


def test_chained_token_and_sequence_checks():
    # row 0: log ratios .1, -.1 -> k2 .005 each, mean k3 .005: kept.
    # row 1: log ratios 1.5, 0 -> k2 1.125 > .5 rejects token 0; mean k3 (e^1.5 - 2.5) / 2 = .99 > .1
    #        rejects the whole row
    log_ratio, mask = T([[0.1, -0.1], [1.5, 0.0]]), torch.ones(2, 2)
    out, m = rejection_mask(log_ratio, mask, "token_k2,seq_mean_k3", "0.5,0.1")
    assert_close(out, T([[1.0, 1.0], [0.0, 0.0]]))
    assert m["rollout_rs_token_k2_masked_fraction"] == pytest.approx(0.25)
    assert m["rollout_rs_seq_mean_k3_masked_fraction"] == pytest.approx(0.5)
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
    k3_row0 = (math.exp(0.1) - 1.1 + math.exp(-0.1) - 0.9) / 2
    k3_row1 = (math.exp(1.5) - 2.5) / 2
    assert m["rollout_rs_seq_mean_k3_max"] == pytest.approx(k3_row1, rel=1e-5)
    assert m["rollout_rs_seq_mean_k3_min"] == pytest.approx(k3_row0, rel=1e-5)
    assert m["rollout_rs_seq_mean_k3_mean"] == pytest.approx((k3_row0 + k3_row1) / 2, rel=1e-5)  # both rows 2 tokens
    assert m["rollout_rs_token_k2_max"] == pytest.approx(1.125)


def test_rs_spec_errors():
    with pytest.raises(ValueError, match="unknown rollout_rs option 'seq_max_k1'"):
        parse_rs("seq_max_k1", 2.0)
    with pytest.raises(ValueError, match="one per rollout_rs option"):
        parse_rs("token_k1,token_k2,seq_sum_k3", "2,3")
    with pytest.raises(ValueError, match="needs rollout_rs_threshold"):
        parse_rs("token_k1", None)
    assert parse_rs("geometric", "0.5_1.5") == [("seq_mean_k1", 1.5, 0.5)]


def test_rollout_correction_prefixes_metrics_and_returns_the_loss_mask():
    train, rollout = T([[-1.0, -2.0]]), T([[-1.0, -1.0]])  # log ratios 0 and -1
    w, loss_mask, m = rollout_correction(train, rollout, torch.ones(1, 2), "token", 2.0, False, "token_k1", 2.0)
    assert_close(w, T([[1.0, math.exp(-1.0)]]))
    assert_close(loss_mask, T([[1.0, 0.0]]))  # k1 = 1 > ln 2
    assert m["rollout_corr/kl"] == pytest.approx(0.5)  # mean(rollout - train)
    assert m["rollout_corr/k3_kl"] == pytest.approx((math.exp(-1) + 1 - 1) / 2)
    assert "rollout_corr/rollout_is_mean" in m and "rollout_corr/rollout_rs_masked_fraction" in m
