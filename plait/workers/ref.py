"""The reference role: a frozen copy of the initial policy, giving log-probs for KL terms."""

from __future__ import annotations

import torch

from plait.config import RefConfig
from plait.models import load_causal_lm
from plait.types import RolloutBatch
from plait.workers.actor import response_forward
from plait.workers.logprobs import check_lm_head
from plait.workers.packing import MicroBatching, checked_remove_padding


class Ref:
    def __init__(self, model_path: str, cfg: RefConfig, temperature: float, profiler,
                 device: str = "cpu", dtype: torch.dtype = torch.float32, remove_padding: bool = False,
                 max_token_len: int | None = None):
        self.cfg, self.temperature, self.profiler = cfg, temperature, profiler
        self.model = load_causal_lm(model_path, dtype=dtype, device=device).eval()
        self.model.requires_grad_(False)
        check_lm_head(self.model, "actor_rollout_ref.model.path")
        self.layout = MicroBatching(cfg.log_prob_micro_batch_size_per_gpu, max_token_len,
                                    checked_remove_padding(self.model, remove_padding))

    def compute_ref_log_prob(self, batch: RolloutBatch) -> torch.Tensor:
        with self.profiler.annotate("ref"):
            logp, _ = response_forward(self.model, batch, self.temperature, self.layout, with_entropy=False)
            return logp  # [batch, resp_len]
