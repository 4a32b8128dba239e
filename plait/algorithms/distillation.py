"""On-policy distillation losses (verl 0.9.1's `distillation.distillation_loss`), pure functions over tensors.

The student samples; a teacher scores the student's tokens; per response token a loss compares the two:

- estimator modes (k1/kl, abs, k2/mse, k3/low_var_kl): a KL estimator of KL(student || teacher) from the
  sampled token's log-probs alone (`kl.kl_estimate`; the teacher takes the reference's place);
- forward_kl_topk: KL(teacher || student) over the teacher's top-k tokens at each position,
  sum_k p_T(k) (log p_T(k) - log p_S(k)), floored at 0 (the two truncated distributions need not sum to 1).

The per-token losses [batch, resp_len] are clamped to +-loss_max_clamp and then either aggregated and
backpropagated as a supervised loss (use_policy_gradient=false; k3 or forward_kl_topk), or their negation is
the advantage of PPO's vanilla clipped loss (use_policy_gradient=true, Thinking Machines' recipe; k1).
`total_loss` adds the actor's own loss as verl does: with use_task_rewards the sum policy + coef * distill,
without it the distillation loss alone (the actor's pg, entropy and KL terms dropped).

Left out: how the log-probs are made (the teacher role, plait/workers/teacher.py; the student's forward
gathers its log-probs at the teacher's top-k ids, plait/workers/logprobs.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from plait.algorithms.kl import kl_estimate
from plait.algorithms.losses import agg_loss, ppo_policy_loss
from plait.algorithms.names import DISTILLATION_ESTIMATOR_MODES, DISTILLATION_TOPK_MODES


@dataclass
class DistillationKnobs:
    """What the loss reads of `distillation.distillation_loss` (verl's names in the comments)."""
    loss_mode: str = "k3"                   # loss_mode
    use_task_rewards: bool = True           # use_task_rewards: keep the actor's policy loss beside it
    coef: float = 1.0                       # distillation_loss_coef (with use_task_rewards only)
    loss_max_clamp: float | None = None     # loss_max_clamp: per-token losses clamped to +-this
    log_prob_min_clamp: float | None = None  # log_prob_min_clamp: top-k log-probs floored at this
    use_policy_gradient: bool = False       # use_policy_gradient: -loss as the advantage of PPO's clipped loss
    clip_low: float = 0.2                   # clip_ratio_low (clip_ratio when null)
    clip_high: float = 0.2                  # clip_ratio_high

    @property
    def topk(self) -> bool:
        return self.loss_mode in DISTILLATION_TOPK_MODES


def estimator_losses(mode: str, logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """Per-token KL(student || teacher) estimate [batch, resp_len] from the sampled tokens' log-probs."""
    if mode not in DISTILLATION_ESTIMATOR_MODES:
        raise ValueError(f"unknown distillation estimator {mode!r}; valid: {', '.join(DISTILLATION_ESTIMATOR_MODES)}")
    return kl_estimate(logp, teacher_logp, mode)


def forward_kl_topk(student_logp: Tensor, teacher_logp: Tensor, teacher_ids: Tensor, student_ids: Tensor,
                    log_prob_min_clamp: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """KL(teacher || student) over the teacher's top-k tokens, floored at 0: losses [batch, resp_len].

    `student_logp` [batch, resp_len, k]: the student's log-probs at `teacher_ids` [batch, resp_len, k];
    `teacher_logp` the teacher's there; `student_ids` the student's own top-k ids (the overlap diagnostics
    of "Rethinking On-Policy Distillation", arXiv:2604.13016, as verl logs them). Also returns, per token,
    student_mass and teacher_mass (probability in the teacher's top-k, before clamping), overlap_count
    (teacher top-k ids in the student's top-k) and overlap_token_advantage (mean -p_T (log p_T - log p_S)
    over those)."""
    student_mass, teacher_mass = student_logp.exp().sum(-1), teacher_logp.exp().sum(-1)   # [batch, resp_len]
    if log_prob_min_clamp is not None:
        student_logp, teacher_logp = student_logp.clamp_min(log_prob_min_clamp), teacher_logp.clamp_min(log_prob_min_clamp)
    student_logp, teacher_logp = student_logp.float(), teacher_logp.float()
    token_kl = teacher_logp.exp() * (teacher_logp - student_logp)                          # [batch, resp_len, k]
    overlap = (teacher_ids.unsqueeze(-1) == student_ids.unsqueeze(-2)).any(-1)             # [batch, resp_len, k]
    count = overlap.sum(-1)                                                                # [batch, resp_len]
    advantage = torch.where(count > 0, (-token_kl.detach() * overlap).sum(-1) / count.clamp_min(1), 0.0)
    return token_kl.sum(-1).clamp_min(0.0), {"student_mass": student_mass.detach(), "teacher_mass": teacher_mass.detach(),
                                             "overlap_count": count, "overlap_token_advantage": advantage}


def topk_metrics(aux: dict[str, Tensor], mask: Tensor, k: int) -> tuple[dict[str, float], dict[str, float]]:
    """verl's top-k diagnostics over the response tokens of `mask`: (means, {name: min or max}); without
    tokens, 0 and the extremes' neutral +-inf (the same names on every data-parallel rank)."""
    valid = mask.bool()
    student, teacher = aux["student_mass"][valid], aux["teacher_mass"][valid]
    if student.numel() == 0:
        return ({f"distillation/{k}": 0.0 for k in ("student_mass", "teacher_mass", "overlap_ratio", "overlap_token_advantage")},
                {f"distillation/{k}_{e}": math.inf if e == "min" else -math.inf
                 for k in ("student_mass", "teacher_mass") for e in ("min", "max")})
    count, where = aux["overlap_count"], valid & (aux["overlap_count"] > 0)
    means = {"distillation/student_mass": student.mean().item(), "distillation/teacher_mass": teacher.mean().item(),
             "distillation/overlap_ratio": count[valid].float().mean().item() / k,
             "distillation/overlap_token_advantage": aux["overlap_token_advantage"][where].mean().item() if where.any() else 0.0}
    extremes = {"distillation/student_mass_min": student.min().item(), "distillation/student_mass_max": student.max().item(),
                "distillation/teacher_mass_min": teacher.min().item(), "distillation/teacher_mass_max": teacher.max().item()}
    return means, extremes


def distillation_loss(knobs: DistillationKnobs, losses: Tensor, logp: Tensor, old_logp: Tensor, mask: Tensor,
                      agg_mode: str, num_tokens: float | Tensor | None = None, num_seqs: float | Tensor | None = None,
                      loss_scale_factor: float | None = None, is_weights: Tensor | None = None
                      ) -> tuple[Tensor, dict[str, float], dict[str, float]]:
    """The distillation loss of per-token `losses` [batch, resp_len]: (scalar, means, extremes).

    Supervised: agg_loss of the clamped losses. Policy gradient: PPO's vanilla clipped loss of `logp`
    against `old_logp` with advantages -losses (detached), clip_c 3 (verl's default: its distillation
    config has none). Metrics are verl's: distillation/abs_loss (estimator modes), loss_min / loss_max
    (before clamping; +-inf without tokens) and, with the policy gradient, pg_clipfrac, ppo_kl, pg_clipfrac_lower."""
    valid = losses.detach()[mask.bool()]                                                     # [tokens]
    means = {} if knobs.topk else {"distillation/abs_loss": valid.abs().mean().item() if valid.numel() else 0.0}
    extremes = {"distillation/loss_min": valid.min().item() if valid.numel() else math.inf,  # none: the neutral
                "distillation/loss_max": valid.max().item() if valid.numel() else -math.inf}
    if knobs.loss_max_clamp is not None:  # both sides: k1 is negative where the student is the less likely
        losses = losses.clamp(-knobs.loss_max_clamp, knobs.loss_max_clamp)
    agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=loss_scale_factor)
    if not knobs.use_policy_gradient:
        return agg_loss(losses, mask, agg_mode, **agg), means, extremes
    loss, pg = ppo_policy_loss(logp, old_logp, -losses.detach(), mask, knobs.clip_low, knobs.clip_high, 3.0, agg_mode,
                               is_weights=is_weights, **agg)
    means.update({f"distillation/{k}": v for k, v in pg.items()})  # masked_mean: 0 without tokens
    return loss, means, extremes


def total_loss(policy_loss: Tensor, distill_loss: Tensor, knobs: DistillationKnobs) -> Tensor:
    """verl's combination: policy + coef * distill with task rewards, else the distillation loss alone."""
    if knobs.use_task_rewards:
        return policy_loss + knobs.coef * distill_loss
    return distill_loss
