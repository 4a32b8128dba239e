"""Rollout correction: importance weights and rejection masks for off-policy rollouts.

The rollout's log-probs (its engine, its precision, maybe an older policy version) differ from
the trainer's. With log_ratio = log pi_train - log pi_rollout per token:

- IS (`algorithm.rollout_correction.rollout_is`): truncated weights min(w, threshold) per token
  ("token", w = exp(log_ratio)) or per sequence ("sequence", w = exp(sum of the response's
  log_ratio), broadcast over it), optionally divided by their batch mean
  (`rollout_is_batch_normalize`). Constants in the loss: no gradient.
- RS (`rollout_rs`): a comma-separated list of divergence checks; a token or sequence failing any
  is dropped from the loss mask. k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 -
  log_ratio, taken per token (token_k*), or per sequence as a sum, mean or max (seq_sum_k*,
  seq_mean_k*, seq_max_k*). k1 checks keep lower <= exp(k1) <= upper (a threshold "lo_hi", or one
  number u meaning [1/u, u]); the others keep the statistic <= threshold. verl's older names
  token / sequence / geometric are token_k1 / seq_sum_k1 / seq_mean_k1.

Metrics carry verl's names under `rollout_corr/` (for each RS check its statistic's token-weighted
mean, max and min, and the token and sequence shares it masked). Not here: where the trainer or the actor
applies these (plait/trainers/lm.py, plait/workers/actor.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from plait.algorithms.advantages import masked_mean
from plait.algorithms.names import BYPASS_LOSS_TYPES, IS_LEVELS, parse_rs  # noqa: F401  (re-exported)

SAFETY_BOUND = 20.0  # |log w| cap, so exp stays finite


def is_weights(log_ratio: Tensor, mask: Tensor, level: str, threshold: float,
               batch_normalize: bool = False) -> tuple[Tensor, dict[str, float]]:
    """Truncated IS weights [batch, resp_len] (0 at padding) and their metrics (before truncation)."""
    if level not in IS_LEVELS:
        raise ValueError(f"unknown rollout_is {level!r}; valid: {', '.join(IS_LEVELS)}")
    mask = mask.to(log_ratio.dtype)
    if level == "sequence":
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True).expand_as(mask)  # [batch, resp_len]
    raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)).detach() * mask
    valid = mask.bool()
    bounded = raw.clamp(1.0 / threshold, threshold)
    normalised = bounded / masked_mean(bounded, mask)
    metrics = {"rollout_is_mean": masked_mean(raw, mask).item(),
               "rollout_is_max": raw.masked_fill(~valid, -math.inf).max().item(),  # -inf/inf: no valid token
               "rollout_is_min": raw.masked_fill(~valid, math.inf).min().item(),
               "rollout_is_ratio_fraction_high": masked_mean((raw > threshold).float(), mask).item(),
               "rollout_is_ratio_fraction_low": masked_mean((raw < 1.0 / threshold).float(), mask).item(),
               # effective sample size: 1 / E[(w / E w)^2], 1 when all weights are equal
               "rollout_is_eff_sample_size": 1.0 / masked_mean(normalised ** 2, mask).item()}
    weights = raw.clamp(max=threshold)
    if batch_normalize:
        seq_mask = (mask.sum(-1) > 0).to(mask.dtype)  # a sequence weight counts once per sequence
        mean = (masked_mean(weights, mask) if level == "token"
                else (masked_mean(weights, mask, dim=-1) * seq_mask).sum() / seq_mask.sum().clamp(min=1))
        weights = weights / mean.clamp(min=1e-8)
        metrics["rollout_is_batch_norm_factor"] = mean.item()
    return weights, metrics


def rejection_mask(log_ratio: Tensor, mask: Tensor, rollout_rs: str,
                   threshold: str | float | None) -> tuple[Tensor, dict[str, float]]:
    """The response mask with rejected tokens / sequences set to 0, and the masked fractions."""
    mask = mask.to(log_ratio.dtype)
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    per_token = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}  # each [batch, resp_len]
    valid = mask.bool()
    seq_valid = valid.any(-1)
    keep_all = torch.ones_like(mask)
    metrics = {}
    for option, upper, lower in parse_rs(rollout_rs, threshold):
        level, k = option.rsplit("_", 1)
        stat = per_token[k]
        if level == "seq_sum":
            stat = (stat * mask).sum(-1, keepdim=True)
        elif level == "seq_mean":
            stat = masked_mean(stat, mask, dim=-1)[:, None]
        elif level == "seq_max":
            stat = stat.masked_fill(~valid, -math.inf).max(-1, keepdim=True).values
        if lower is None:
            keep = stat <= upper
        else:
            keep = (stat >= math.log(lower)) & (stat <= math.log(upper))
        keep = keep.expand_as(mask).to(mask.dtype)  # [batch, resp_len]
        keep_all = keep_all * keep
        per_row = stat.shape[-1] == 1  # a sequence statistic: max / min over non-empty sequences
        values = stat[seq_valid, 0] if per_row else stat[valid]
        metrics[f"rollout_rs_{option}_mean"] = masked_mean(stat.expand_as(mask), mask).item()
        metrics[f"rollout_rs_{option}_max"] = values.max().item() if len(values) else 0.0
        metrics[f"rollout_rs_{option}_min"] = values.min().item() if len(values) else 0.0
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1 - keep, mask).item()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = _seq_fraction(keep, valid, seq_valid)
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - keep_all, mask).item()
    metrics["rollout_rs_seq_masked_fraction"] = _seq_fraction(keep_all, valid, seq_valid)
    return mask * keep_all, metrics


def _seq_fraction(keep: Tensor, valid: Tensor, seq_valid: Tensor) -> float:
    """Share of non-empty sequences with at least one rejected token."""
    rejected = ((keep < 0.5) & valid).any(-1)
    return (rejected.float().sum() / seq_valid.float().sum().clamp(min=1)).item()


def offpolicy_metrics(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the rollout is from the trainer: KL(rollout || train) by k1 and k3, perplexities, chi^2."""
    mask = mask.to(train_logp.dtype)
    log_ratio = train_logp - rollout_logp
    return {"kl": masked_mean(-log_ratio, mask).item(),
            "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask).item(),
            "training_ppl": torch.exp(-masked_mean(train_logp, mask, dim=-1)).mean().item(),
            "rollout_ppl": torch.exp(-masked_mean(rollout_logp, mask, dim=-1)).mean().item(),
            "chi2_token": (masked_mean(torch.exp(2 * log_ratio.clamp(max=SAFETY_BOUND)), mask) - 1).item()}


def rollout_correction(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor, rollout_is: str | None,
                       rollout_is_threshold: float, rollout_is_batch_normalize: bool, rollout_rs: str | None,
                       rollout_rs_threshold: str | float | None) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """(IS weights or None, loss mask after rejection, `rollout_corr/*` metrics) for one batch."""
    log_ratio = (train_logp - rollout_logp).detach()
    metrics = offpolicy_metrics(train_logp.detach(), rollout_logp, mask)
    weights = None
    if rollout_is is not None:
        weights, m = is_weights(log_ratio, mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize)
        metrics.update(m)
    loss_mask = mask
    if rollout_rs is not None:
        loss_mask, m = rejection_mask(log_ratio, mask, rollout_rs, rollout_rs_threshold)
        metrics.update(m)
    return weights, loss_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()}


