"""Advantage estimators: GRPO (and Dr.GRPO), RLOO, REINFORCE++ and GAE, plus masked statistics.

Every estimator is a pure function of per-token rewards and a response mask and returns
`(advantages, returns)`, both [batch, resp_len] and zero at padding. Outcome rewards are per-token
tensors whose sum over the response is the sample's score (a reward model puts it on the last
token). Not here: the KL penalty that shapes the rewards (kl.py) and the losses that consume
advantages (losses.py).
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over positions where `mask` is set; 0 (not NaN) where nothing is set."""
    mask = mask.to(x.dtype)
    total = (x * mask).sum() if dim is None else (x * mask).sum(dim)
    count = mask.sum() if dim is None else mask.sum(dim)
    return total / count.clamp(min=1e-8)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Shift and scale `x` to zero mean, unit (unbiased) std over masked positions; 0 elsewhere."""
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    # Bessel's correction; one valid token has no spread, so (x - mean) = 0 there anyway.
    var = ((x - mean) ** 2 * mask).sum() / (mask.sum() - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def _group_stats(scores: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group size, group mean and unbiased group std (0 for a group of one)."""
    _, idx = torch.unique(group_ids, return_inverse=True)  # [batch], ids need not be contiguous
    size = torch.bincount(idx).to(scores.dtype)  # [groups]
    mean = torch.zeros_like(size).index_add_(0, idx, scores) / size  # [groups]
    sq_dev = torch.zeros_like(size).index_add_(0, idx, (scores - mean[idx]) ** 2)  # [groups]
    std = (sq_dev / (size - 1).clamp(min=1)).sqrt()  # [groups]
    return size[idx], mean[idx], std[idx]  # each [batch]


def grpo(token_rewards: Tensor, response_mask: Tensor, group_ids: Tensor,
         norm_by_std: bool = True, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Group-relative advantage (s - mean_group) / (std_group + eps), one value per response.

    `norm_by_std=False` is Dr.GRPO: no division by the std. A group of one has no baseline, so
    it uses mean 0 and std 1 and its advantage is its score.
    """
    mask = response_mask.to(token_rewards.dtype)
    scores = (token_rewards * mask).sum(-1)  # [batch]
    size, mean, std = _group_stats(scores, group_ids)
    alone = size == 1
    mean = torch.where(alone, 0.0, mean)
    adv = scores - mean  # [batch]
    if norm_by_std:
        adv = adv / (torch.where(alone, 1.0, std) + eps)
    adv = adv[:, None] * mask  # [batch, resp_len]
    return adv, adv


def rloo(token_rewards: Tensor, response_mask: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """Leave-one-out baseline: s_i minus the mean of the other samples of its group (0 if alone)."""
    mask = response_mask.to(token_rewards.dtype)
    scores = (token_rewards * mask).sum(-1)  # [batch]
    size, mean, _ = _group_stats(scores, group_ids)
    # s_i - (n*mean - s_i)/(n-1) = n/(n-1) * (s_i - mean)
    adv = torch.where(size > 1, size / (size - 1).clamp(min=1) * (scores - mean), 0.0)  # [batch]
    adv = adv[:, None] * mask  # [batch, resp_len]
    return adv, adv


def reinforce_plus_plus(token_rewards: Tensor, response_mask: Tensor,
                        gamma: float) -> tuple[Tensor, Tensor]:
    """Discounted return-to-go per valid token, whitened over all valid tokens of the batch.

    Masked tokens inside a response (e.g. tool output) neither earn reward nor discount: the
    running return passes them unchanged. Returns are the un-whitened returns-to-go.
    """
    mask = response_mask.to(token_rewards.dtype)
    returns = torch.zeros_like(token_rewards)  # [batch, resp_len]
    running = torch.zeros_like(token_rewards[:, 0])  # [batch]
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        running = m * (token_rewards[:, t] + gamma * running) + (1 - m) * running
        returns[:, t] = running * m
    return masked_whiten(returns, mask), returns


def gae(token_rewards: Tensor, values: Tensor, response_mask: Tensor, gamma: float,
        lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over valid tokens; advantages whitened, returns = A + V.

    The value after the last valid token is 0. Masked tokens inside a response are skipped: the
    next value and the running advantage are carried over them unchanged.
    """
    mask = response_mask.to(token_rewards.dtype)
    advantages = torch.zeros_like(token_rewards)  # [batch, resp_len]
    next_value = torch.zeros_like(token_rewards[:, 0])  # [batch]
    last_adv = torch.zeros_like(next_value)  # [batch]
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        last_adv = m * (delta + gamma * lam * last_adv) + (1 - m) * last_adv
        next_value = m * values[:, t] + (1 - m) * next_value
        advantages[:, t] = last_adv * m
    returns = (advantages + values) * mask
    return masked_whiten(advantages, mask), returns


def compute_advantages(estimator: str, *, token_rewards: Tensor, response_mask: Tensor,
                       group_ids: Tensor, values: Tensor | None = None, gamma: float = 1.0,
                       lam: float = 1.0, norm_by_std: bool = True) -> tuple[Tensor, Tensor]:
    """Run the estimator named by `algorithm.adv_estimator`; returns (advantages, returns)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; "
                         f"valid: {', '.join(ESTIMATORS)}")
    if estimator == "gae" and values is None:
        raise ValueError("the 'gae' estimator needs values from a critic: "
                         "pass values=[batch, resp_len]")
    return ESTIMATORS[estimator](token_rewards, response_mask, group_ids, values, gamma, lam,
                                 norm_by_std)


# Each entry takes compute_advantages' inputs in this order and uses the ones its method needs:
# (token_rewards, response_mask, group_ids, values, gamma, lam, norm_by_std).
ESTIMATORS = {
    "grpo": lambda r, m, g, v, gamma, lam, by_std: grpo(r, m, g, norm_by_std=by_std),
    "rloo": lambda r, m, g, v, gamma, lam, by_std: rloo(r, m, g),
    "reinforce_plus_plus": lambda r, m, g, v, gamma, lam, by_std: reinforce_plus_plus(r, m, gamma),
    "gae": lambda r, m, g, v, gamma, lam, by_std: gae(r, v, m, gamma, lam),
}
