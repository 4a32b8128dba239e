"""Where one actor update's time goes: SmolLM2-135M-Instruct, packed rows, 1 thread, torch.profiler.

One plait.workers.actor.Actor.update (forward, backward, AdamW step) on 16 rows shaped like the
GSM8K preset's (prompts 8-120 tokens, log-normal responses around 90 of at most 128 tokens; the
token budget puts them in one micro-batch), after two warm-up updates (the optimizer's state and
the heap reach their size; freed memory is kept, as `plait train` does on CPU:
plait/allocator.py). The profiler's self CPU time per op is summed into: matmuls
(aten::mm/addmm/bmm, split into the LM head's and the body's by the vocabulary in their shapes),
attention (the SDPA kernels), the casts (aten::copy_/_to_copy), the optimizer (AdamW, the gradient
norm) and everything else (norms, activations, rotary, the log-softmax's passes, Python between
kernels). The MFU is the update's model FLOPs (plait/workers/flops.py) over its time and the
dtype's measured matmul peak (bench/machine.py).

    python bench/profile_update.py [--dtype bfloat16] [--out bench/results/update_profile_bf16.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import profile

from bench_varlen import long_tailed_batch
from machine import capability, measured, verdict
from plait.config import ActorConfig, OptimConfig
from plait.models import smollm2_dir
from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig
from plait.workers.actor import Actor
from plait.allocator import keep_freed_memory


def category(name: str, shapes: list, vocab: int) -> str:
    if name in ("aten::mm", "aten::addmm", "aten::bmm"):
        return "matmul_head" if any(vocab in s for s in shapes if isinstance(s, list)) else "matmul_body"
    if "scaled_dot_product" in name:
        return "attention"
    if name in ("aten::copy_", "aten::_to_copy"):
        return "casts_copies"
    if "adam" in name or name == "aten::linalg_vector_norm":
        return "optimizer"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "update_profile_bf16.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    batch = long_tailed_batch(16, 120, 128, 90, seed=0)
    cfg = ActorConfig(optim=OptimConfig(lr=1e-6), ppo_mini_batch_size=16, ppo_micro_batch_size_per_gpu=4)
    session = ProfilerSession(GlobalProfilerConfig(), {"actor": RoleProfilerConfig()}, rank=0)
    actor = Actor(str(smollm2_dir()), cfg, 1, 1.0, session.for_role("actor"), remove_padding=True,
                  max_token_len=4096, dtype=getattr(torch, args.dtype))
    vocab = actor.model.config.vocab_size
    for _ in range(2):  # warm-up
        actor.update(batch)
    start = time.perf_counter()
    metrics, load = measured(actor.update, batch)
    seconds = time.perf_counter() - start
    with profile(record_shapes=True) as prof:
        _, profiled_load = measured(actor.update, batch)
    shares = defaultdict(float)
    for e in prof.key_averages(group_by_input_shape=True):
        shares[category(e.key, e.input_shapes, vocab)] += e.self_cpu_time_total / 1e6
    total = sum(shares.values())
    result = {"dtype": args.dtype, "capability": capability(), "threads": 1,
              "tokens": int(batch.attention_mask.sum()), "response_tokens": int(batch.response_mask.sum()),
              "update_s": round(seconds, 2), "mfu": round(metrics["perf/mfu/actor"], 3),
              "profiled_s": round(total, 2),
              "share": {k: round(v / total, 3) for k, v in sorted(shares.items(), key=lambda kv: -kv[1])},
              "load": [load, profiled_load], **verdict([load, profiled_load])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
