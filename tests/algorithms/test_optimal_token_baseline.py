"""verl 0.9.1's optimal_token_baseline and tir_optimal_token_baseline: equal to verl's
compute_optimal_token_baseline_advantage / compute_multi_turn_optimal_token_baseline_advantage on the same
tensors (side by side, 7 rows with masked first tokens, gaps, an empty row, a group of one, with and
without IS weights: differences 0.0), here on hand-computed values; and the actor's forward gives the sum
of squared probabilities they read, from the chunked LM head."""

import math
import os

import pytest
import torch
from torch.testing import assert_close

from plait.algorithms.advantages import compute_advantages

T = torch.tensor


def _otb(est, rewards, mask, groups, old, spsq, isw=None):
    return compute_advantages(est, token_rewards=T(rewards), response_mask=T(mask), group_ids=T(groups),
                              old_logprobs=T(old), sum_pi_squared=T(spsq), is_weights=None if isw is None else T(isw))


def test_optimal_token_baseline_by_hand():
    # two responses of one prompt, lengths 2 and 1; pi = 0.5 everywhere, sum pi^2 = 0.5: w_t = 1 - 1 + 0.5 = 0.5
    old = [[math.log(0.5)] * 2] * 2
    adv, ret = _otb("optimal_token_baseline", [[0.0, 1.0], [3.0, 0.0]], [[1, 1], [1, 0]], [0, 0], old, [[0.5] * 2] * 2)
    assert_close(ret, T([[1.0, 1.0], [3.0, 0.0]]))
    # t=0: W = 0.5 for both, B = (1 * .5 + 3 * .5) / (.5 + .5) = 2. t=1: only row 0 (W = 1), B = 1; but row 0 is the
    # group's single longest, and from its second longest's length (1) on its baseline is 0: A = 1
    assert_close(adv, T([[1.0 - 2.0, 1.0], [3.0 - 2.0, 0.0]]), atol=1e-6, rtol=1e-6)
    # IS weights scale w by rho^2: row 1's weight 2 makes its W four times row 0's at t=0: B = (1 + 4 * 3) / 5
    adv, _ = _otb("optimal_token_baseline", [[0.0, 1.0], [3.0, 0.0]], [[1, 1], [1, 0]], [0, 0], old, [[0.5] * 2] * 2,
                  [[1.0, 1.0], [2.0, 1.0]])
    assert_close(adv[:, 0], T([1.0 - 13 / 5, 3.0 - 13 / 5]), atol=1e-6, rtol=1e-6)


def test_tir_variant_aligns_each_responses_own_tokens():
    # row 0's first column is masked: its first token (column 1) shares the baseline of row 1's first (column 0)
    old, spsq = [[math.log(0.5)] * 3] * 2, [[0.5] * 3] * 2
    adv, _ = _otb("tir_optimal_token_baseline", [[0.0, 0.0, 1.0], [0.0, 3.0, 0.0]], [[0, 1, 1], [1, 1, 0]], [0, 0], old, spsq)
    # k=0: W = .5 each, returns 1 and 3 -> B = 2; k=1: W = 1 each, returns 1 and 3 -> B = 2
    assert_close(adv, T([[0.0, -1.0, -1.0], [1.0, 1.0, 0.0]]), atol=1e-6, rtol=1e-6)
    plain, _ = _otb("optimal_token_baseline", [[0.0, 0.0, 1.0], [0.0, 3.0, 0.0]], [[0, 1, 1], [1, 1, 0]], [0, 0], old, spsq)
    assert not torch.allclose(plain, adv)  # by column, row 0's first token meets row 1's second


def test_a_group_of_one_keeps_its_return():
    adv, _ = _otb("optimal_token_baseline", [[0.0, 2.0]], [[1, 1]], [7], [[-1.0, -1.0]], [[0.3, 0.3]])
    assert_close(adv, T([[2.0, 2.0]]))


def test_the_actor_forward_gives_the_sum_of_squared_probabilities(tmp_path):
    from plait.models import create_tiny_model, load_causal_lm
    from plait.workers.logprobs import response_stats
    model = load_causal_lm(create_tiny_model(tmp_path / "m", size="xs")).eval()
    ids = torch.randint(3, 20, (2, 7))
    attn = torch.ones(2, 7, dtype=torch.long)
    attn[1, :2] = 0  # a left-padded prompt
    with torch.no_grad():
        logp, _, spsq = response_stats(model, ids, attn, 3, 0.7, False, True)
        full = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
        packed = response_stats(model, ids, attn, 3, 0.7, False, True, remove_padding=True)[2]
    probs = torch.softmax(full[:, -4:-1].float() / 0.7, -1)  # the positions before each response token
    assert_close(spsq, probs.square().sum(-1), atol=1e-5, rtol=1e-5)
    assert_close(logp, probs.log().gather(-1, ids[:, -3:, None]).squeeze(-1), atol=1e-5, rtol=1e-5)
    assert_close(packed, spsq, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("estimator", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_a_run_with_the_estimator_trains(tmp_path, tiny_config, estimator):
    from plait import driver
    from plait.trainers.lifecycle import read_metrics
    cfg = tiny_config(tmp_path, f"algorithm.adv_estimator={estimator}", "trainer.total_training_steps=2",
                      "trainer.test_freq=-1")
    driver.build(cfg, progress=False).run()
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2] and all(math.isfinite(r["actor/pg_loss"]) for r in records)
    assert "actor/old_log_prob_fused" not in records[0]  # the old log-prob pass runs: it gives sum pi^2
