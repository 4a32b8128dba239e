"""Policy and value losses, their aggregation over tokens, and per-token log-probs and entropy.

Pure functions over [batch, resp_len] tensors: the PPO clipped surrogate with dual clip, the
clipped value loss, and `agg_loss`, whose optional global normalisers make micro-batch gradient
accumulation and data parallelism sum to the loss of one big batch. Not here: advantage
estimation (advantages.py), KL terms (kl.py), and anything about models or optimisers.
"""

from __future__ import annotations

import torch
from torch import Tensor

from plait.algorithms.advantages import masked_mean

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str, num_tokens: float | Tensor | None = None,
             num_seqs: float | Tensor | None = None) -> Tensor:
    """Reduce a per-token loss [batch, resp_len] to a scalar.

    token-mean: sum of valid-token losses / num_tokens (default: valid tokens here).
    seq-mean-token-sum: sum over sequences of token sums / num_seqs (default: batch size).
    seq-mean-token-mean: sum over sequences of per-sequence token means / num_seqs.
    Pass the counts of the whole global batch when this is one micro-batch or one rank of it:
    the summed micro-batch losses (and summed rank gradients) then equal the big-batch loss.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    mask = mask.to(loss_mat.dtype)
    token_sums = (loss_mat * mask).sum(-1)  # [batch]
    if mode == "token-mean":
        return token_sums.sum() / (mask.sum().clamp(min=1) if num_tokens is None else num_tokens)
    if mode == "seq-mean-token-mean":
        token_sums = token_sums / mask.sum(-1).clamp(min=1)  # an all-padding row adds 0
    return token_sums.sum() / (loss_mat.shape[0] if num_seqs is None else num_seqs)


def ppo_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, response_mask: Tensor,
                    clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0,
                    agg_mode: str = "token-mean", num_tokens: float | Tensor | None = None,
                    num_seqs: float | Tensor | None = None,
                    is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with dual clip; returns (loss, metrics).

    Per token: max(-A*r, -A*clip(r, 1-clip_low, 1+clip_high)), and for A < 0 at most -A*clip_c,
    so one huge ratio on a bad action cannot dominate the batch. `is_weights` (truncated
    importance weights, [batch, resp_len]) multiply the per-token loss for off-policy data.
    """
    if clip_c <= 1.0:
        raise ValueError(f"clip_ratio_c={clip_c} must be > 1: the dual clip caps -A*ratio "
                         "at -A*clip_c for A < 0")
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)  # [batch, resp_len]; exp stays finite
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)  # [batch, resp_len]
    dual = -advantages * clip_c
    dual_taken = (advantages < 0) & (loss_mat > dual)
    loss_mat = torch.where(dual_taken, dual, loss_mat)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights
    loss = agg_loss(loss_mat, response_mask, agg_mode, num_tokens, num_seqs)
    metrics = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).item(),
        "pg_clipfrac_lower": masked_mean(dual_taken.float(), response_mask).item(),
        "ppo_kl": masked_mean((old_logp - logp).detach(), response_mask).item(),
    }
    return loss, metrics


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor,
               cliprange: float = 0.5, agg_mode: str = "token-mean",
               num_tokens: float | Tensor | None = None,
               num_seqs: float | Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss 0.5 * agg(max((V-R)^2, (clip(V, V_old +- cliprange) - R)^2))."""
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange, cliprange)
    unclipped_err = (values - returns) ** 2  # [batch, resp_len]
    clipped_err = (clipped_values - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped_err, clipped_err), response_mask, agg_mode,
                          num_tokens, num_seqs)
    clipfrac = masked_mean((clipped_err > unclipped_err).float(), response_mask)
    return loss, {"vf_clipfrac": clipfrac.item()}


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dim: logsumexp(z) - sum(softmax(z) * z)."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[token] per position: [batch, len, vocab], [batch, len] -> [batch, len].

    Gathers one logit and subtracts logsumexp instead of materialising a full log_softmax.
    Half-precision logits are upcast one row at a time: a bf16 logsumexp is off by ~1e-2,
    which would show up directly in PPO ratios.
    """
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [batch, len]
        return picked - torch.logsumexp(logits, dim=-1)
    return torch.stack([token_logprobs(row.float(), tok) for row, tok in zip(logits, tokens)])
