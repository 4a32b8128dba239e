"""Variable-length training: packed sequences + token-balanced micro-batches vs the padded path.

One actor update (plait.workers.actor.Actor.update: forward, backward, optimizer step) on a batch
whose response lengths follow a long-tailed (log-normal) distribution, as RL responses do, on CPU
with 1 thread. Two layouts of the same work:

- padded: fixed micro-batches of --micro rows, each padded to the batch's width;
- packed: use_remove_padding (real tokens only, one packed row per micro-batch) and
  use_dynamic_bsz (micro-batches by a real-token budget, --max-tokens).

Both compute the same update (tests/workers/test_packing.py checks that). The layouts alternate,
a warm-up then --runs timed updates each; reported: median trained tokens/s (real prompt +
response tokens over update time), the ratio, the padding ratio, plait's MFU of each, and the
load average around each run (bench/machine.py; a busy run marks the result `valid: false`).

    python bench/bench_varlen.py [--size m] [--rows 64] [--runs 3] [--out bench/results/varlen.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from llama_model import create_model
from machine import capability, measured, verdict
from plait.config import ActorConfig, OptimConfig
from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig
from plait.types import RolloutBatch
from plait.workers.actor import Actor
from plait.allocator import keep_freed_memory
from plait.workers.packing import seqlen_metrics


def long_tailed_batch(rows: int, max_prompt: int, max_response: int, median_response: int, seed: int) -> RolloutBatch:
    """Prompts of 8..max_prompt tokens (left-padded), responses log-normal around median_response
    (sigma 1), clipped to 1..max_response (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(8, max_prompt + 1, (rows,), generator=g)
    r_len = (torch.randn(rows, generator=g) + torch.log(torch.tensor(float(median_response)))).exp()
    r_len = r_len.round().long().clamp(1, max_response)
    width = int(r_len.max())
    prompt_mask = (torch.arange(max_prompt) >= max_prompt - p_len[:, None]).long()   # [rows, max_prompt]
    response_mask = (torch.arange(width) < r_len[:, None]).float()                    # [rows, width]
    return RolloutBatch(
        prompts=torch.randint(4, 200, (rows, max_prompt), generator=g) * prompt_mask, prompt_mask=prompt_mask,
        responses=torch.randint(4, 200, (rows, width), generator=g) * response_mask.long(),
        response_mask=response_mask, rollout_logprobs=-torch.rand(rows, width, generator=g) * response_mask - 5.0,
        group_ids=torch.arange(rows) // 8, versions=torch.zeros(rows, dtype=torch.long), data_sources=["t"] * rows,
        ground_truths=[""] * rows, extra_infos=[{}] * rows, stop_reasons=["eos"] * rows,
        advantages=torch.randn(rows, width, generator=g) * response_mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="m", help="s, m (tiny Qwen2) or l (46M Llama)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=32)
    ap.add_argument("--max-response", type=int, default=256)
    ap.add_argument("--median-response", type=int, default=32)
    ap.add_argument("--micro", type=int, default=8, help="padded path: rows per micro-batch")
    ap.add_argument("--max-tokens", type=int, default=2048, help="packed path: real tokens per micro-batch")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the actor's compute dtype (float32 weights; MFU against this dtype's matmul peak)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "varlen.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as `plait train` does on CPU
    batch = long_tailed_batch(args.rows, args.max_prompt, args.max_response, args.median_response, seed=0)
    real_tokens = int(batch.attention_mask.sum())
    cfg = ActorConfig(optim=OptimConfig(lr=1e-6), ppo_mini_batch_size=args.rows, ppo_micro_batch_size_per_gpu=args.micro)
    session = ProfilerSession(GlobalProfilerConfig(), {"actor": RoleProfilerConfig()}, rank=0)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_model(os.path.join(tmp, args.size), args.size, seed=0)
        dtype = getattr(torch, args.dtype)
        actors = {"padded": Actor(model_dir, cfg, 1, 1.0, session.for_role("actor"), dtype=dtype),
                  "packed": Actor(model_dir, cfg, 1, 1.0, session.for_role("actor"), remove_padding=True,
                                  max_token_len=args.max_tokens, dtype=dtype)}
    runs = {name: [] for name in actors}
    for i in range(args.runs + 1):  # run 0 warms up
        for name, actor in actors.items():
            start = time.perf_counter()
            metrics, load = measured(actor.update, batch)
            seconds = time.perf_counter() - start
            if i:
                runs[name].append({"seconds": seconds, "tokens_per_s": real_tokens / seconds,
                                   "mfu": metrics["perf/mfu/actor"], "load": load})
            print(f"run {i} {name:>6}: {real_tokens / seconds:8.0f} trained tok/s  {seconds:.2f} s  "
                  f"mfu {metrics['perf/mfu/actor']:.1%}  load {load['load_before']}", flush=True)
    summary = {name: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                      "update_s": statistics.median(r["seconds"] for r in rs),
                      "mfu": statistics.median(r["mfu"] for r in rs)} for name, rs in runs.items()}
    summary["ratio"] = summary["packed"]["tokens_per_s"] / summary["padded"]["tokens_per_s"]
    result = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "platform": platform.platform(), "torch": torch.__version__, "cpus": os.cpu_count(),
              "dtype": args.dtype, "capability": capability(),
              "batch": {**seqlen_metrics(batch.attention_mask),
                        "response_length_mean": batch.response_mask.sum(-1).mean().item(),
                        "response_length_max": batch.response_mask.sum(-1).max().item()},
              "summary": summary, "runs": runs,
              **verdict([r["load"] for rs in runs.values() for r in rs])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.size}: packed + dynamic batching {summary['packed']['tokens_per_s']:.0f} vs padded "
          f"{summary['padded']['tokens_per_s']:.0f} trained tokens/s: x{summary['ratio']:.2f} "
          f"(padding ratio {result['batch']['global_seqlen/padding_ratio']:.2f}); wrote {args.out}")


if __name__ == "__main__":
    main()
