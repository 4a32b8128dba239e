"""Advantage estimators under verl's `algorithm.adv_estimator` names, plus masked statistics.

GRPO (and Dr.GRPO), GRPO pass@k, RLOO, REINFORCE++ (and its group-baseline variant), ReMax (a
greedy response's score as the baseline: the trainer generates it), OPO (length-weighted group
baseline), GPG and GAE.

Every estimator is a pure function of per-token rewards and a response mask and returns
`(advantages, returns)`, both [batch, resp_len] and zero at padding. Outcome rewards are per-token
tensors whose sum over the response is the sample's score (a reward model puts it on the last
token). Not here: the KL penalty that shapes the rewards (kl.py) and the losses that consume
advantages (losses.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from plait.algorithms.names import ESTIMATOR_NAMES


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


def rloo(token_rewards: Tensor, response_mask: Tensor, group_ids: Tensor,
         lone_keeps_score: bool = True) -> tuple[Tensor, Tensor]:
    """Leave-one-out baseline: s_i minus the mean of the other samples of its group. Alone, verl 0.9.1's
    rloo keeps s_i and its rloo_vectorized gives 0 (`lone_keeps_score`)."""
    mask = response_mask.to(token_rewards.dtype)
    scores = (token_rewards * mask).sum(-1)  # [batch]
    size, mean, _ = _group_stats(scores, group_ids)
    # s_i - (n*mean - s_i)/(n-1) = n/(n-1) * (s_i - mean)
    adv = torch.where(size > 1, size / (size - 1).clamp(min=1) * (scores - mean),
                      scores if lone_keeps_score else 0.0)  # [batch]
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


def gdpo(components: Tensor, weights: Tensor, response_mask: Tensor, group_ids: Tensor,
         norm_by_std: bool = True) -> tuple[Tensor, Tensor]:
    """GDPO: each reward component [k, batch] normalised within its groups as GRPO does, summed with
    `weights` [k], then whitened over the batch's valid tokens (so no one component drowns the others).
    A component is its row's score whichever of its tokens are masked (verl 0.9.1 places it at the row's
    last attended position, not through the response mask)."""
    mask = response_mask.to(components.dtype)
    total, whole = torch.zeros_like(mask), torch.ones_like(mask[:, :1])  # whole: [batch, 1]
    for comp, w in zip(components, weights):
        total = total + w * grpo(comp[:, None].to(mask.dtype), whole, group_ids, norm_by_std)[0] * mask
    adv = masked_whiten(total, mask)  # [batch, resp_len]
    return adv, adv


def optimal_token_baseline(token_rewards: Tensor, response_mask: Tensor, group_ids: Tensor, old_logprobs: Tensor,
                           sum_pi_squared: Tensor, is_weights: Tensor | None = None,
                           eps: float = 1e-8) -> tuple[Tensor, Tensor]:
    """verl 0.9.1's optimal token baseline: A_t = G_t - B_t with G_t the reward-to-go and, per group and
    position t, B_t = sum_i G_t W_t / sum_i W_t, where W_t = sum_{j<=t} (1 - 2 pi_j + sum_v pi_v^2) (times the
    rollout IS weight squared when given) is the path's accumulated score-function variance. A group of one
    has no baseline; the longest response's positions past its group's second longest get none either."""
    mask = response_mask.to(token_rewards.dtype)
    returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)            # [batch, resp_len]
    w = 1 - 2 * old_logprobs.exp() + sum_pi_squared                          # [batch, resp_len]
    if is_weights is not None:
        w = w * is_weights ** 2
    cumulative = (w * mask).cumsum(-1)                                        # [batch, resp_len]
    baselines = _group_token_baselines(returns, cumulative, mask, group_ids, eps)
    return (returns - baselines) * mask, returns


def tir_optimal_token_baseline(token_rewards: Tensor, response_mask: Tensor, group_ids: Tensor, old_logprobs: Tensor,
                               sum_pi_squared: Tensor, is_weights: Tensor | None = None,
                               eps: float = 1e-8) -> tuple[Tensor, Tensor]:
    """The optimal token baseline over each response's own tokens (verl 0.9.1's multi-turn variant): the
    k-th unmasked token of every response in a group shares a baseline, whatever column it sits in
    (tool outputs masked between turns shift it); empty responses are left out of their group."""
    mask = response_mask.to(token_rewards.dtype)
    returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)            # [batch, resp_len]
    w = 1 - 2 * old_logprobs.exp() + sum_pi_squared
    if is_weights is not None:
        w = w * is_weights ** 2
    cumulative = (w * mask).cumsum(-1)
    rows, cols = mask.bool().nonzero(as_tuple=True)                          # [N] each
    place = (mask.cumsum(-1) - 1).long()[rows, cols]                          # [N]: k of the k-th unmasked token
    lengths = mask.sum(-1).long()                                             # [batch]
    width = int(lengths.max()) if len(lengths) else 0
    packed = lambda x: x.new_zeros(len(mask), width).index_put((rows, place), x[rows, cols])  # noqa: E731
    packed_mask = (torch.arange(width)[None] < lengths[:, None]).to(mask.dtype)  # [batch, width]
    empty = lengths == 0  # alone in a group of their own: no baseline
    ids = torch.where(empty, group_ids.max() + 1 + torch.arange(len(mask)), group_ids)
    baselines = _group_token_baselines(packed(returns), packed(cumulative), packed_mask, ids, eps)
    advantages = torch.zeros_like(returns).index_put((rows, cols), (packed(returns) - baselines)[rows, place])
    return advantages * mask, returns


def _group_token_baselines(returns: Tensor, cumulative: Tensor, mask: Tensor, group_ids: Tensor,
                           eps: float) -> Tensor:
    """B_t per group and position [batch, len]: sum G_t W_t / (sum W_t + eps) over the group's rows; 0 for a
    group of one and, past the second longest response, for a group's single longest one."""
    baselines = torch.zeros_like(returns)
    for gid in torch.unique(group_ids):
        rows = torch.nonzero(group_ids == gid).squeeze(-1)
        if len(rows) < 2:
            continue
        m, w = mask[rows], cumulative[rows]
        baselines[rows] = ((returns[rows] * w * m).sum(0) / ((w * m).sum(0) + eps))[None]
        lengths = m.sum(-1)
        longest, second = lengths.sort().values[-1], lengths.sort().values[-2]
        if longest > second and int((lengths == longest).sum()) == 1:
            baselines[rows[lengths == longest][0], int(second):] = 0.0
    return baselines


def pf_ppo_weights(scores: Tensor, method: str, power: float) -> Tensor:
    """PF-PPO's resampling weights [batch] from sequence scores [batch] (verl 0.9.1): |s|^power ("pow"), 1 at
    the batch's max and min score and 0 elsewhere ("max_min"), 0.4 at the max and 0.1 elsewhere ("max_random");
    floored at 1e-8 so every response can be drawn."""
    if method == "pow":
        weights = scores.abs().pow(power)
    elif method == "max_min":
        weights = ((scores == scores.max()) | (scores == scores.min())).to(scores.dtype)
    elif method == "max_random":
        weights = torch.where(scores == scores.max(), 0.4, 0.1).to(scores.dtype)
    else:
        raise ValueError(f"unknown pf_ppo reweight_method {method!r}; valid: pow, max_min, max_random")
    return (weights + 1e-8).clamp(min=1e-8)


def grpo_passk(token_rewards: Tensor, response_mask: Tensor, group_ids: Tensor,
               norm_by_std: bool = True, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """Pass@k: only each group's best response learns, with advantage best - second best
    (divided by the group's unbiased std + eps with `norm_by_std`); every other response gets 0."""
    mask = response_mask.to(token_rewards.dtype)
    scores = (token_rewards * mask).sum(-1)  # [batch]
    adv = torch.zeros_like(scores)
    for gid in torch.unique(group_ids):
        rows = torch.nonzero(group_ids == gid).squeeze(-1)
        if len(rows) < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples per prompt (rollout.n >= 2); group {gid.item()} has 1")
        top, idx = torch.topk(scores[rows], 2)
        gap = top[0] - top[1]
        adv[rows[idx[0]]] = gap / (scores[rows].std() + eps) if norm_by_std else gap
    adv = adv[:, None] * mask
    return adv, adv


def reinforce_plus_plus_baseline(token_rewards: Tensor, response_mask: Tensor,
                                 group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a group baseline: s_i - mean of its group (0 alone), broadcast over the
    response and whitened over all valid tokens of the batch."""
    mask = response_mask.to(token_rewards.dtype)
    scores = (token_rewards * mask).sum(-1)  # [batch]
    size, mean, _ = _group_stats(scores, group_ids)
    centred = scores - torch.where(size == 1, 0.0, mean)  # [batch]
    adv = masked_whiten(centred[:, None] * mask, mask)  # [batch, resp_len]
    return adv, adv


def remax(token_rewards: Tensor, response_mask: Tensor, baselines: Tensor) -> tuple[Tensor, Tensor]:
    """ReMax: return-to-go minus the greedy response's score (`baselines`, [batch])."""
    mask = response_mask.to(token_rewards.dtype)
    returns = (token_rewards * mask).flip(-1).cumsum(-1).flip(-1)  # [batch, resp_len]
    return returns - baselines[:, None] * mask, returns


def opo(token_rewards: Tensor, response_mask: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """OPO: s_i minus its group's length-weighted mean score sum(len*s)/sum(len) (0 alone)."""
    mask = response_mask.to(token_rewards.dtype)
    scores, lengths = (token_rewards * mask).sum(-1), mask.sum(-1)  # [batch] each
    _, idx = torch.unique(group_ids, return_inverse=True)
    weighted = torch.zeros(int(idx.max()) + 1, dtype=scores.dtype).index_add_(0, idx, lengths * scores)
    total_len = torch.zeros_like(weighted).index_add_(0, idx, lengths)
    size = torch.bincount(idx)[idx]
    baseline = torch.where(size > 1, weighted[idx] / total_len[idx].clamp(min=1e-8), 0.0)
    adv = (scores - baseline)[:, None] * mask
    return adv, adv


def gpg(token_rewards: Tensor, response_mask: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor]:
    """GPG: (s_i - group mean) scaled by batch size / number of non-zero scores (no std)."""
    mask = response_mask.to(token_rewards.dtype)
    scores = (token_rewards * mask).sum(-1)  # [batch]
    size, mean, _ = _group_stats(scores, group_ids)
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)
    adv = (alpha * (scores - torch.where(size == 1, 0.0, mean)))[:, None] * mask
    return adv, adv


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


@dataclass
class AdvantageInputs:
    """What estimators may read; each uses the fields its method needs."""
    token_rewards: Tensor                 # [batch, resp_len]
    response_mask: Tensor                 # [batch, resp_len]
    group_ids: Tensor                     # [batch]
    values: Tensor | None = None          # [batch, resp_len], from a critic (gae)
    baselines: Tensor | None = None       # [batch], greedy responses' scores (remax)
    components: Tensor | None = None      # [k, batch] reward components (gdpo: algorithm.gdpo_reward_keys)
    old_logprobs: Tensor | None = None    # [batch, resp_len] (optimal token baselines)
    sum_pi_squared: Tensor | None = None  # [batch, resp_len] sum over the vocabulary of pi^2 (optimal token baselines)
    is_weights: Tensor | None = None      # [batch, resp_len] rollout IS weights, when rollout correction gives them
    component_weights: Tensor | None = None  # [k]; null: 1 each
    gamma: float = 1.0
    lam: float = 1.0
    norm_by_std: bool = True


def compute_advantages(estimator: str, **inputs) -> tuple[Tensor, Tensor]:
    """Run the estimator named by `algorithm.adv_estimator` on AdvantageInputs' fields;
    returns (advantages, returns)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; "
                         f"valid: {', '.join(ESTIMATORS)}")
    a = AdvantageInputs(**inputs)
    if estimator == "gdpo" and a.components is None:
        raise ValueError("the 'gdpo' estimator needs the reward components: pass components=[k, batch]")
    if estimator == "gae" and a.values is None:
        raise ValueError("the 'gae' estimator needs values from a critic: "
                         "pass values=[batch, resp_len]")
    if estimator in NEEDS_SUM_PI_SQUARED and (a.sum_pi_squared is None or a.old_logprobs is None):
        raise ValueError(f"the {estimator!r} estimator needs old_logprobs and sum_pi_squared [batch, resp_len]")
    if estimator == "remax" and a.baselines is None:
        raise ValueError("the 'remax' estimator needs the greedy responses' scores: pass baselines=[batch]")
    return ESTIMATORS[estimator](a)


def spread(advantages: Tensor, owner: Tensor, response_mask: Tensor) -> Tensor:
    """Row r takes the per-response advantage of row owner[r] (owner -1: none, 0) over its own mask [batch,
    resp_len]: the chains of one agent session share the one advantage computed for the session."""
    mask = response_mask.to(advantages.dtype)
    source = response_mask.to(advantages.dtype)[owner.clamp(min=0)]
    per_row = (advantages[owner.clamp(min=0)] * source).sum(-1) / source.sum(-1).clamp(min=1)  # [batch]
    return torch.where(owner >= 0, per_row, 0.0)[:, None] * mask


# Estimators whose advantage is one number per response (times its mask), from the scores of its group.
PER_RESPONSE = ("grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo", "gpg")
# Estimators that need the trainer to generate one greedy response per prompt first.
NEEDS_GREEDY_BASELINE = ("remax",)
# ... and the actor's sum of squared probabilities from the old log-prob pass.
NEEDS_SUM_PI_SQUARED = ("optimal_token_baseline", "tir_optimal_token_baseline")

ESTIMATORS = {
    "grpo": lambda a: grpo(a.token_rewards, a.response_mask, a.group_ids, norm_by_std=a.norm_by_std),
    "grpo_passk": lambda a: grpo_passk(a.token_rewards, a.response_mask, a.group_ids, norm_by_std=a.norm_by_std),
    "rloo": lambda a: rloo(a.token_rewards, a.response_mask, a.group_ids),
    # verl's vectorized twins: the same numbers (rloo_vectorized gives a lone sample 0)
    "grpo_vectorized": lambda a: grpo(a.token_rewards, a.response_mask, a.group_ids, norm_by_std=a.norm_by_std),
    "rloo_vectorized": lambda a: rloo(a.token_rewards, a.response_mask, a.group_ids, lone_keeps_score=False),
    "reinforce_plus_plus": lambda a: reinforce_plus_plus(a.token_rewards, a.response_mask, a.gamma),
    "reinforce_plus_plus_baseline": lambda a: reinforce_plus_plus_baseline(a.token_rewards, a.response_mask,
                                                                           a.group_ids),
    "remax": lambda a: remax(a.token_rewards, a.response_mask, a.baselines),
    "opo": lambda a: opo(a.token_rewards, a.response_mask, a.group_ids),
    "gpg": lambda a: gpg(a.token_rewards, a.response_mask, a.group_ids),
    "gae": lambda a: gae(a.token_rewards, a.values, a.response_mask, a.gamma, a.lam),
    "gdpo": lambda a: gdpo(a.components, torch.ones(len(a.components)) if a.component_weights is None
                           else a.component_weights, a.response_mask, a.group_ids, a.norm_by_std),
    "optimal_token_baseline": lambda a: optimal_token_baseline(a.token_rewards, a.response_mask, a.group_ids,
                                                               a.old_logprobs, a.sum_pi_squared, a.is_weights),
    "tir_optimal_token_baseline": lambda a: tir_optimal_token_baseline(a.token_rewards, a.response_mask, a.group_ids,
                                                                       a.old_logprobs, a.sum_pi_squared, a.is_weights),
}
assert tuple(ESTIMATORS) == ESTIMATOR_NAMES, "plait/algorithms/names.py lists the estimators config.py accepts"
