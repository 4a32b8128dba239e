"""The actor role: log-probs (with entropy) of responses, the PPO update, and its weights.

The update splits a step's batch into `ppo_mini_batch_size` optimizer steps and each of those into
micro-batches whose gradients accumulate; losses are normalised by the mini-batch's token and
sequence counts (summed over data-parallel ranks when torch.distributed runs), so micro-batching
and data parallelism give the same update as one big batch. Where the batch comes from, and
what happens to the weights afterwards, is the trainer's business.

Data parallelism (the Ray backend initialises torch.distributed) is plait/workers/parallel.py.
With LoRA (`model.lora_rank > 0`) only the adapters train; the reference policy is this same model
with its adapters switched off (`compute_ref_log_prob`), so no second copy is loaded; checkpoints
hold the adapter alone (beside huggingface/: the model config, for plait/export.py), and the rollout
gets base + adapter merged (`state_dict`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time

import torch
from torch.distributed.tensor import DTensor

from plait.algorithms.distillation import (DistillationKnobs, distillation_loss, estimator_losses, forward_kl_topk,
                                           topk_metrics, total_loss)
from plait.algorithms.kl import kl_estimate
from plait.algorithms.losses import PolicyLossKnobs, agg_loss, gpg_loss, policy_loss
from plait.algorithms.rollout_correction import rollout_correction
from plait.config import ActorConfig, ModelConfig, OptimConfig, RolloutCorrectionConfig
from plait.configtree import ConfigError
from plait.export import HF_DIR
from plait.models import add_lora, enable_activation_checkpointing, load_causal_lm, merged_state_dict
from plait.models_vl import is_vl, sequence_logprobs
from plait.profiler.timeline import RANK_SPANS
from plait.safeload import load_tensors
from plait.types import RolloutBatch
from plait.workers.flops import ModelFlops
from plait.workers.logprobs import check_lm_head, response_logprobs, response_stats, response_topk_stats
from plait.workers.packing import MicroBatching, checked_remove_padding
from plait.workers.parallel import (SHARDED_DIR, EvenMicroBatching, all_reduce_grads, check_same_batch, checkpoint_state,
                                    clip_grads, data_parallel, dp_rank_size, dp_share, even_micro_batches, full_state_dict,
                                    global_extremes, global_maxima, global_sum, is_sharded, load_checkpoint_state, load_sharded,
                                    offloads_optimizer,
                                    optimizer_step, save_sharded, shard_model, use_fsdp)
from plait.workers.precision import cast_buffers, compute_autocast, role_dtype


def response_forward(model, batch: RolloutBatch, temperature: float, layout: MicroBatching,
                     with_entropy: bool, grad: bool = False,
                     with_sum_pi_squared: bool = False) -> tuple[torch.Tensor, ...]:
    """Log-probs [batch, resp_len] (and entropy) of the batch's responses under `model`; with
    `with_sum_pi_squared` (no grad) a third tensor, the sum of squared probabilities [batch, resp_len]."""
    device = next(model.parameters()).device
    logp = torch.zeros(batch.responses.shape, device=device)               # [batch, resp_len]
    ent = torch.zeros(batch.responses.shape, device=device) if with_entropy else None
    spsq = torch.zeros(batch.responses.shape, device=device) if with_sum_pi_squared else None
    for rows in layout.split(batch):
        micro = batch.select(rows)
        with torch.set_grad_enabled(grad):
            logp[rows], micro_ent, micro_sq = response_stats(
                model, micro.input_ids.to(device), micro.attention_mask.to(device), micro.responses.shape[1],
                temperature, with_entropy, with_sum_pi_squared, layout.remove_padding, micro.multi_modal_inputs,
                micro.sampled_from, micro.grammar_masks)
        if with_entropy:
            ent[rows] = micro_ent
        if with_sum_pi_squared:
            spsq[rows] = micro_sq
    return (logp, ent, spsq) if with_sum_pi_squared else (logp, ent)


def micro_forward(model, micro: RolloutBatch, temperature: float, with_entropy: bool, remove_padding: bool = False):
    """Log-probs (and entropy) [micro, resp_len], 0 at padding; packed: only the real tokens go through the model."""
    device = next(model.parameters()).device
    return response_logprobs(model, micro.input_ids.to(device), micro.attention_mask.to(device),
                             micro.responses.shape[1], temperature, with_entropy, remove_padding, micro.multi_modal_inputs,
                             micro.sampled_from, micro.grammar_masks)


def micro_topk_forward(model, micro: RolloutBatch, temperature: float, remove_padding: bool = False):
    """`micro_forward` with entropy, plus the log-probs at the teacher's top-k ids and the model's own top-k ids
    [micro, resp_len, k] (top-k distillation)."""
    device = next(model.parameters()).device
    return response_topk_stats(model, micro.input_ids.to(device), micro.attention_mask.to(device),
                               micro.responses.shape[1], temperature, True, micro.teacher_ids, remove_padding,
                               micro.multi_modal_inputs, micro.sampled_from, micro.grammar_masks)


def freeze_vision_tower(model) -> None:
    """Stop a VL model's vision encoder (model.model.visual) from training; a text model is a ConfigError."""
    if not is_vl(model.config):
        raise ConfigError("actor_rollout_ref.actor.freeze_vision_tower", True, f"a {model.config.model_type} model "
                          "has no vision tower; set it false (it applies to Qwen2-VL / Qwen2.5-VL policies)")
    model.model.visual.requires_grad_(False)


def lr_factor(step: int, total_steps: int, warmup_steps: int, kind: str = "constant",
              min_lr_ratio: float = 0.0, num_cycles: float = 0.5) -> float:
    """The lr multiplier at training step `step` (0-based), as verl schedules it.

    constant: linear from 0 over `warmup_steps`, then 1. cosine: the same warmup, then a cosine of
    `num_cycles` waves over the remaining steps, floored at `min_lr_ratio`.
    """
    if kind == "constant":
        return step / max(1, warmup_steps) if step < warmup_steps else 1.0
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    wave = math.cos(math.pi * num_cycles * 2.0 * progress)
    return max(min_lr_ratio, min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + wave))


def make_optimizer(params, cfg: OptimConfig):
    """AdamW and its schedule; the scheduler steps once per training step (`update` call), as in verl.

    cfg.total_training_steps is the trainer's step count (the driver fills in -1);
    lr_warmup_steps -1 means lr_warmup_steps_ratio x total steps.
    """
    params = list(params)
    # The fused kernel (CPU and CUDA) updates all tensors in one pass: ~4x faster than the per-tensor
    # loop on a 46M model on CPU. FSDP2's sharded parameters keep the default implementation.
    fused = not any(isinstance(p, DTensor) for p in params)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, fused=fused)
    total = max(cfg.total_training_steps, 1)
    warmup = cfg.lr_warmup_steps if cfg.lr_warmup_steps >= 0 else int(cfg.lr_warmup_steps_ratio * total)
    kind = cfg.warmup_style or cfg.lr_scheduler_type  # warmup_style: verl's older name
    first = 0 if cfg.zero_indexed_step else 1  # verl's zero_indexed_step=false counts the schedule from 1
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s + first, total, warmup, kind, cfg.min_lr_ratio, cfg.num_cycles))
    return opt, sched


def add_stats(into: dict[str, float], new: dict[str, float], weight: float) -> None:
    """Sum a micro-batch's per-token means into a mini-batch's, weighted by its share of the tokens (a max: the max)."""
    for k, v in new.items():  # |p_actor - p_rollout|'s max stays a max
        into[k] = max(into.get(k, v), v) if k == DIFF_MAX else into.get(k, 0.0) + v * weight


def merge_extremes(into: dict[str, float], new: dict[str, float]) -> None:
    """verl's MIN / MAX metrics (names ending _min / _max) over several micro- or mini-batches."""
    for k, v in new.items():
        into[k] = v if k not in into else (min if k.endswith("_min") else max)(into[k], v)


LORA_DIR = "lora_adapter"  # the adapter's folder in an actor checkpoint


def probs_diff(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """One micro-batch's share of verl's training/rollout_probs_diff_{max,mean,std} on the paths without the
    separate old_log_prob pass (fused, bypass): means weighted by its tokens in _optimizer_step, the max a max."""
    diff = (logp.detach().exp() - rollout_logp.exp()).abs()[mask.bool()]  # [response tokens]
    if not diff.numel():
        return {}
    return {"training/rollout_probs_diff_mean": diff.mean().item(), DIFF_SQUARE: diff.square().mean().item(),
            DIFF_MAX: diff.max().item()}


def reduce_over_ranks(stats: dict[str, float], resp_tokens: float) -> dict[str, float]:
    """One optimizer step's stats summed over ranks (each rank summed its rows' parts); the fused or bypass pass's
    |p_actor - p_rollout| max taken as a max, and its std from the mean and the mean square."""
    peak = global_maxima([stats.pop(DIFF_MAX)]) if DIFF_MAX in stats else None
    stats = dict(zip(stats, global_sum(list(stats.values()))))
    if peak is not None:
        mean, square, n = stats["training/rollout_probs_diff_mean"], stats.pop(DIFF_SQUARE), max(resp_tokens, 2.0)
        std = math.sqrt(max(square - mean**2, 0.0) * n / (n - 1))  # unbiased, as torch's std over the tokens
        stats.update({DIFF_MAX: peak[0], "training/rollout_probs_diff_std": std})
    return stats


DIFF_MAX = "training/rollout_probs_diff_max"
DIFF_SQUARE = "training/rollout_probs_diff_square"  # the fused pass's mean square, for the std (not logged)


class Actor:
    def __init__(self, model_path: str, cfg: ActorConfig, n: int, temperature: float, profiler,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 1,
                 remove_padding: bool = False, max_token_len: int | None = None,
                 gradient_checkpointing: bool = False, model_cfg: ModelConfig | None = None,
                 distill: DistillationKnobs | None = None):
        """`dtype`: the compute dtype (the weights and the optimizer state are float32); `remove_padding`:
        packed forwards; `max_token_len`: token-budget micro-batches (use_dynamic_bsz); `model_cfg.lora_rank > 0`:
        LoRA adapters; `distill`: on-policy distillation's loss (the batches then carry the teacher's log-probs)."""
        self.cfg, self.n, self.temperature, self.profiler, self.distill = cfg, n, temperature, profiler, distill
        self.dtype = role_dtype(cfg.fsdp_config.mixed_precision, dtype)
        torch.manual_seed(seed)  # also seeds the LoRA A matrices
        self.model = load_causal_lm(model_path, dtype=torch.float32, device=device)
        cast_buffers(self.model, cfg.fsdp_config.mixed_precision)
        check_lm_head(self.model, "actor_rollout_ref.model.path")
        if cfg.freeze_vision_tower:  # verl's: the vision encoder keeps its weights; its optimizer gets none of them
            freeze_vision_tower(self.model)
        self.lora = model_cfg is not None and model_cfg.lora_rank > 0
        if self.lora:
            self.model = add_lora(self.model, model_cfg.lora_rank, model_cfg.lora_alpha,
                                  model_cfg.target_modules, model_cfg.lora_adapter_path, model_cfg.exclude_modules)
        self.model.train()
        remove_padding = checked_remove_padding(self.model, remove_padding)
        self.layout = MicroBatching(cfg.ppo_micro_batch_size_per_gpu, max_token_len, remove_padding)
        if gradient_checkpointing:  # recompute each block's activations in backward: memory for time
            enable_activation_checkpointing(self.model)
        self.flops = ModelFlops.of(self.model, dtype=self.dtype)
        if use_fsdp(cfg.strategy, device):  # with LoRA: the frozen base and the adapters sharded alike
            shard_model(self.model, self.model._no_split_modules or [], cfg.fsdp_config, device, self.dtype)
        self.autocast = functools.partial(compute_autocast, device, self.dtype, is_sharded(self.model))
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = make_optimizer(trainable, cfg.optim)
        self.offload_optimizer = offloads_optimizer(cfg.fsdp_config, device)
        self.shuffle_gen = torch.Generator().manual_seed(seed)
        self.pi_old: list[torch.Tensor] | None = None  # keep_pi_old's copy of the trainable weights

    def keep_pi_old(self) -> None:
        """Keep a copy of the trainable weights as they are now: pi_old of compute_log_prob(pi_old=True) until
        the next call (verl's separate_async: one pi_old, the synced weights, for all of a step's local updates)."""
        with torch.no_grad():
            self.pi_old = [p.detach().clone() for p in self.model.parameters() if p.requires_grad]

    @contextlib.contextmanager
    def _weights(self, saved: list[torch.Tensor]):
        """The trainable weights set to `saved` inside the block, and back to the current ones after it."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        with torch.no_grad():
            current = [p.detach().clone() for p in params]
            for p, s in zip(params, saved):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, c in zip(params, current):
                    p.copy_(c)

    def compute_log_prob(self, batch: RolloutBatch, micro_batch_size: int, max_token_len: int | None = None,
                         with_sum_pi_squared: bool = False, pi_old: bool = False) -> tuple[torch.Tensor, ...]:
        """Old log-probs and entropy [batch, resp_len] before the update (and the sum of squared
        probabilities with `with_sum_pi_squared`: verl's calculate_sum_pi_squared); `pi_old`: with the
        weights keep_pi_old kept."""
        weights = self._weights(self.pi_old) if pi_old else contextlib.nullcontext()
        with self.profiler.annotate("old_log_prob"), weights:
            layout = EvenMicroBatching(MicroBatching(micro_batch_size, max_token_len, self.layout.remove_padding), self.model)
            with self.autocast():
                return data_parallel(batch, lambda share: response_forward(
                    self.model, share, self.temperature, layout, with_entropy=True,
                    with_sum_pi_squared=with_sum_pi_squared), "Actor.compute_log_prob")

    def model_flops(self) -> ModelFlops:
        return self.flops

    def probe_logprobs(self, ids: list[int]) -> list[float]:
        """The weight-sync check's probe under the policy being trained (LoRA adapters on), in its compute dtype."""
        with self.autocast():
            return sequence_logprobs(self.model, ids)

    def compute_ref_log_prob(self, batch: RolloutBatch, micro_batch_size: int,
                             max_token_len: int | None = None) -> torch.Tensor:
        """LoRA only: log-probs [batch, resp_len] of the base model (adapters off), the reference."""
        with self.profiler.annotate("ref"), self.model.disable_adapter(), self.autocast():
            layout = EvenMicroBatching(MicroBatching(micro_batch_size, max_token_len, self.layout.remove_padding), self.model)
            [logp] = data_parallel(batch, lambda share: response_forward(self.model, share, self.temperature, layout,
                                                                         with_entropy=False)[:1], "Actor.compute_ref_log_prob")
            return logp

    def update(self, batch: RolloutBatch, correction: RolloutCorrectionConfig | None = None) -> dict[str, float]:
        """Policy update with `actor.policy_loss.loss_mode`. The batch's rollout_is_weights and loss_mask
        (rollout correction, computed by the trainer) weight and mask the loss; in bypass mode
        (`correction.bypass_mode`) they are computed here per micro-batch from the current log-probs.

        A batch without old_logprobs feeds exactly one optimizer step (the trainer decided, rollout
        correction off): pi_old is then the policy being updated, taken detached from the update's own forward."""
        with self.profiler.annotate("update_actor", scheduled=True):
            start = time.perf_counter()
            metrics = self._update(batch, correction)
            flops = self.cfg.ppo_epochs * self.flops.training(batch.attention_mask.sum(-1).tolist())
            metrics["perf/mfu/actor"] = self.flops.mfu(flops / dp_rank_size()[1], time.perf_counter() - start)  # this rank's share
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]  # the lr this step trained with
        self.scheduler.step()
        return metrics

    def _update(self, batch: RolloutBatch, correction: RolloutCorrectionConfig | None) -> dict[str, float]:
        cfg = self.cfg
        check_same_batch(batch, "Actor.update")
        mini = cfg.ppo_mini_batch_size * self.n
        sums: dict[str, float] = {}
        extremes: dict[str, float] = {}  # verl's */*_min and */*_max metrics: over every mini-batch
        count, peak = 0, 0.0
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(len(batch), generator=self.shuffle_gen) if cfg.shuffle else torch.arange(len(batch))
            for start in range(0, len(batch), mini):
                with self.profiler.mini_batch(count):  # a range, and a step of the torch profiler's schedule
                    stats, ext = self._optimizer_step(batch.select(dp_share(order[start:start + mini])), correction)
                for k, v in stats.items():
                    sums[k] = sums.get(k, 0.0) + v
                peak = max(peak, stats.get(DIFF_MAX, peak))
                merge_extremes(extremes, ext)
                count += 1
        metrics = {(k if "/" in k else f"actor/{k}"): v / count for k, v in sums.items()}
        metrics.update({k: v for k, v in extremes.items() if math.isfinite(v)})  # infinite: no token had one
        if DIFF_MAX in metrics:  # a max over the mini-batches, not their mean
            metrics[DIFF_MAX] = peak
        if cfg.use_kl_loss:
            metrics["actor/kl_coef"] = cfg.kl_loss_coef
        return metrics

    def _optimizer_step(self, mini: RolloutBatch,
                        correction: RolloutCorrectionConfig | None) -> tuple[dict[str, float], dict[str, float]]:
        """One optimizer step over a mini-batch: (metrics to average over mini-batches, verl's min/max ones).

        Over 60 lines: the micro-batch loop adds the loss terms in the order of verl's ppo_loss and
        distillation_ppo_loss (policy, entropy, KL, distillation) on one screen; spread over helpers, that
        order would be hidden."""
        cfg = self.cfg
        bypass = correction is not None and correction.bypass_mode
        loss_masks = mini.response_mask if mini.loss_mask is None else mini.loss_mask
        num_tokens, num_seqs, resp_tokens = global_sum([loss_masks.sum().item(), float(len(mini)),
                                                        mini.response_mask.sum().item()])
        norm = dict(num_tokens=max(num_tokens, 1.0), num_seqs=num_seqs)
        p = cfg.policy_loss
        knobs = PolicyLossKnobs(
            clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high, clip_c=cfg.clip_ratio_c,
            agg_mode=cfg.loss_agg_mode, loss_scale_factor=cfg.loss_scale_factor, clip_cov_ratio=p.clip_cov_ratio,
            clip_cov_lb=p.clip_cov_lb, clip_cov_ub=p.clip_cov_ub, kl_cov_ratio=p.kl_cov_ratio, ppo_kl_coef=p.ppo_kl_coef,
            tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg, dro_beta=p.dro_beta)
        stats = {"pg_loss": 0.0, "pg_clipfrac": 0.0, "pg_clipfrac_lower": 0.0, "ppo_kl": 0.0, "entropy": 0.0}
        if cfg.use_kl_loss:
            stats["kl_loss"] = 0.0
        extremes: dict[str, float] = {}
        self.optimizer.zero_grad(set_to_none=True)
        device = next(self.model.parameters()).device
        fused = mini.old_logprobs is None
        topk = self.distill is not None and self.distill.topk
        for rows, padding in even_micro_batches(self.layout.split(mini), self.model):
            micro = mini.select(rows)
            with self.autocast():  # top-k distillation: the log-probs at the teacher's top-k too, from one LM head pass
                logp, ent, *student_topk = (micro_topk_forward(self.model, micro, self.temperature, self.layout.remove_padding)
                                            if topk else micro_forward(self.model, micro, self.temperature, True,
                                                                       self.layout.remove_padding))
            if padding:  # FSDP2: this rank's collectives match the busiest rank's; the gradient gets nothing
                (logp.sum() * 0.0).backward()
                continue
            mask = micro.response_mask.to(device)
            loss_mask = mask if micro.loss_mask is None else micro.loss_mask.to(device)
            weight = loss_mask.sum().item() / norm["num_tokens"]   # share of this micro-batch in token means
            if fused:  # pi_old = this forward's policy, detached; the skipped old_log_prob pass's metrics
                pg_loss, pg_stats = self._fused_loss(micro, logp, mask, knobs, norm)
            elif bypass:  # pi_old is the rollout's: weights and rejection from the current policy (verl's bypass)
                pg_loss, pg_stats, loss_mask = self._bypass_loss(micro, logp, mask, knobs, norm, correction)
            else:
                is_w = None if micro.rollout_is_weights is None else micro.rollout_is_weights.to(device)
                pg_loss, pg_stats = policy_loss(cfg.policy_loss.loss_mode, logp, micro.old_logprobs.to(device),
                                                micro.advantages.to(device), loss_mask, knobs, is_weights=is_w, **norm)
            loss = pg_loss
            entropy = agg_loss(ent, mask, "token-mean", num_tokens=max(resp_tokens, 1.0))
            if cfg.entropy_coeff != 0:
                loss = loss - cfg.entropy_coeff * agg_loss(ent, loss_mask, cfg.loss_agg_mode,
                                                           loss_scale_factor=cfg.loss_scale_factor, **norm)
            if cfg.use_kl_loss:
                kl = kl_estimate(logp, micro.ref_logprobs.to(device), cfg.kl_loss_type)
                kl_loss = agg_loss(kl, loss_mask, cfg.loss_agg_mode, loss_scale_factor=cfg.loss_scale_factor, **norm)
                loss = loss + cfg.kl_loss_coef * kl_loss
                stats["kl_loss"] += kl_loss.item()
            if self.distill is not None:  # verl's distillation_ppo_loss: the distillation loss beside or instead
                d_loss, d_means, d_ext = self._distillation_loss(micro, logp, student_topk or None, loss_mask, knobs, norm)
                loss = total_loss(loss, d_loss, self.distill)
                stats["distillation/loss"] = stats.get("distillation/loss", 0.0) + d_loss.item()  # summed, as pg_loss
                add_stats(stats, d_means, weight)
                merge_extremes(extremes, d_ext)
            loss.backward()
            stats["pg_loss"] += pg_loss.item()
            stats["entropy"] += entropy.item()
            add_stats(stats, pg_stats, weight)  # per-token means (and rollout_corr/* in bypass mode): token-weighted
        all_reduce_grads(self.model)
        grad_norm = clip_grads(self.model, cfg.grad_clip)
        if math.isfinite(grad_norm):  # a non-finite norm would poison the weights: skip the step
            optimizer_step(self.optimizer, self.offload_optimizer)
        stats = reduce_over_ranks(stats, resp_tokens)
        stats["grad_norm"] = grad_norm
        return {(f"actor/{k}" if k.startswith("distillation/") else k): v for k, v in stats.items()}, \
            {f"actor/{k}": v for k, v in global_extremes(extremes).items()}

    def _distillation_loss(self, micro: RolloutBatch, logp: torch.Tensor, student_topk: list | None, loss_mask: torch.Tensor,
                           knobs: PolicyLossKnobs, norm: dict) -> tuple[torch.Tensor, dict[str, float], dict[str, float]]:
        """The distillation loss of a micro-batch (plait/algorithms/distillation.py) and its metrics: per-token
        losses against the teacher's log-probs, aggregated as the policy loss is (or, with use_policy_gradient,
        their negation as advantages against pi_old: the update's own detached forward when fused)."""
        d, device = self.distill, logp.device
        teacher = micro.teacher_logprobs.to(device)
        if student_topk is None:
            losses, means, extremes = estimator_losses(d.loss_mode, logp, teacher), {}, {}
        else:
            at_ids, student_ids = student_topk
            losses, aux = forward_kl_topk(at_ids, teacher, micro.teacher_ids.to(device), student_ids, d.log_prob_min_clamp)
            means, extremes = topk_metrics(aux, loss_mask, teacher.shape[-1])
        old = logp.detach() if micro.old_logprobs is None else micro.old_logprobs.to(device)
        is_w = None if micro.rollout_is_weights is None else micro.rollout_is_weights.to(device)
        loss, d_means, d_ext = distillation_loss(d, losses, logp, old, loss_mask, knobs.agg_mode,
                                                 loss_scale_factor=knobs.loss_scale_factor, is_weights=is_w, **norm)
        return loss, {**means, **d_means}, {**extremes, **d_ext}

    def _fused_loss(self, micro: RolloutBatch, logp: torch.Tensor, mask: torch.Tensor, knobs: PolicyLossKnobs,
                    norm: dict) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss with pi_old = logp.detach(), and the off-policy metrics the old_log_prob pass gives."""
        rollout_logp = micro.rollout_logprobs.to(logp.device)
        _, _, corr = rollout_correction(logp.detach(), rollout_logp, mask, None, 1.0, False, None, None)
        corr.update(probs_diff(logp, rollout_logp, mask))
        loss, stats = policy_loss(self.cfg.policy_loss.loss_mode, logp, logp.detach(), micro.advantages.to(logp.device),
                                  mask, knobs, **norm)
        return loss, {**stats, **corr}

    def _bypass_loss(self, micro: RolloutBatch, logp: torch.Tensor, mask: torch.Tensor, knobs: PolicyLossKnobs,
                     norm: dict, correction: RolloutCorrectionConfig) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
        """Bypass mode's loss, its metrics (rollout_corr/* included) and the loss mask after rejection."""
        c, device = correction, logp.device
        rollout_logp, adv = micro.old_logprobs.to(device), micro.advantages.to(device)  # old_logprobs = rollout's here
        is_w, loss_mask, corr = rollout_correction(logp.detach(), rollout_logp, mask, c.rollout_is, c.rollout_is_threshold,
                                                   c.rollout_is_batch_normalize, c.rollout_rs, c.rollout_rs_threshold)
        corr.update(probs_diff(logp, rollout_logp, mask))
        if c.loss_type == "reinforce":  # -A log pi, weighted by pi / pi_rollout
            loss, stats = gpg_loss(logp, adv, loss_mask, knobs.agg_mode, is_w, loss_scale_factor=knobs.loss_scale_factor,
                                   **norm)
        else:  # ppo_clip: the ratio to pi_rollout is already the IS correction, clipped
            loss, stats = policy_loss("vanilla", logp, rollout_logp, adv, loss_mask, knobs, **norm)
        return loss, {**stats, **corr}, loss_mask

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights under the plain model's names (LoRA: merged), for the rollout (sharded: a
        collective, every rank calls it): the actor's part of update_weights, a span of each rank's lane on Ray.
        Only the span, not a profiler range: a window's artifacts (one per stage, discrete) stay the stages
        the profiler's contract names."""
        with RANK_SPANS.stage("actor", "update_weights"):
            if not self.lora:
                return full_state_dict(self.model)
            base = self.model.get_base_model()
            return merged_state_dict(self.model, full_state_dict(base) if is_sharded(self.model) else None)

    def save_checkpoint(self, path: str) -> None:
        """FSDP2: every rank writes its shards (`sharded/`); else rank 0 writes model.pt. optim.pt holds
        the optimizer (unsharded runs), the lr schedule and the shuffle order."""
        sharded = is_sharded(self.model)
        if sharded:
            save_sharded(os.path.join(path, SHARDED_DIR), self.model, self.optimizer)
        else:
            model_state, optim_state = checkpoint_state(self.model, self.optimizer)
        # the adapter's whole tensors (sharded: gathered, a collective); peft keeps the LoRA keys of them
        adapter_state = (full_state_dict(self.model) if sharded else None) if self.lora else None
        if dp_rank_size()[0] != 0:  # replicas hold the same weights: one writer
            return
        os.makedirs(path, exist_ok=True)
        plain = self.model.get_base_model() if self.lora else self.model
        plain.config.save_pretrained(os.path.join(path, HF_DIR))  # what plait/export.py builds the model from
        plain.generation_config.save_pretrained(os.path.join(path, HF_DIR))
        if self.lora:  # the adapter alone, in peft's format (loadable with PeftModel.from_pretrained)
            self.model.save_pretrained(os.path.join(path, LORA_DIR), state_dict=adapter_state)
        elif not sharded:
            torch.save(model_state, os.path.join(path, "model.pt"))
        torch.save({**({} if sharded else {"optimizer": optim_state}), "scheduler": self.scheduler.state_dict(),
                    "shuffle_gen": self.shuffle_gen.get_state()}, os.path.join(path, "optim.pt"))

    def load_checkpoint(self, path: str) -> None:
        """Either format into either layout: a sharded checkpoint loads at any world size."""
        state = load_tensors(os.path.join(path, "optim.pt"))
        if os.path.isdir(os.path.join(path, SHARDED_DIR)):
            load_sharded(os.path.join(path, SHARDED_DIR), self.model, self.optimizer)
        elif self.lora:
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file
            adapter = load_file(os.path.join(path, LORA_DIR, "adapter_model.safetensors"))
            if set_peft_model_state_dict(self.model, adapter).unexpected_keys:
                raise ValueError(f"{path}: the saved adapter does not fit this model's LoRA settings")
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            load_checkpoint_state(self.model, self.optimizer,
                                  load_tensors(os.path.join(path, "model.pt")), state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.shuffle_gen.set_state(state["shuffle_gen"])

    def save_pretrained(self, path: str) -> None:
        self.model.save_pretrained(path)
