"""Flow-GRPO: group-relative advantages, the clipped-ratio loss and the KL on predicted means.

Pure functions over tensors. A diffusion sample is one trajectory of K trained denoising steps;
its log-prob at a step is the Gaussian log-density of the recorded transition averaged over
latent dimensions (plait/workers/diffusion.py), so ratios and the KL here are per-dimension
quantities and `clip_range` is correspondingly tiny. Not here: the sampler that produces the
log-probs, the worker that runs the update, reward functions.
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_ids: Tensor, eps: float = 1e-4,
                     global_std: bool = True) -> Tensor:
    """(r - mean of r's group) / (std + eps): one advantage per sample, [B].

    `global_std` divides by the std of the whole batch, which keeps a group whose samples all
    scored alike from having its tiny differences blown up; otherwise by the group's own std.
    Stds are population stds (no Bessel correction), so a group or batch of one gives 0, not NaN.
    """
    _, idx = torch.unique(group_ids, return_inverse=True)  # [B]; ids need not be contiguous
    count = torch.bincount(idx).to(rewards.dtype)  # [groups]
    mean = torch.zeros_like(count).index_add_(0, idx, rewards) / count  # [groups]
    centred = rewards - mean[idx]  # [B]
    if global_std:
        std = rewards.std(unbiased=False)  # []
    else:
        std = (torch.zeros_like(count).index_add_(0, idx, centred**2) / count).sqrt()[idx]  # [B]
    return centred / (std + eps)


def flow_grpo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, clip_range: float = 1e-4,
                   adv_clip_max: float = 5.0) -> tuple[Tensor, dict[str, float]]:
    """Clipped-ratio policy loss mean(max(-A r, -A clip(r, 1 +- clip_range))) over samples x steps.

    logp, old_logp: [B, K] per-step log-probs under the current and the sampling policy;
    advantages: [B], clamped to +-adv_clip_max and shared by all K steps of a sample.
    Metrics: pg_loss, pg_clipfrac (share of terms where the clipped branch is taken) and ppo_kl
    (mean old_logp - logp).
    """
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)[:, None]  # [B, 1]
    ratio = torch.exp(logp - old_logp)  # [B, K]
    unclipped = -adv * ratio  # [B, K]
    clipped = -adv * ratio.clamp(1 - clip_range, 1 + clip_range)  # [B, K]
    loss = torch.maximum(unclipped, clipped).mean()
    metrics = {
        "pg_loss": loss.item(),
        "pg_clipfrac": (clipped > unclipped).float().mean().item(),
        "ppo_kl": (old_logp - logp).mean().item(),
    }
    return loss, metrics


def mean_kl(mu: Tensor, mu_ref: Tensor, sigma_t: Tensor | float) -> Tensor:
    """KL between two Gaussian transitions that share std `sigma_t`, per latent dim; [B].

    KL(N(mu, s^2) || N(mu_ref, s^2)) = (mu - mu_ref)^2 / (2 s^2) in each dimension; averaged over
    dimensions like the log-probs. `sigma_t` is the transition std sigma_t * sqrt(-dt), a scalar
    or one value per sample [B].
    """
    return ((mu - mu_ref) ** 2).flatten(1).mean(1) / (2 * torch.as_tensor(sigma_t) ** 2)
