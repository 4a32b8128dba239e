"""The actor role: log-probs (with entropy) of responses, the PPO update, and its weights.

The update splits a step's batch into `ppo_mini_batch_size` optimizer steps and each of those into
micro-batches whose gradients accumulate; losses are normalised by the mini-batch's token and
sequence counts (summed over data-parallel ranks when torch.distributed runs), so micro-batching
and data parallelism give the same update as one big batch. Where the batch comes from, and
what happens to the weights afterwards, is the trainer's business.

Data parallelism (the Ray backend initialises torch.distributed) is plait/workers/parallel.py.
"""

from __future__ import annotations

import math
import os

import torch

from plait.algorithms.kl import kl_estimate
from plait.algorithms.losses import agg_loss, entropy_from_logits, ppo_policy_loss, token_logprobs
from plait.config import ActorConfig, OptimConfig, RolloutCorrectionConfig
from plait.models import load_causal_lm
from plait.types import RolloutBatch
from plait.workers.parallel import (all_reduce_grads, check_same_batch, checkpoint_state, clip_grads, dp_rank_size,
                                    dp_share, full_state_dict, global_sum, load_checkpoint_state, shard_model, use_fsdp)


def response_forward(model, batch: RolloutBatch, temperature: float, micro_batch_size: int,
                     with_entropy: bool, grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [batch, resp_len] (and entropy) of the batch's responses under `model`."""
    logps, ents = [], []
    for start in range(0, len(batch), micro_batch_size):
        micro = batch.select(slice(start, start + micro_batch_size))
        with torch.set_grad_enabled(grad):
            logp, ent = micro_forward(model, micro, temperature, with_entropy)
        logps.append(logp)
        ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)


def micro_forward(model, micro: RolloutBatch, temperature: float, with_entropy: bool):
    device = next(model.parameters()).device
    input_ids = micro.input_ids.to(device)                      # [micro, prompt_len + resp_len]
    mask = micro.attention_mask.to(device)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    resp_len = micro.responses.shape[1]
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                   use_cache=False).logits[:, -resp_len - 1:-1]  # [micro, resp_len, vocab]
    logits = logits.float() / temperature
    logp = token_logprobs(logits, input_ids[:, -resp_len:])      # [micro, resp_len]
    ent = entropy_from_logits(logits) if with_entropy else None  # [micro, resp_len]
    return logp, ent


def truncated_is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                         level: str, threshold: float) -> torch.Tensor:
    """Truncated importance weights [batch, resp_len] between the actor's old log-probs and the
    rollout's: min(pi_old / pi_rollout, threshold) per token, or per sequence (the ratio of
    sequence probabilities, broadcast over its tokens). Constants in the loss: no gradient."""
    log_w = (old_logp - rollout_logp).detach() * mask                     # [batch, resp_len]
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)              # [batch, resp_len]
    return torch.exp(log_w.clamp(max=math.log(threshold))) * mask


def make_optimizer(params, cfg: OptimConfig):
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
    warmup = cfg.lr_warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0)
    return opt, sched


class Actor:
    def __init__(self, model_path: str, cfg: ActorConfig, n: int, temperature: float, profiler,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 1,
                 fsdp: bool | None = None):
        self.cfg, self.n, self.temperature, self.profiler = cfg, n, temperature, profiler
        torch.manual_seed(seed)
        self.model = load_causal_lm(model_path, dtype=dtype, device=device)
        self.model.train()
        if use_fsdp(fsdp, device):
            shard_model(self.model, self.model._no_split_modules or [])
        self.optimizer, self.scheduler = make_optimizer(self.model.parameters(), cfg.optim)
        self.shuffle_gen = torch.Generator().manual_seed(seed)

    def compute_log_prob(self, batch: RolloutBatch, micro_batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Old log-probs and entropy [batch, resp_len] before the update."""
        with self.profiler.annotate("old_log_prob"):
            logp, ent = response_forward(self.model, batch, self.temperature, micro_batch_size, with_entropy=True)
            return logp, ent

    def update(self, batch: RolloutBatch, correction: RolloutCorrectionConfig | None = None) -> dict[str, float]:
        """PPO update; with `correction.rollout_is` set, off-policy rows are reweighted by truncated_is_weights."""
        with self.profiler.annotate("update_actor"):
            return self._update(batch, correction)

    def _update(self, batch: RolloutBatch, correction: RolloutCorrectionConfig | None) -> dict[str, float]:
        cfg = self.cfg
        check_same_batch(batch, "Actor.update")
        mini = cfg.ppo_mini_batch_size * self.n
        sums: dict[str, float] = {}
        count = 0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(batch), generator=self.shuffle_gen) if cfg.shuffle else torch.arange(len(batch))
            for start in range(0, len(batch), mini):
                stats = self._optimizer_step(batch.select(dp_share(order[start:start + mini])), correction)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        metrics = {f"actor/{k}": v / count for k, v in sums.items()}
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _optimizer_step(self, mini: RolloutBatch, correction: RolloutCorrectionConfig | None) -> dict[str, float]:
        cfg = self.cfg
        num_tokens, num_seqs = global_sum([mini.response_mask.sum().item(), float(len(mini))])
        norm = dict(num_tokens=max(num_tokens, 1.0), num_seqs=num_seqs)
        stats = {"pg_loss": 0.0, "pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": 0.0, "entropy": 0.0}
        if cfg.use_kl_loss:
            stats["kl_loss"] = 0.0
        self.optimizer.zero_grad(set_to_none=True)
        device = next(self.model.parameters()).device
        for start in range(0, len(mini), cfg.ppo_micro_batch_size_per_gpu):
            micro = mini.select(slice(start, start + cfg.ppo_micro_batch_size_per_gpu))
            mask = micro.response_mask.to(device)
            weight = mask.sum().item() / norm["num_tokens"]   # share of this micro-batch in token means
            logp, ent = micro_forward(self.model, micro, self.temperature, with_entropy=True)
            old_logp = micro.old_logprobs.to(device)
            is_weights = None
            if correction is not None and correction.rollout_is is not None:
                is_weights = truncated_is_weights(old_logp, micro.rollout_logprobs.to(device), mask,
                                                  correction.rollout_is, correction.rollout_is_threshold)
            pg_loss, pg_stats = ppo_policy_loss(
                logp, old_logp, micro.advantages.to(device), mask,
                clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high, clip_c=cfg.clip_ratio_c,
                agg_mode=cfg.loss_agg_mode, is_weights=is_weights, **norm)
            loss = pg_loss
            entropy = agg_loss(ent, mask, "token-mean", num_tokens=norm["num_tokens"])
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * agg_loss(ent, mask, cfg.loss_agg_mode, **norm)
            if cfg.use_kl_loss:
                kl = kl_estimate(logp, micro.ref_logprobs.to(device), cfg.kl_loss_type)
                kl_loss = agg_loss(kl, mask, cfg.loss_agg_mode, **norm)
                loss = loss + cfg.kl_loss_coef * kl_loss
                stats["kl_loss"] += kl_loss.item()
            loss.backward()
            stats["pg_loss"] += pg_loss.item()
            stats["entropy"] += entropy.item()
            for k in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
                stats[k] += pg_stats[k] * weight
        all_reduce_grads(self.model)
        grad_norm = clip_grads(self.model, cfg.grad_clip)
        if math.isfinite(grad_norm):  # a non-finite norm would poison the weights: skip the step
            self.optimizer.step()
        self.scheduler.step()
        stats = dict(zip(stats, global_sum(list(stats.values()))))  # each rank summed its rows' parts
        stats["grad_norm"] = grad_norm
        return stats

    def state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model)

    def save_checkpoint(self, path: str) -> None:
        model_state, optim_state = checkpoint_state(self.model, self.optimizer)
        if dp_rank_size()[0] != 0:  # ranks hold the same weights (or rank 0 gathered them): one writer
            return
        os.makedirs(path, exist_ok=True)
        torch.save(model_state, os.path.join(path, "model.pt"))
        torch.save({"optimizer": optim_state, "scheduler": self.scheduler.state_dict(),
                    "shuffle_gen": self.shuffle_gen.get_state()}, os.path.join(path, "optim.pt"))

    def load_checkpoint(self, path: str) -> None:
        state = torch.load(os.path.join(path, "optim.pt"), weights_only=True)
        load_checkpoint_state(self.model, self.optimizer,
                              torch.load(os.path.join(path, "model.pt"), weights_only=True), state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.shuffle_gen.set_state(state["shuffle_gen"])

    def save_pretrained(self, path: str) -> None:
        self.model.save_pretrained(path)
