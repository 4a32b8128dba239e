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
