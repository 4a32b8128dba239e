"""The reference role: a frozen copy of the initial policy, giving log-probs for KL terms.

Data-parallel like the actor (plait/workers/parallel.py): each rank computes its share of the rows,
sharded with FSDP2 when `ref.strategy` (null: the actor's) asks for it."""

from __future__ import annotations

import torch

from plait.config import RefConfig
from plait.models import load_causal_lm
from plait.types import RolloutBatch
from plait.workers.actor import response_forward
from plait.workers.logprobs import check_lm_head
from plait.workers.packing import MicroBatching, checked_remove_padding
from plait.workers.parallel import EvenMicroBatching, data_parallel, is_sharded, shard_model, use_fsdp
from plait.workers.precision import cast_buffers, compute_autocast, role_dtype


class Ref:
    def __init__(self, model_path: str, cfg: RefConfig, temperature: float, profiler,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, remove_padding: bool = False,
                 max_token_len: int | None = None):
        self.cfg, self.temperature, self.profiler, self.device = cfg, temperature, profiler, device
        # float32 weights computing in the compute dtype, as the actor: at step 0 both give the same log-probs
        self.model = load_causal_lm(model_path, dtype=torch.float32, device=device).eval()
        cast_buffers(self.model, cfg.fsdp_config.mixed_precision)
        self.dtype = role_dtype(cfg.fsdp_config.mixed_precision, dtype)
        self.model.requires_grad_(False)
        check_lm_head(self.model, "actor_rollout_ref.model.path")
        if use_fsdp(cfg.strategy or "fsdp", device):
            shard_model(self.model, self.model._no_split_modules or [], cfg.fsdp_config, device, self.dtype)
        self.layout = EvenMicroBatching(MicroBatching(cfg.log_prob_micro_batch_size_per_gpu, max_token_len,
                                                      checked_remove_padding(self.model, remove_padding)), self.model)

    def compute_ref_log_prob(self, batch: RolloutBatch) -> torch.Tensor:
        with self.profiler.annotate("ref"), compute_autocast(self.device, self.dtype, is_sharded(self.model)):
            [logp] = data_parallel(batch, lambda share: response_forward(self.model, share, self.temperature, self.layout,
                                                                         with_entropy=False)[:1], "Ref.compute_ref_log_prob")
            return logp  # [batch, resp_len]
