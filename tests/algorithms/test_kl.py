"""KL estimators, KL controllers and the KL reward penalty on hand-worked numbers."""

import math

import pytest
import torch
from torch.testing import assert_close

from plait.algorithms.kl import (KL_ESTIMATORS, AdaptiveKLController, FixedKLController, abs_k1,
                                 apply_kl_penalty, k1, k3, kl_estimate, make_kl_controller)

torch.set_num_threads(1)
T = torch.tensor

LOGP = T([[-1.0, -2.0, -3.0]])
REF = T([[-1.5, -1.0, -3.0]])  # logp - ref = 0.5, -1, 0


def test_kl_estimators_by_hand():
    assert_close(kl_estimate(LOGP, REF, "k1"), T([[0.5, -1.0, 0.0]]))
    assert_close(kl_estimate(LOGP, REF, "abs"), T([[0.5, 1.0, 0.0]]))
    assert_close(kl_estimate(LOGP, REF, "k2"), T([[0.125, 0.5, 0.0]]))  # 0.5 * d^2
    # k3 with x = ref - logp = -0.5, 1, 0: e^x - x - 1
    assert_close(kl_estimate(LOGP, REF, "k3"), T([[math.exp(-0.5) - 0.5, math.e - 2, 0.0]]))


@pytest.mark.parametrize("alias, name", [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3")])
def test_kl_aliases(alias, name):
    assert_close(kl_estimate(LOGP, REF, alias), kl_estimate(LOGP, REF, name))


def test_k3_clamps_and_stays_non_negative():
    logp = T([[0.0, 0.0, 0.0]])
    ref = T([[30.0, -30.0, 0.3]])
    # x = 30 -> clamped to 20, e^20 - 21 -> clamped to 10; x = -30 -> -20, e^-20 + 19 -> 10
    k3 = kl_estimate(logp, ref, "k3")
    assert_close(k3, T([[10.0, 10.0, math.exp(0.3) - 1.3]]))
    x = torch.linspace(-5, 5, 101)[None]
    assert (kl_estimate(torch.zeros_like(x), x, "k3") >= 0).all()


def test_kl_estimate_unknown():
    with pytest.raises(ValueError, match="'k4'.*k1, kl, abs, k2, mse, k3, low_var_kl"):
        kl_estimate(LOGP, REF, "k4")
    assert set(KL_ESTIMATORS) == {"k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl",
                                  "k1+", "kl+", "abs+", "k2+", "mse+", "k3+", "low_var_kl+"}


def test_fixed_controller_never_moves():
    ctrl = make_kl_controller("fixed", kl_coef=0.05, target_kl=0.1, horizon=100)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(current_kl=10.0, n_steps=64)
    assert ctrl.value == 0.05


def test_adaptive_controller_steps():
    ctrl = make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.5, horizon=100)
    assert isinstance(ctrl, AdaptiveKLController)
    ctrl.update(current_kl=0.55, n_steps=10)  # error 0.55/0.5 - 1 = 0.1 -> * (1 + 0.1*10/100)
    assert ctrl.value == pytest.approx(0.1 * 1.01)
    ctrl.update(current_kl=2.0, n_steps=10)  # error 3 clipped to 0.2 -> * 1.02
    assert ctrl.value == pytest.approx(0.1 * 1.01 * 1.02)
    ctrl.update(current_kl=0.0, n_steps=50)  # error -1 clipped to -0.2 -> * 0.9
    assert ctrl.value == pytest.approx(0.1 * 1.01 * 1.02 * 0.9)


def test_make_kl_controller_errors():
    with pytest.raises(ValueError, match="'pid'.*fixed, adaptive"):
        make_kl_controller("pid", kl_coef=0.1, target_kl=0.1, horizon=10)
    with pytest.raises(ValueError, match="target_kl > 0"):
        make_kl_controller("adaptive", kl_coef=0.1, target_kl=0.0, horizon=10)


def test_apply_kl_penalty_by_hand():
    scores = T([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    old_logp = T([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    ref_logp = T([[-1.5, -1.0, -1.0], [-1.0, -1.0, -5.0]])
    mask = T([[1, 1, 1], [1, 1, 0]])
    rewards, metrics = apply_kl_penalty(scores, old_logp, ref_logp, mask, kl_coef=0.1, kind="k1")
    # k1 = [[0.5, 0, 0], [-1, -1, (3, padding)]]; rewards = scores - 0.1 * k1, 0 at padding
    assert_close(rewards, T([[-0.05, 0.0, 1.0], [0.1, 2.1, 0.0]]))
    # per-sequence masked means 0.5/3 and -2/2, then their mean
    assert metrics["actor/reward_kl_penalty"] == pytest.approx((0.5 / 3 - 1.0) / 2)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.1


@pytest.mark.parametrize("name,base", [("k3+", k3), ("low_var_kl+", k3), ("k1+", k1), ("abs+", abs_k1)])
def test_straight_through_keeps_the_value_and_takes_k2_gradient(name, base):
    logp = torch.tensor([-1.0, -0.2, -3.0], requires_grad=True)
    ref = torch.tensor([-1.5, -0.2, -1.0])
    value = kl_estimate(logp, ref, name)
    assert torch.allclose(value, base(logp, ref))
    value.sum().backward()
    assert torch.allclose(logp.grad, torch.tensor([0.5, 0.0, -2.0]))  # d/dlogp k2 = logp - ref
