"""Rollout correction: importance weights and rejection masks for off-policy rollouts.

The rollout's log-probs (its engine, its precision, maybe an older policy version) differ from
the trainer's. With log_ratio = log pi_train - log pi_rollout per token:

- IS (`algorithm.rollout_correction.rollout_is`): truncated weights min(w, threshold) per token
  ("token", w = exp(log_ratio)) or per sequence ("sequence", w = exp(sum of the response's
  log_ratio), broadcast over it), or with a "lower_upper" threshold (IcePop) w inside the bounds and
  0 outside, optionally divided by their batch mean (`rollout_is_batch_normalize`). Constants in the
  loss: no gradient.
- RS (`rollout_rs`): a comma-separated list of divergence checks; a token or sequence failing any
  is dropped from the loss mask. k1 = -log_ratio, k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 -
  log_ratio, taken per token (token_k*), or per sequence as a sum, mean or max (seq_sum_k*,
  seq_mean_k*, seq_max_k*). k1 checks keep lower <= exp(k1) <= upper (a threshold "lo_hi", or one
  number u meaning [1/u, u]); the others keep the statistic <= threshold. verl's older names
  token / sequence / geometric are token_k1 / seq_sum_k1 / seq_mean_k1.

Metrics carry verl 0.9.1's names and values under `rollout_corr/` (IS metrics of the applied weights,
per RS check its statistic's summaries and the shares it masked, the off-policy gap). Not here: where the trainer or the actor
applies these (plait/trainers/lm.py, plait/workers/actor.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from plait.algorithms.advantages import masked_mean
from plait.algorithms.names import BYPASS_LOSS_TYPES, IS_LEVELS, parse_is_threshold, parse_rs  # noqa: F401  (re-exported)

SAFETY_BOUND = 20.0  # |log w| cap, so exp stays finite


def is_weights(log_ratio: Tensor, mask: Tensor, level: str, threshold: float | str,
               batch_normalize: bool = False) -> tuple[Tensor, dict[str, float]]:
    """IS weights [batch, resp_len] (0 at padding) and their metrics, as verl 0.9.1 computes them.
    `threshold` u truncates (TIS: min(w, u)); "lower_upper" is IcePop (w outside [lower, upper] -> 0)."""
    if level not in IS_LEVELS:
        raise ValueError(f"unknown rollout_is {level!r}; valid: {', '.join(IS_LEVELS)}")
    upper, lower = parse_is_threshold(threshold)
    mask = mask.to(log_ratio.dtype)
    if level == "sequence":
        for_metrics = (log_ratio * mask).sum(-1, keepdim=True)  # [batch, 1]: the log of the sequence's ratio
        raw = torch.exp(for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(mask)
    else:
        for_metrics, raw = log_ratio, torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    raw = raw.detach() * mask  # [batch, resp_len]
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = is_metrics(weights, raw, for_metrics.detach(), mask, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), mask).item()
    if batch_normalize:
        seq_mask = (mask.sum(-1) > 0).to(mask.dtype)  # a sequence weight counts once per sequence
        mean = (masked_mean(weights, mask) if level == "token"
                else (masked_mean(weights, mask, dim=-1) * seq_mask).sum() / seq_mask.sum().clamp(min=1e-8))
        if mean > 1e-8:
            weights = weights / mean
        metrics["rollout_is_batch_norm_factor"] = mean.item() if mean > 1e-8 else 1.0
    return weights, metrics


def is_metrics(weights: Tensor, raw: Tensor, for_metrics: Tensor, mask: Tensor, level: str, upper: float,
               lower: float | None) -> dict[str, float]:
    """verl's rollout_is_* metrics: mean, max, min of the applied weights (sequence level: max and min
    of the untruncated ratios), the shares of raw ratios above `upper` and below `lower` (1/upper when
    unset), std and effective sample size of the weights clamped to [0, upper], and per-sequence means."""
    lower_bound = 1.0 / upper if lower is None else lower
    valid = mask.bool()
    metrics = {"rollout_is_mean": masked_mean(weights, mask).item()}
    if level == "sequence":
        metrics["rollout_is_max"] = torch.exp(for_metrics.max().clamp(max=SAFETY_BOUND)).item()
        metrics["rollout_is_min"] = torch.exp(for_metrics.min()).item()
        metrics["rollout_is_ratio_fraction_high"] = (for_metrics > math.log(upper)).float().mean().item()
        metrics["rollout_is_ratio_fraction_low"] = (for_metrics < math.log(lower_bound)).float().mean().item()
    else:
        metrics["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), mask).item()
        metrics["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower_bound).float(), mask).item()
        metrics["rollout_is_max"] = weights.masked_fill(~valid, -math.inf).max().item()  # -inf/inf: no valid token
        metrics["rollout_is_min"] = weights.masked_fill(~valid, math.inf).min().item()
    clamped = weights.clamp(min=0.0, max=upper)
    mean = masked_mean(clamped, mask)
    var = masked_mean(clamped ** 2, mask) - mean ** 2
    metrics["rollout_is_std"] = var.clamp(min=0.0).sqrt().item() if mask.sum() > 1 else 0.0
    # effective sample size: 1 / E[(w / E w)^2], 1 when all weights are equal
    metrics["rollout_is_eff_sample_size"] = 1.0 / masked_mean((clamped / (mean + 1e-8)) ** 2, mask).item()
    seq = masked_mean(weights, mask, dim=-1)  # [batch]
    raw_seq = masked_mean(raw, mask, dim=-1)  # [batch]
    metrics.update({"rollout_is_seq_mean": seq.mean().item(),
                    "rollout_is_seq_std": seq.std().item() if seq.numel() > 1 else 0.0,
                    "rollout_is_seq_max": seq.max().item(), "rollout_is_seq_min": seq.min().item(),
                    "rollout_is_seq_max_deviation": (seq - 1.0).abs().max().item(),
                    "rollout_is_seq_fraction_high": (raw_seq > upper).float().mean().item(),
                    "rollout_is_seq_fraction_low": (raw_seq < lower_bound).float().mean().item()})
    return metrics


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
            keep, bounds = stat <= upper, (upper, None)
        else:
            bounds = (math.log(upper), math.log(lower))  # k1 is a log-ratio: its bounds are logs
            keep = (stat >= bounds[1]) & (stat <= bounds[0])
        keep = keep.expand_as(mask).to(mask.dtype)  # [batch, resp_len]
        keep_all = keep_all * keep
        metrics.update(rs_metrics(f"rollout_rs_{option}", stat, mask, seq_valid, *bounds))
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1 - keep, mask).item()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = _seq_fraction(keep, valid, seq_valid)
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - keep_all, mask).item()
    metrics["rollout_rs_seq_masked_fraction"] = ((keep_all < 0.5) & valid).any(-1).float().mean().item()  # of all rows
    return mask * keep_all, metrics


def rs_metrics(prefix: str, stat: Tensor, mask: Tensor, seq_valid: Tensor, upper: float,
               lower: float | None) -> dict[str, float]:
    """verl's metrics of one rejection check: the statistic `stat` ([batch, resp_len] per token, [batch, 1]
    per sequence) over valid tokens (mean, std clamped to the bounds) and over non-empty sequences (max,
    min, the shares beyond the bounds; a token statistic's sequence value is its row mean)."""
    per_row = stat.shape[-1] == 1
    tokens = stat.expand_as(mask)
    seq = (stat[:, 0] if per_row else masked_mean(stat, mask, dim=-1))[seq_valid]  # [non-empty rows]
    low = -math.inf if lower is None else lower
    clamped = tokens.clamp(min=0.0 if lower is None else lower, max=upper)
    mean = masked_mean(clamped, mask)
    var = masked_mean(clamped ** 2, mask) - mean ** 2
    metrics = {f"{prefix}_mean": masked_mean(tokens, mask).item(),
               f"{prefix}_std": var.clamp(min=0.0).sqrt().item() if mask.sum() > 1 else 0.0}
    if per_row and len(seq):
        metrics.update({f"{prefix}_max": seq.max().item(), f"{prefix}_min": seq.min().item(),
                        f"{prefix}_fraction_high": (seq > upper).float().mean().item(),
                        f"{prefix}_fraction_low": (seq < low).float().mean().item()})
    else:
        valid = mask.bool()
        metrics.update({f"{prefix}_max": tokens.masked_fill(~valid, -math.inf).max().item(),
                        f"{prefix}_min": tokens.masked_fill(~valid, math.inf).min().item(),
                        f"{prefix}_fraction_high": masked_mean((tokens > upper).float(), mask).item(),
                        f"{prefix}_fraction_low": masked_mean((tokens < low).float(), mask).item()})
    if not len(seq):
        return {**metrics, **{f"{prefix}_seq_{k}": 0.0 for k in ("mean", "std", "max", "min", "max_deviation",
                                                                "fraction_high", "fraction_low")}}
    metrics.update({f"{prefix}_seq_mean": seq.mean().item(), f"{prefix}_seq_std": seq.std().item() if len(seq) > 1 else 0.0,
                    f"{prefix}_seq_max": seq.max().item(), f"{prefix}_seq_min": seq.min().item(),
                    f"{prefix}_seq_max_deviation": seq.abs().max().item(),
                    f"{prefix}_seq_fraction_high": (seq > upper).float().mean().item()})
    if lower is not None:
        metrics[f"{prefix}_seq_fraction_low"] = (seq < lower).float().mean().item()
    return metrics


def _seq_fraction(keep: Tensor, valid: Tensor, seq_valid: Tensor) -> float:
    """Share of non-empty sequences with at least one rejected token."""
    rejected = ((keep < 0.5) & valid).any(-1)
    return (rejected.float().sum() / seq_valid.float().sum().clamp(min=1)).item()


def offpolicy_metrics(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the rollout is from the trainer: KL(rollout || train) by k1 and k3, perplexities, chi^2."""
    mask = mask.to(train_logp.dtype)
    log_ratio = train_logp - rollout_logp
    train_mean, rollout_mean = masked_mean(train_logp, mask, dim=-1), masked_mean(rollout_logp, mask, dim=-1)  # [batch]
    ppl_gap = rollout_mean - train_mean  # log(train ppl / rollout ppl) per sequence
    seq_log_ratio = (log_ratio * mask).sum(-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)  # [batch]
    return {"kl": masked_mean(-log_ratio, mask).item(),
            "k3_kl": masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask).item(),
            "training_ppl": torch.exp(-train_mean).mean().item(), "training_log_ppl": (-train_mean).mean().item(),
            "rollout_ppl": torch.exp(-rollout_mean).mean().item(), "rollout_log_ppl": (-rollout_mean).mean().item(),
            "log_ppl_diff": ppl_gap.mean().item(), "log_ppl_abs_diff": ppl_gap.abs().mean().item(),
            "log_ppl_diff_max": ppl_gap.max().item(), "log_ppl_diff_min": ppl_gap.min().item(),
            "ppl_ratio": torch.exp(ppl_gap).mean().item(),
            "chi2_token": (masked_mean(torch.exp(2 * log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)), mask) - 1).item(),
            "chi2_seq": (torch.exp(2 * seq_log_ratio).mean() - 1).item()}


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


