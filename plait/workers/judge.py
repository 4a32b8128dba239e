"""The judge role: a causal-LM reward model (verl's generative reward model, GenRM), served for the reward function.

    reward worker processes ── POST /v1/chat/completions ──▶ ModelServer (plait/serving/serve.py), 127.0.0.1
      (the user's async reward function:      or /generate      its engine thread: rounds of the judge's
       reward_router_address=host:port,                         engine (hf or vLLM), each one recorded
       reward_model_tokenizer)

One replica per worker process of its role's pool: the driver's process (local backend), each rank of the train
pool (Ray; verl's colocate mode) or of the reward pool (reward.reward_model.enable_resource_pool; verl's
standalone mode). `addresses()` gathers every replica's host:port; the trainer hands the i-th response's reward
call the (i mod replicas)-th, so which replica judges a response does not depend on timing (verl#7027 routes
the same request to the same replica). Requests sample with the rollout block's defaults where they name none;
with `full_determinism` each is seeded (`seed` + replica rank, verl's per-request seed) and sampled alone, so
the same request gets the same verdict whatever else is queued (plait's engines are not batch-invariant).
`rounds(since)` gives every replica's engine rounds, for the judge's stage in the step (plait/trainers/lm.py).
On the reward pool (Ray), a replica's process that dies is restarted with the whole pool, once per step, and the
reward call re-issued with the new replicas' addresses (LMTrainer.score).

Left out: putting the engine to sleep between steps (free_cache_engine), tensor parallelism within a replica,
and replicas on nodes other than the driver's (the server listens on loopback, where the reward workers are).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.config import RolloutConfig
from plait.data.rewards import JudgeRolloutConfig
from plait.serving.serve import EngineRound, ModelServer
from plait.workers.parallel import dp_rank_size


class Judge:
    def __init__(self, model_path: str, cfg: JudgeRolloutConfig, profiler, device: str = "cpu",
                 dtype: torch.dtype = torch.float32):
        rank, _ = dp_rank_size()
        seed = cfg.seed + rank
        engine = RolloutConfig(name=cfg.name, seed=seed, max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.context,
                               gpu_memory_utilization=cfg.gpu_memory_utilization,
                               max_num_batched_tokens=cfg.max_num_batched_tokens, enforce_eager=cfg.enforce_eager,
                               enable_chunked_prefill=cfg.enable_chunked_prefill,
                               enable_prefix_caching=cfg.enable_prefix_caching, load_format=cfg.load_format,
                               free_cache_engine=False)
        defaults = {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k}
        self.server = ModelServer(model_path, engine, profiler, name=model_path, device=device, dtype=dtype,
                                  max_tokens=cfg.response_length, defaults=defaults,
                                  seed=seed if cfg.full_determinism else None, context=cfg.context,
                                  max_num_seqs=cfg.max_num_seqs, stage="judge")

    def addresses(self) -> list[str]:
        """Every replica's host:port, in rank order (each rank answers the same list)."""
        return _gathered(self.server.address)

    def up(self) -> None:
        """Nothing: that the call returns says the replica's process lives (on Ray a dead one's is an EngineDied)."""

    def rounds(self, since: float) -> list[EngineRound]:
        """Every replica's engine rounds that ended after `since` (wall clock)."""
        return [r for rounds in _gathered(self.server.rounds_since(since)) for r in rounds]

    def close(self) -> None:
        self.server.close()


def _gathered(value) -> list:
    """`value` from every data-parallel rank, in rank order ([value] without torch.distributed)."""
    _, world = dp_rank_size()
    if world == 1:
        return [value]
    out: list = [None] * world
    dist.all_gather_object(out, value)
    return out
