"""KL estimators between the policy and a reference, KL coefficient controllers, KL reward penalty.

Estimators work per token from log-probs of the sampled tokens only (no full distributions):
k1 = log p - log q, |k1|, k2 = k1^2 / 2, and the low-variance, always non-negative k3; a name
ending in "+" (verl's `k3+`, `low_var_kl+`, ...) keeps that estimate's value but takes k2's
gradient, the one whose expectation is the true KL gradient. verl's "full" (needs whole
distributions) is not offered: it is unimplemented in verl too. The controllers follow the fixed and adaptive (Ziegler et al. 2019) schedules. Not here: the KL loss
term added to the actor loss, which is `agg_loss(kl_estimate(...), ...)` in the worker.
"""

from __future__ import annotations

import torch
from torch import Tensor

from plait.algorithms.advantages import masked_mean
from plait.algorithms.names import KL_ESTIMATOR_NAMES


def k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return logp - ref_logp


def abs_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return (logp - ref_logp).abs()


def k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    return 0.5 * (logp - ref_logp) ** 2


def k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """ratio - log ratio - 1 with ratio = q/p; unbiased for KL(p||q) under samples from p."""
    log_ratio = torch.clamp(ref_logp - logp, -20.0, 20.0)  # exp stays finite
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1, -10.0, 10.0)


def straight_through(estimator):
    """Value of `estimator`, gradient of k2: k2 - sg(k2) + sg(estimate)."""
    def kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
        grad_path = k2(logp, ref_logp)
        return grad_path - grad_path.detach() + estimator(logp, ref_logp).detach()
    return kl


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate [batch, resp_len] of the kind named by `kl_penalty`/`kl_loss_type`."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {', '.join(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logp, ref_logp)


class FixedKLController:
    """A constant KL coefficient; `update` is a no-op so trainers call both controllers alike."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Moves the coefficient toward `target_kl`, by at most 20% per `horizon` samples (n_steps)."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, "
                             f"got target_kl={target_kl}, horizon={horizon}")
        self.value = init_kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target_kl - 1, -0.2), 0.2)
        self.value *= 1 + proportional_error * n_steps / self.horizon


def make_kl_controller(type: str, kl_coef: float, target_kl: float,
                       horizon: int) -> FixedKLController | AdaptiveKLController:
    """Controller for `algorithm.kl_ctrl.type` ("fixed" or "adaptive")."""
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown kl_ctrl.type {type!r}; valid: fixed, adaptive")


def apply_kl_penalty(token_scores: Tensor, old_logp: Tensor, ref_logp: Tensor,
                     response_mask: Tensor, kl_coef: float,
                     kind: str) -> tuple[Tensor, dict[str, float]]:
    """Token rewards = scores - kl_coef * KL(old policy || ref), zero at padding."""
    mask = response_mask.to(token_scores.dtype)
    kl = kl_estimate(old_logp, ref_logp, kind) * mask  # [batch, resp_len]
    token_rewards = (token_scores - kl_coef * kl) * mask
    metrics = {
        "actor/reward_kl_penalty": masked_mean(kl, mask, dim=-1).mean().item(),
        "actor/reward_kl_penalty_coeff": float(kl_coef),
    }
    return token_rewards, metrics


KL_ESTIMATORS = {
    "k1": k1,
    "kl": k1,
    "abs": abs_k1,
    "k2": k2,
    "mse": k2,
    "k3": k3,
    "low_var_kl": k3,
    "k1+": straight_through(k1),
    "k2+": k2,                   # k2's own gradient already: verl treats k2+ and mse+ as k2
    "mse+": k2,
    "kl+": straight_through(k1),
    "abs+": straight_through(abs_k1),
    "k3+": straight_through(k3),
    "low_var_kl+": straight_through(k3),
}
assert tuple(KL_ESTIMATORS) == KL_ESTIMATOR_NAMES, "plait/algorithms/names.py lists the KL estimators config.py accepts"

