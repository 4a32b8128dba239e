"""Rollout correction equal to verl 0.9.1 (`verl.trainer.ppo.rollout_corr_helper`), checked side by side
on the same tensors (weights, masks and every metric, token and sequence IS, TIS and IcePop, batch
normalisation, chained rejection checks); here on hand-computed values and verl's metric names."""

import math

import pytest
import torch

from plait.algorithms.rollout_correction import is_weights, rollout_correction
from plait.config import load_config
from plait.configtree import ConfigError

T = torch.tensor


def _log(ws):
    return torch.log(T([ws]))


def test_truncated_weights_drive_the_is_metrics():
    # w = 0.25, 1, 4 truncated at 2: applied [0.25, 1, 2]; verl reports mean/max/std/ESS of the applied weights
    weights, m = is_weights(_log([0.25, 1.0, 4.0]), torch.ones(1, 3), "token", 2.0)
    assert weights.flatten().tolist() == pytest.approx([0.25, 1.0, 2.0])
    mean = 3.25 / 3
    assert m["rollout_is_mean"] == pytest.approx(mean) and m["rollout_is_max"] == pytest.approx(2.0)
    assert m["rollout_is_min"] == pytest.approx(0.25)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)  # raw 4 > 2
    assert m["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)   # raw 0.25 < 1/2
    assert m["rollout_is_std"] == pytest.approx(math.sqrt((0.0625 + 1 + 4) / 3 - mean ** 2), rel=1e-5)
    ess = 1 / (sum((w / mean) ** 2 for w in (0.25, 1.0, 2.0)) / 3)  # 0.69547
    assert m["rollout_is_eff_sample_size"] == pytest.approx(ess, rel=1e-5)
    assert m["rollout_is_seq_mean"] == pytest.approx(mean) and m["rollout_is_seq_fraction_high"] == 0.0  # raw row mean 1.75


def test_icepop_zeroes_weights_outside_lower_upper():
    # rollout_is_threshold "0.5_5.0": w = 0.4 and 6 fall outside and get weight 0; 1 and 2 are kept as they are
    weights, m = is_weights(_log([0.4, 1.0, 2.0, 6.0]), torch.ones(1, 4), "token", "0.5_5.0")
    assert weights.flatten().tolist() == pytest.approx([0.0, 1.0, 2.0, 0.0])
    assert m["rollout_is_mean"] == pytest.approx(0.75) and m["rollout_is_min"] == 0.0
    assert m["rollout_is_oob_ratio"] == pytest.approx(0.5)
    assert m["rollout_is_ratio_fraction_high"] == pytest.approx(0.25) and m["rollout_is_ratio_fraction_low"] == pytest.approx(0.25)
    assert m["rollout_is_std"] == pytest.approx(math.sqrt(1.25 - 0.5625), rel=1e-5)
    assert m["rollout_is_eff_sample_size"] == pytest.approx(0.45, rel=1e-5)  # 1 / mean([0, 4/3, 8/3, 0]^2)


def test_sequence_icepop_and_batch_normalisation():
    # two sequences: exp(sum log w) = 0.5 * 2 = 1 (kept) and 3 * 3 = 9 (outside [0.2, 3]: 0); normalised by the mean 0.5
    weights, m = is_weights(torch.log(T([[0.5, 2.0], [3.0, 3.0]])), torch.ones(2, 2), "sequence", "0.2_3.0", True)
    assert weights.flatten().tolist() == pytest.approx([2.0, 2.0, 0.0, 0.0])
    assert m["rollout_is_batch_norm_factor"] == pytest.approx(0.5)
    assert m["rollout_is_max"] == pytest.approx(9.0) and m["rollout_is_ratio_fraction_high"] == pytest.approx(0.5)


VERL_NAMES = """chi2_seq chi2_token k3_kl kl log_ppl_abs_diff log_ppl_diff log_ppl_diff_max log_ppl_diff_min ppl_ratio
rollout_is_batch_norm_factor rollout_is_eff_sample_size rollout_is_max rollout_is_mean rollout_is_min rollout_is_oob_ratio
rollout_is_ratio_fraction_high rollout_is_ratio_fraction_low rollout_is_seq_fraction_high rollout_is_seq_fraction_low
rollout_is_seq_max rollout_is_seq_max_deviation rollout_is_seq_mean rollout_is_seq_min rollout_is_seq_std rollout_is_std
rollout_log_ppl rollout_ppl rollout_rs_masked_fraction rollout_rs_seq_masked_fraction rollout_rs_seq_max_k3_fraction_high
rollout_rs_seq_max_k3_fraction_low rollout_rs_seq_max_k3_masked_fraction rollout_rs_seq_max_k3_max rollout_rs_seq_max_k3_mean
rollout_rs_seq_max_k3_min rollout_rs_seq_max_k3_seq_fraction_high rollout_rs_seq_max_k3_seq_masked_fraction
rollout_rs_seq_max_k3_seq_max rollout_rs_seq_max_k3_seq_max_deviation rollout_rs_seq_max_k3_seq_mean
rollout_rs_seq_max_k3_seq_min rollout_rs_seq_max_k3_seq_std rollout_rs_seq_max_k3_std rollout_rs_token_k1_fraction_high
rollout_rs_token_k1_fraction_low rollout_rs_token_k1_masked_fraction rollout_rs_token_k1_max rollout_rs_token_k1_mean
rollout_rs_token_k1_min rollout_rs_token_k1_seq_fraction_high rollout_rs_token_k1_seq_fraction_low
rollout_rs_token_k1_seq_masked_fraction rollout_rs_token_k1_seq_max rollout_rs_token_k1_seq_max_deviation
rollout_rs_token_k1_seq_mean rollout_rs_token_k1_seq_min rollout_rs_token_k1_seq_std rollout_rs_token_k1_std
training_log_ppl training_ppl"""


def test_the_metric_names_are_verls():
    # verl 0.9.1 logs these 60 for IcePop with batch normalisation and the checks token_k1,seq_max_k3
    torch.manual_seed(0)
    train = -torch.rand(3, 4)
    _, _, metrics = rollout_correction(train, train + 0.3 * torch.randn(3, 4), torch.ones(3, 4), "token", "0.5_5.0", True,
                                       "token_k1,seq_max_k3", "0.5_2.0,0.3")
    assert sorted(metrics) == sorted(f"rollout_corr/{name}" for name in VERL_NAMES.split())


def test_icepop_threshold_loads_and_a_bad_one_is_one_line():
    cfg = load_config(None, ["algorithm.rollout_correction.rollout_is=token",
                             "algorithm.rollout_correction.rollout_is_threshold='0.5_2'"])
    assert cfg.algorithm.rollout_correction.rollout_is_threshold == "0.5_2"  # quoted: IcePop, not the number 0.52
    with pytest.raises(ConfigError, match=r"rollout_is_threshold='2_0.5': bounds must be finite and > 0 with lower <= upper"):
        load_config(None, ["algorithm.rollout_correction.rollout_is=token",
                           "algorithm.rollout_correction.rollout_is_threshold='2_0.5'"])
