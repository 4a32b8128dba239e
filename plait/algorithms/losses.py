"""Policy and value losses, their aggregation over tokens, and per-token log-probs and entropy.

Pure functions over [batch, resp_len] tensors: the policy losses verl's
`actor.policy_loss.loss_mode` names (PPO clip with dual clip "vanilla", GSPO, GPG, Clip-Cov, KL-Cov,
GMPO "geo_mean", SAPO, CISPO, and REINFORCE for bypass mode), the clipped value loss, and `agg_loss`, whose
optional global normalisers make micro-batch gradient accumulation and data parallelism sum to the
loss of one big batch. Not here: advantage estimation (advantages.py), KL terms (kl.py), rollout
correction weights (rollout_correction.py), and anything about models or optimisers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from plait.algorithms.advantages import masked_mean
from plait.algorithms.names import LOSS_AGG_MODES, POLICY_LOSS_NAMES



def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str, num_tokens: float | Tensor | None = None,
             num_seqs: float | Tensor | None = None, loss_scale_factor: float | None = None) -> Tensor:
    """Reduce a per-token loss [batch, resp_len] to a scalar.

    token-mean: sum of valid-token losses / num_tokens (default: valid tokens here).
    token-sum: sum of valid-token losses (no normalisation; summed over micro-batches and ranks).
    seq-mean-token-sum: sum over sequences of token sums / num_seqs (default: batch size).
    seq-mean-token-mean: sum over sequences of per-sequence token means / num_seqs.
    seq-mean-token-sum-norm (Dr.GRPO): seq-mean-token-sum divided by a constant length,
    `loss_scale_factor` (default: resp_len, the padded response length), so long and short
    responses weigh their tokens alike and no per-batch length enters the gradient.
    Pass the counts of the whole global batch when this is one micro-batch or one rank of it:
    the summed micro-batch losses (and summed rank gradients) then equal the big-batch loss.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    mask = mask.to(loss_mat.dtype)
    token_sums = (loss_mat * mask).sum(-1)  # [batch]
    if mode == "token-mean":
        return token_sums.sum() / (mask.sum().clamp(min=1) if num_tokens is None else num_tokens)
    if mode == "token-sum":
        return token_sums.sum()
    if mode == "seq-mean-token-mean":
        token_sums = token_sums / mask.sum(-1).clamp(min=1)  # an all-padding row adds 0
    if mode == "seq-mean-token-sum-norm":
        # verl divides each micro-batch's token sum by the factor alone; dividing by the global
        # sequence count too keeps micro-batching exact (a constant scale Adam does not see).
        token_sums = token_sums / (loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    return token_sums.sum() / (loss_mat.shape[0] if num_seqs is None else num_seqs)


def ppo_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, response_mask: Tensor,
                    clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0,
                    agg_mode: str = "token-mean", num_tokens: float | Tensor | None = None,
                    num_seqs: float | Tensor | None = None, is_weights: Tensor | None = None,
                    loss_scale_factor: float | None = None) -> tuple[Tensor, dict[str, float]]:
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
    loss = agg_loss(loss_mat, response_mask, agg_mode, num_tokens, num_seqs, loss_scale_factor)
    metrics = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask).item(),
        "pg_clipfrac_lower": masked_mean(dual_taken.float(), response_mask).item(),
        "ppo_kl": masked_mean((old_logp - logp).detach(), response_mask).item(),
    }
    return loss, metrics


@dataclass
class PolicyLossKnobs:
    """The knobs every loss mode reads from (verl's actor.clip_ratio* and actor.policy_loss.*)."""
    clip_low: float = 0.2
    clip_high: float = 0.2
    clip_c: float = 3.0
    agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's constant length
    clip_cov_ratio: float = 0.0002          # share of tokens Clip-Cov detaches
    clip_cov_lb: float = 1.0                # covariance window Clip-Cov picks from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002            # share of tokens KL-Cov penalises
    ppo_kl_coef: float = 0.1                # KL-Cov's |log ratio| coefficient
    tau_pos: float = 1.0                    # SAPO's gate temperatures for A > 0 and A <= 0
    tau_neg: float = 1.05
    dro_beta: float | None = None           # DRO's quadratic log-ratio penalty


def policy_loss(mode: str, logp: Tensor, old_logp: Tensor, advantages: Tensor, response_mask: Tensor,
                knobs: PolicyLossKnobs, num_tokens: float | Tensor | None = None,
                num_seqs: float | Tensor | None = None,
                is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The loss named by `actor.policy_loss.loss_mode`; metrics are pg_clipfrac, ppo_kl, ... ."""
    if mode not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss_mode {mode!r}; valid: {', '.join(POLICY_LOSSES)}")
    agg = dict(num_tokens=num_tokens, num_seqs=num_seqs)
    return POLICY_LOSSES[mode](logp, old_logp, advantages, response_mask, knobs, agg, is_weights)


def _vanilla(logp, old_logp, adv, mask, k: PolicyLossKnobs, agg, is_weights):
    return ppo_policy_loss(logp, old_logp, adv, mask, k.clip_low, k.clip_high, k.clip_c, k.agg_mode,
                           is_weights=is_weights, loss_scale_factor=k.loss_scale_factor, **agg)


def gspo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, response_mask: Tensor,
              clip_low: float, clip_high: float, num_seqs: float | Tensor | None = None,
              is_weights: Tensor | None = None, agg_mode: str = "seq-mean-token-mean",
              num_tokens: float | Tensor | None = None,
              loss_scale_factor: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """GSPO: PPO clipping on the sequence ratio s = exp(mean_t log(pi/pi_old)), one per response.

    Each token carries s in value but its own log-prob's gradient: log s_t = sg(log s) + logp -
    sg(logp). Aggregated with actor.loss_agg_mode, as verl 0.9.1 does (the paper's is
    seq-mean-token-mean).
    """
    mask = response_mask.to(logp.dtype)
    seq_log_ratio = ((logp - old_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [batch]
    log_ratio = logp - logp.detach() + seq_log_ratio.detach()[:, None]  # [batch, resp_len]
    ratio = torch.exp(log_ratio.clamp(max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights
    loss = agg_loss(loss_mat, mask, agg_mode, num_tokens, num_seqs, loss_scale_factor)
    return loss, {"pg_clipfrac": masked_mean((clipped > unclipped).float(), mask).item(),
                  "pg_clipfrac_lower": 0.0,
                  "ppo_kl": masked_mean((old_logp - logp).detach(), mask).item()}


def gpg_loss(logp: Tensor, advantages: Tensor, response_mask: Tensor, agg_mode: str,
             is_weights: Tensor | None = None, **agg) -> tuple[Tensor, dict[str, float]]:
    """Plain policy gradient -A * log pi (GPG; also REINFORCE): no ratio, no clipping."""
    loss_mat = -advantages * logp
    if is_weights is not None:
        loss_mat = loss_mat * is_weights
    return agg_loss(loss_mat, response_mask, agg_mode, **agg), {}


def clip_cov_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, response_mask: Tensor,
                  k: PolicyLossKnobs, is_weights: Tensor | None = None,
                  generator: torch.Generator | None = None, **agg) -> tuple[Tensor, dict[str, float]]:
    """Clip-Cov: PPO clip, plus detaching a few tokens whose centred cov(A, log pi) is large.

    Among valid tokens that PPO did not clip and whose (A - mean A)(logp - mean logp) lies in
    (clip_cov_lb, clip_cov_ub), max(1, int(clip_cov_ratio * valid tokens)) are chosen at random
    and get no gradient. pg_clipfrac is the share of tokens so detached.
    """
    mask = response_mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - k.clip_low, 1.0 + k.clip_high)
    valid = mask > 0
    cov = (advantages - masked_mean(advantages, mask)) * (logp - masked_mean(logp.detach(), mask))
    candidates = valid & ~(clipped > unclipped) & (cov > k.clip_cov_lb) & (cov < k.clip_cov_ub)
    picked = torch.nonzero(candidates)  # [n, 2]
    n_clip = max(int(k.clip_cov_ratio * mask.sum().item()), 1)
    picked = picked[torch.randperm(len(picked), generator=generator)[:n_clip]]
    keep = torch.ones_like(logp)
    keep[picked[:, 0], picked[:, 1]] = 0.0
    loss_mat = torch.maximum(unclipped, clipped) * keep
    if is_weights is not None:
        loss_mat = loss_mat * is_weights
    loss = agg_loss(loss_mat, mask, k.agg_mode, loss_scale_factor=k.loss_scale_factor, **agg)
    return loss, {"pg_clipfrac": masked_mean(1.0 - keep, mask).item(),
                  "ppo_kl": masked_mean((old_logp - logp).detach(), mask).item()}


def kl_cov_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, response_mask: Tensor,
                k: PolicyLossKnobs, is_weights: Tensor | None = None, **agg) -> tuple[Tensor, dict[str, float]]:
    """KL-Cov: unclipped -A * ratio, plus ppo_kl_coef * |log ratio| on the top tokens by cov(A, log pi).

    The max(1, int(kl_cov_ratio * valid tokens)) valid tokens with the largest centred covariance
    get the penalty. ppo_kl reports mean |log ratio|, as verl does for this mode.
    """
    mask = response_mask.to(logp.dtype)
    log_ratio = logp - old_logp
    loss_mat = -advantages * torch.exp(log_ratio)  # [batch, resp_len]
    valid = torch.nonzero(mask.reshape(-1) > 0).squeeze(-1)  # flat indices of valid tokens
    adv, lp = advantages.detach().reshape(-1)[valid], logp.detach().reshape(-1)[valid]
    cov = (adv - adv.mean()) * (lp - lp.mean())
    top = valid[torch.topk(cov, max(1, int(len(cov) * k.kl_cov_ratio))).indices]
    penalty = torch.zeros_like(mask).reshape(-1)
    penalty[top] = k.ppo_kl_coef
    loss_mat = loss_mat + penalty.reshape(mask.shape) * log_ratio.abs()
    if is_weights is not None:
        loss_mat = loss_mat * is_weights
    loss = agg_loss(loss_mat, mask, k.agg_mode, loss_scale_factor=k.loss_scale_factor, **agg)
    return loss, {"ppo_kl": masked_mean(log_ratio.abs().detach(), mask).item()}


def geo_mean_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, response_mask: Tensor,
                  clip_low: float, clip_high: float, num_seqs: float | Tensor | None = None,
                  is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """GMPO: the geometric mean of token ratios per sequence, each log ratio clipped to
    [-clip_low, clip_high] in the pessimistic direction for sign(A); loss -A_seq * ratio_seq,
    averaged over sequences (A_seq: the mean advantage over the response)."""
    mask = response_mask.to(logp.dtype)
    length = mask.sum(-1).clamp(min=1)  # [batch]
    log_ratio = logp - old_logp
    clamped = log_ratio.clamp(-clip_low, clip_high)
    sign = torch.sign(advantages)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)  # [batch, resp_len]
    seq_ratio = torch.exp((pessimistic * mask).sum(-1) / length)  # [batch]
    seq_adv = (advantages * mask).sum(-1) / length  # [batch]
    losses = -seq_adv * seq_ratio
    if is_weights is not None:  # geometric mean of the token weights, as the ratio is one
        losses = losses * torch.exp((torch.log(is_weights + 1e-10) * mask).sum(-1) / length)
    loss = losses.sum() / (len(losses) if num_seqs is None else num_seqs)
    clipped = (log_ratio != clamped).float()
    return loss, {"pg_clipfrac": masked_mean(clipped * (advantages > 0), mask).item(),
                  "pg_clipfrac_lower": masked_mean(clipped * (advantages < 0), mask).item(),
                  "ppo_kl": masked_mean((old_logp - logp).detach(), mask).item()}


def sapo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, response_mask: Tensor, tau_pos: float,
              tau_neg: float, num_seqs: float | Tensor | None = None,
              is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """SAPO: a smooth gate instead of a clip, -A * (4 / tau) * sigmoid(tau (r - 1)), with tau_pos for
    A > 0 and tau_neg otherwise (its gradient at r = 1 is PPO's, and fades as r leaves 1);
    aggregated seq-mean-token-mean."""
    mask = response_mask.to(logp.dtype)
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    tau = torch.where(advantages > 0, tau_pos, tau_neg)
    loss_mat = -advantages * torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights
    loss = agg_loss(loss_mat, mask, "seq-mean-token-mean", num_seqs=num_seqs)
    return loss, {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0,
                  "ppo_kl": masked_mean((old_logp - logp).detach(), mask).item()}


def cispo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, response_mask: Tensor, k: PolicyLossKnobs,
               is_weights: Tensor | None = None, **agg) -> tuple[Tensor, dict[str, float]]:
    """CISPO: -sg(clip(r, 1-clip_low, 1+clip_high)) * A * log pi. The clipped ratio only weighs the
    token; every token keeps its log-prob's gradient. pg_clipfrac: the share of ratios clipped."""
    mask = response_mask.to(logp.dtype)
    ratio = torch.exp(torch.clamp(logp - old_logp, -20.0, 20.0))
    clipped = torch.clamp(ratio, 1.0 - k.clip_low, 1.0 + k.clip_high)
    loss_mat = -clipped.detach() * advantages * logp
    if is_weights is not None:
        loss_mat = loss_mat * is_weights
    loss = agg_loss(loss_mat, mask, k.agg_mode, loss_scale_factor=k.loss_scale_factor, **agg)
    return loss, {"pg_clipfrac": masked_mean((ratio != clipped).float(), mask).item(), "pg_clipfrac_lower": 0.0,
                  "ppo_kl": masked_mean((old_logp - logp).detach(), mask).item()}


def dppo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, response_mask: Tensor, k: PolicyLossKnobs,
              divergence: str, is_weights: Tensor | None = None, **agg) -> tuple[Tensor, dict[str, float]]:
    """DPPO (binary TV or binary KL): -A * sg(min(r, clip_c)) * log pi on the tokens whose probability
    moved less than the bound in the direction A pushes; the others carry no gradient. clip_low and
    clip_high bound the divergence: tv is p - p_old; kl is the KL between the two Bernoullis
    (p_old, p) of the sampled token, checked only when p moved the way A pushes."""
    mask = response_mask.to(logp.dtype)
    log_ratio = torch.clamp(logp - old_logp, -20.0, 20.0)
    ratio = torch.exp(log_ratio)
    truncated = torch.clamp(ratio, max=k.clip_c).detach()
    prob, old_prob = torch.exp(logp), torch.exp(old_logp)
    if divergence == "tv":
        up_ok, down_ok = prob - old_prob <= k.clip_high, prob - old_prob >= -k.clip_low
    else:
        bkl = old_prob * (old_logp - logp) + (1 - old_prob) * torch.log((1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8))
        up_ok, down_ok = (bkl <= k.clip_high) | (prob <= old_prob), (bkl <= k.clip_low) | (prob >= old_prob)
    kept = torch.where(advantages > 0, up_ok, down_ok).detach().to(logp.dtype)  # [batch, resp_len]
    loss_mat = -advantages * truncated * logp * kept
    if is_weights is not None:
        loss_mat = loss_mat * is_weights
    loss = agg_loss(loss_mat, mask, k.agg_mode, loss_scale_factor=k.loss_scale_factor, **agg)
    return loss, {"pg_clipfrac": masked_mean(1.0 - kept, mask).item(),
                  "pg_clipfrac_lower": masked_mean((ratio > k.clip_c).to(logp.dtype) * kept, mask).item(),
                  "ppo_kl": masked_mean(-log_ratio.detach(), mask).item()}


def dro_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, response_mask: Tensor, k: PolicyLossKnobs,
             is_weights: Tensor | None = None, **agg) -> tuple[Tensor, dict[str, float]]:
    """DRO: -(A * log pi - beta/2 * (log pi - log pi_old)^2) per token (policy_loss.dro_beta)."""
    if k.dro_beta is None or k.dro_beta <= 0:
        raise ValueError("policy_loss.dro_beta must be > 0 with loss_mode=dro")
    log_ratio = logp - old_logp
    loss_mat = -(logp * advantages - 0.5 * k.dro_beta * log_ratio ** 2)
    if is_weights is not None:
        loss_mat = loss_mat * is_weights
    loss = agg_loss(loss_mat, response_mask, k.agg_mode, loss_scale_factor=k.loss_scale_factor, **agg)
    return loss, {"pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0,
                  "ppo_kl": masked_mean(-log_ratio.detach(), response_mask).item()}


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor,
               cliprange: float = 0.5, agg_mode: str = "token-mean",
               num_tokens: float | Tensor | None = None,
               num_seqs: float | Tensor | None = None,
               loss_scale_factor: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss 0.5 * agg(max((V-R)^2, (clip(V, V_old +- cliprange) - R)^2))."""
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange, cliprange)
    unclipped_err = (values - returns) ** 2  # [batch, resp_len]
    clipped_err = (clipped_values - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped_err, clipped_err), response_mask, agg_mode,
                          num_tokens, num_seqs, loss_scale_factor)
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


# loss_mode name -> fn(logp, old_logp, advantages, mask, knobs, {num_tokens, num_seqs}, is_weights)
POLICY_LOSSES = {
    "vanilla": _vanilla,
    "gspo": lambda lp, old, a, m, k, agg, w: gspo_loss(lp, old, a, m, k.clip_low, k.clip_high, agg["num_seqs"], w,
                                                       k.agg_mode, agg["num_tokens"], k.loss_scale_factor),
    "gpg": lambda lp, old, a, m, k, agg, w: gpg_loss(lp, a, m, k.agg_mode, w, loss_scale_factor=k.loss_scale_factor, **agg),
    "clip_cov": lambda lp, old, a, m, k, agg, w: clip_cov_loss(lp, old, a, m, k, w, **agg),
    "kl_cov": lambda lp, old, a, m, k, agg, w: kl_cov_loss(lp, old, a, m, k, w, **agg),
    "geo_mean": lambda lp, old, a, m, k, agg, w: geo_mean_loss(lp, old, a, m, k.clip_low, k.clip_high, agg["num_seqs"], w),
    "sapo": lambda lp, old, a, m, k, agg, w: sapo_loss(lp, old, a, m, k.tau_pos, k.tau_neg, agg["num_seqs"], w),
    "cispo": lambda lp, old, a, m, k, agg, w: cispo_loss(lp, old, a, m, k, w, **agg),
    "dppo_tv": lambda lp, old, a, m, k, agg, w: dppo_loss(lp, old, a, m, k, "tv", w, **agg),
    "dppo_kl": lambda lp, old, a, m, k, agg, w: dppo_loss(lp, old, a, m, k, "kl", w, **agg),
    "dro": lambda lp, old, a, m, k, agg, w: dro_loss(lp, old, a, m, k, w, **agg),
}
assert tuple(POLICY_LOSSES) == POLICY_LOSS_NAMES, "plait/algorithms/names.py lists the policy losses config.py accepts"

