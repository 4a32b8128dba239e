"""Flow-GRPO math on hand-computed inputs."""

import math

import pytest
import torch

from plait.algorithms.flow_grpo import flow_grpo_loss, group_advantages, mean_kl


def test_group_advantages_global_std():
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0])
    # group means 2 and 4 -> centred [-1, 1, -2, 2]; batch population std sqrt(14/4)
    adv = group_advantages(rewards, torch.tensor([7, 7, 3, 3]), eps=0.0)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0, -2.0, 2.0]) / math.sqrt(3.5))


def test_group_advantages_group_std_and_eps():
    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0])
    adv = group_advantages(rewards, torch.tensor([0, 0, 1, 1]), eps=1e-4, global_std=False)
    # group stds 1 and 2
    assert torch.allclose(adv, torch.tensor([-1 / 1.0001, 1 / 1.0001, -2 / 2.0001, 2 / 2.0001]))


def test_group_advantages_lone_and_equal_samples_are_zero():
    adv = group_advantages(torch.tensor([5.0, 2.0, 2.0]), torch.tensor([0, 1, 1]), global_std=False)
    assert torch.equal(adv, torch.zeros(3))


def test_flow_grpo_loss_hand_values():
    clip = 0.2
    old = torch.zeros(2, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5], [1.5, 0.5]]))
    adv = torch.tensor([1.0, -1.0])
    loss, metrics = flow_grpo_loss(logp, old, adv, clip_range=clip)
    # A=+1: r=1.5 -> max(-1.5, -1.2) = -1.2 (clipped); r=0.5 -> max(-0.5, -0.8) = -0.5
    # A=-1: r=1.5 -> max(1.5, 1.2) = 1.5;              r=0.5 -> max(0.5, 0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4)
    assert metrics["pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["ppo_kl"] == pytest.approx(-logp.mean().item())
    assert metrics["pg_loss"] == pytest.approx(loss.item())


def test_flow_grpo_loss_clamps_advantages_and_gradient_on_policy():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, metrics = flow_grpo_loss(logp, torch.zeros(2, 3), torch.tensor([10.0, -2.0]), adv_clip_max=5.0)
    assert loss.item() == pytest.approx((-5.0 * 3 + 2.0 * 3) / 6)
    loss.backward()
    # On policy the ratio is 1, inside the clip range: d loss / d logp = -A / (B*K)
    assert torch.allclose(logp.grad, torch.tensor([[-5.0] * 3, [2.0] * 3]) / 6)
    assert metrics["pg_clipfrac"] == 0.0


def test_mean_kl_hand_values():
    mu = torch.tensor([[[1.0, 2.0]], [[0.0, 0.0]]])  # [2, 1, 2]
    # sample 0: mean((1, 4)) / (2 * 0.25) = 5
    assert torch.allclose(mean_kl(mu, torch.zeros_like(mu), 0.5), torch.tensor([5.0, 0.0]))
    per_sample = mean_kl(mu, torch.zeros_like(mu), torch.tensor([1.0, 2.0]))
    assert torch.allclose(per_sample, torch.tensor([1.25, 0.0]))
