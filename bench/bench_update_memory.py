"""Peak memory, time and MFU of one actor update (Actor.update) on SmolLM2-135M-Instruct, for the
plait checkout(s) given: before/after comparisons of a change in one command.

Each checkout runs in its own process (PYTHONPATH=<checkout>), one thread, on the same synthetic
batch: 16 rows of 160 prompt + 32 response tokens (the bench_vs_trl real-model workload), one
optimizer step, entropy computed as in training. Reported per checkout: the process's peak RSS
before the update (model, optimizer) and after it, the update's seconds and perf/mfu/actor.
perf/mfu/actor is against the matmul peak each process measures once, which varies from process
to process; `mfu_actor_common` rescales it to one peak the parent measures (best of three
1-thread measurements, before and after the workers), so checkouts compare on one denominator.

    PLAIT_CACHE=/tmp/plaitcache python bench/bench_update_memory.py --trees <checkout before>,. [--out ...]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path


def worker(remove_padding: bool) -> dict:
    import torch
    torch.set_num_threads(1)
    from plait.config import ActorConfig, OptimConfig
    from plait.models import smollm2_dir
    from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig
    from plait.types import RolloutBatch
    from plait.workers.actor import Actor

    rows, prompt, resp = 16, 160, 32
    g = torch.Generator().manual_seed(0)
    profiler = ProfilerSession(GlobalProfilerConfig(), {"actor": RoleProfilerConfig()}, rank=0).for_role("actor")
    cfg = ActorConfig(optim=OptimConfig(lr=1e-6), ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=rows)
    actor = Actor(smollm2_dir(), cfg, 1, 1.0, profiler, remove_padding=remove_padding)
    mask = torch.ones(rows, resp)
    batch = RolloutBatch(
        prompts=torch.randint(10, 40000, (rows, prompt), generator=g), prompt_mask=torch.ones(rows, prompt, dtype=torch.long),
        responses=torch.randint(10, 40000, (rows, resp), generator=g), response_mask=mask,
        rollout_logprobs=-torch.rand(rows, resp, generator=g) - 1, group_ids=torch.arange(rows) // 4,
        versions=torch.zeros(rows, dtype=torch.long), data_sources=["t"] * rows, ground_truths=[""] * rows,
        extra_infos=[{}] * rows, stop_reasons=["length"] * rows, advantages=torch.randn(rows, resp, generator=g))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    import time
    start = time.perf_counter()
    metrics = actor.update(batch)
    from plait.workers.flops import device_peak_flops
    own_peak = device_peak_flops("cpu", torch.float32)  # the cached value perf/mfu/actor used
    return {"update_s": round(time.perf_counter() - start, 2), "mfu_actor": round(metrics["perf/mfu/actor"], 4),
            "own_peak_gflops": round(own_peak / 1e9, 2),
            "peak_rss_gb_before_update": round(before, 3),
            "peak_rss_gb_after_update": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}


def common_peak() -> float:
    """This machine's 1-thread float32 matmul peak, best of three fresh measurements."""
    import torch
    from plait.workers.flops import device_peak_flops
    torch.set_num_threads(1)
    return max(device_peak_flops.__wrapped__("cpu", torch.float32) for _ in range(3))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default=".", help="plait checkouts, comma-separated")
    ap.add_argument("--remove-padding", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "update_memory.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.remove_padding)))
        return
    result = {"load_avg_before": [round(x, 2) for x in os.getloadavg()], "remove_padding": args.remove_padding,
              "runs": {}}
    peaks = [common_peak()]
    for tree in args.trees.split(","):
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        cmd = [sys.executable, __file__, "--worker"] + (["--remove-padding"] if args.remove_padding else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{tree}: worker failed:\n{proc.stderr[-3000:]}")
        commit = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        name = commit.stdout.strip() or os.path.basename(os.path.abspath(tree))  # no machine path in the file
        result["runs"][name] = json.loads(proc.stdout.strip().splitlines()[-1])
        print(name, result["runs"][name], flush=True)
    peaks.append(common_peak())
    peak = max(peaks)
    result["common_peak_gflops"] = [round(p / 1e9, 2) for p in peaks]
    for run in result["runs"].values():
        run["mfu_actor_common"] = round(run["mfu_actor"] * run["own_peak_gflops"] * 1e9 / peak, 4)
        print(run, flush=True)
    result["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
