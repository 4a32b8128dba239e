"""The critic role: a value head on a causal LM body, predicting a value per response token.

The body is any Hugging Face causal LM (by default the actor's starting weights); the head is one
linear layer on the last hidden state, zero-initialised so the first values are 0.
"""

from __future__ import annotations

import functools
import os

import torch

from plait.algorithms.losses import value_loss
from plait.config import CriticConfig
from plait.models import enable_activation_checkpointing, load_causal_lm
from plait.models_vl import is_vl, vl_inputs
from plait.safeload import load_tensors
from plait.types import RolloutBatch
from plait.workers.actor import make_optimizer
from plait.workers.packing import MicroBatching, checked_remove_padding, pack, unpack
from plait.workers.parallel import (SHARDED_DIR, all_reduce_grads, check_same_batch, checkpoint_state, clip_grads,
                                    data_parallel, dp_rank_size, dp_share, even_micro_batches, global_sum, is_sharded,
                                    load_checkpoint_state, load_sharded, offloads_optimizer, optimizer_step, save_sharded,
                                    shard_model, use_fsdp)
from plait.workers.precision import cast_buffers, compute_autocast, role_dtype


class ValueModel(torch.nn.Module):
    def __init__(self, lm, remove_padding: bool = False):
        super().__init__()
        self.lm, self.remove_padding = lm, remove_padding
        self.head = torch.nn.Linear(lm.config.get_text_config().hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, micro: RolloutBatch) -> torch.Tensor:
        device = self.head.weight.device
        input_ids, mask = micro.input_ids.to(device), micro.attention_mask.to(device)
        resp_len = micro.responses.shape[1]
        packed = pack(input_ids, mask) if self.remove_padding else None
        # a VL model: the rows' images and 3-axis rope positions (plait/models_vl.py)
        media = (vl_inputs(self.lm.config, micro.multi_modal_inputs or [{}] * len(micro), input_ids, mask, packed)
                 if is_vl(self.lm.config) else {})
        if self.remove_padding:  # the real tokens packed into rows (plait/workers/packing.py)
            inputs = {"position_ids": packed.position_ids, **media}
            out = self.lm.base_model(input_ids=packed.input_ids, use_cache=False, **inputs)
            hidden = unpack(out.last_hidden_state, packed, mask.shape)[:, -resp_len - 1:-1]  # [micro, resp_len, hidden]
        else:
            inputs = {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0), **media}
            out = self.lm.base_model(input_ids=input_ids, attention_mask=mask, use_cache=False, **inputs)
            hidden = out.last_hidden_state[:, -resp_len - 1:-1]   # [micro, resp_len, hidden]: state before each token
        # fp32 head unless FSDP2 mixed precision casts its weight (then hidden takes that dtype)
        return self.head(hidden.to(self.head.weight.dtype)).float().squeeze(-1)  # [micro, resp_len]


class Critic:
    def __init__(self, model_path: str, cfg: CriticConfig, n: int, profiler,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, remove_padding: bool = False, max_token_len: int | None = None,
                 forward_max_token_len: int | None = None, gradient_checkpointing: bool = False):
        """`max_token_len` / `forward_max_token_len`: token-budget micro-batches for update / values."""
        self.cfg, self.n, self.profiler = cfg, n, profiler
        self.layout = MicroBatching(cfg.ppo_micro_batch_size_per_gpu, max_token_len)
        self.forward_layout = MicroBatching(cfg.ppo_micro_batch_size_per_gpu, forward_max_token_len)
        mp = cfg.model.fsdp_config.mixed_precision
        dtype = role_dtype(mp, dtype)  # the compute dtype
        lm = load_causal_lm(model_path, dtype=torch.float32, device=device, key="critic.model.path")  # float32 master weights
        cast_buffers(lm, mp)
        self.model = ValueModel(lm, checked_remove_padding(lm, remove_padding)).to(device)
        if gradient_checkpointing:  # HF checkpoints only in training mode (no dropout in these models)
            self.model.train()
            enable_activation_checkpointing(self.model.lm)
        if use_fsdp(cfg.strategy, device):  # data parallelism as in the actor (plait/workers/actor.py)
            shard_model(self.model, self.model.lm._no_split_modules or [], cfg.model.fsdp_config, device, dtype)
        self.autocast = functools.partial(compute_autocast, device, dtype, is_sharded(self.model))
        self.optimizer, self.scheduler = make_optimizer(self.model.parameters(), cfg.optim)
        self.offload_optimizer = offloads_optimizer(cfg.model.fsdp_config, device)

    def compute_values(self, batch: RolloutBatch) -> torch.Tensor:
        with self.profiler.annotate("values"), torch.no_grad():
            [values] = data_parallel(batch, lambda share: [self._values(share)], "Critic.compute_values")
            return values * batch.response_mask

    def _values(self, batch: RolloutBatch) -> torch.Tensor:
        values = torch.zeros(batch.responses.shape)                           # [batch, resp_len]
        for rows, _ in even_micro_batches(self.forward_layout.split(batch), self.model):
            with self.autocast():
                values[rows] = self.model(batch.select(rows)).float().cpu()
        return values

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        with self.profiler.annotate("update_critic", scheduled=True):
            cfg, mini = self.cfg, self.cfg.ppo_mini_batch_size * self.n
            check_same_batch(batch, "Critic.update")
            sums, count = {"vf_loss": 0.0, "vf_clipfrac": 0.0, "vpred_mean": 0.0, "grad_norm": 0.0}, 0
            rows = torch.arange(len(batch))
            for _ in range(cfg.ppo_epochs):
                for start in range(0, len(batch), mini):
                    with self.profiler.mini_batch(count):  # a range, and a step of the torch profiler's schedule
                        stats = self._optimizer_step(batch.select(dp_share(rows[start:start + mini])))
                    for k in sums:
                        sums[k] += stats[k]
                    count += 1
            metrics = {f"critic/{k}": v / count for k, v in sums.items()}
            metrics["critic/lr"] = self.scheduler.get_last_lr()[0]  # the lr this step trained with
            self.scheduler.step()  # once per training step, as verl schedules
            return metrics

    def _optimizer_step(self, mini: RolloutBatch) -> dict[str, float]:
        cfg = self.cfg
        num_tokens, num_seqs = global_sum([mini.response_mask.sum().item(), float(len(mini))])
        norm = dict(num_tokens=max(num_tokens, 1.0), num_seqs=num_seqs)
        device = self.model.head.weight.device
        self.optimizer.zero_grad(set_to_none=True)
        stats = {"vf_loss": 0.0, "vf_clipfrac": 0.0, "vpred_mean": 0.0}
        for rows, padding in even_micro_batches(self.layout.split(mini), self.model):
            micro = mini.select(rows)
            with self.autocast():
                vpreds = self.model(micro)  # [micro, resp_len]
            if padding:  # FSDP2: match the busiest rank's collectives, add nothing to the gradient
                (vpreds.sum() * 0.0).backward()
                continue
            mask = micro.response_mask.to(device)
            loss, m = value_loss(vpreds, micro.values.to(device), micro.returns.to(device), mask,
                                 cliprange=cfg.cliprange_value, agg_mode=cfg.loss_agg_mode,
                                 loss_scale_factor=cfg.loss_scale_factor, **norm)
            loss.backward()
            share = mask.sum().item() / norm["num_tokens"]
            stats["vf_loss"] += loss.item()
            stats["vf_clipfrac"] += m["vf_clipfrac"] * share
            stats["vpred_mean"] += (vpreds.detach() * mask).sum().item() / norm["num_tokens"]
        all_reduce_grads(self.model)
        grad_norm = clip_grads(self.model, cfg.grad_clip)
        optimizer_step(self.optimizer, self.offload_optimizer)
        stats = dict(zip(stats, global_sum(list(stats.values()))))  # each rank summed its rows' parts
        stats["grad_norm"] = grad_norm
        return stats

    def save_checkpoint(self, path: str) -> None:
        """As the actor's: FSDP2 ranks write their shards (`sharded/`), else rank 0 the whole state."""
        sharded = is_sharded(self.model)
        if sharded:
            save_sharded(os.path.join(path, SHARDED_DIR), self.model, self.optimizer)
            state = {}
        else:
            model_state, optim_state = checkpoint_state(self.model, self.optimizer)
            state = {"model": model_state, "optimizer": optim_state}
        if dp_rank_size()[0] != 0:  # one writer, as in the actor
            return
        os.makedirs(path, exist_ok=True)
        torch.save({**state, "scheduler": self.scheduler.state_dict()}, os.path.join(path, "critic.pt"))

    def load_checkpoint(self, path: str) -> None:
        state = load_tensors(os.path.join(path, "critic.pt"))
        if os.path.isdir(os.path.join(path, SHARDED_DIR)):
            load_sharded(os.path.join(path, SHARDED_DIR), self.model, self.optimizer)
        else:
            load_checkpoint_state(self.model, self.optimizer, state["model"], state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
