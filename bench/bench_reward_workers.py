"""Scoring throughput of a slow reward with 1 and N reward worker processes (`reward.num_workers`).

Two slow rewards, each scored through the path a trainer uses (guard_reward over a RewardPool,
under the naive manager), and, for reference, in the trainer's own process (num_workers=0):
- `cpu`: a pure-Python loop of about --cpu-ms per call (a verifier that parses and checks);
  workers scale with free cores, the in-process path cannot (the GIL);
- `wait`: a --wait-ms sleep per call (a reward that waits on a sandbox or a service);
  workers scale past the cores.
Each config: a warm-up batch (workers start), then --runs timed batches of --batch responses;
reported as the median responses/s, with the load-average record (bench/machine.py: a busy run
marks the result `valid: false`).

    python bench/bench_reward_workers.py [--workers 1 2 4 8] [--batch 64] [--runs 3]
        [--cpu-ms 20] [--wait-ms 20] [--out bench/results/reward_workers.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import measured, verdict  # noqa: E402

from plait.data.reward_pool import RewardPool, RewardSpec  # noqa: E402
from plait.data.rewards import ScoreRequest, guard_reward, load_custom_reward, naive_manager  # noqa: E402

REWARDS = '''
import time

def cpu(data_source, solution_str, ground_truth, extra_info=None, ms=20):
    end = time.process_time() + ms / 1000
    n = 0
    while time.process_time() < end:
        n += 1
    return float(solution_str == ground_truth)

def wait(data_source, solution_str, ground_truth, extra_info=None, ms=20):
    time.sleep(ms / 1000)
    return float(solution_str == ground_truth)
'''


def scorer(path: str, name: str, ms: float, workers: int):
    kwargs = {"ms": ms}
    if workers == 0:
        return guard_reward(load_custom_reward(path, name, kwargs), name), None
    pool = RewardPool(RewardSpec(path, name, kwargs), name, workers, timeout=60, memory_limit_mb=4096)
    return guard_reward(pool, name), pool


def throughput(fn, batch: int, runs: int) -> list[float]:
    request = ScoreRequest(["bench"] * batch, ["a"] * batch, ["a"] * batch, [None] * batch, [1] * batch)
    naive_manager(fn, request)  # warm-up: workers start
    rates = []
    for _ in range(runs):
        start = time.perf_counter()
        naive_manager(fn, request)
        rates.append(batch / (time.perf_counter() - start))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cpu-ms", type=float, default=20.0)
    parser.add_argument("--wait-ms", type=float, default=20.0)
    parser.add_argument("--out", default="bench/results/reward_workers.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "slow_rewards.py")
        Path(path).write_text(REWARDS)
        configs = []
        for name, ms in (("cpu", args.cpu_ms), ("wait", args.wait_ms)):
            for workers in [0, *args.workers]:
                fn, pool = scorer(path, name, ms, workers)
                rates, load = measured(throughput, fn, args.batch, args.runs, threads=max(workers, 1))
                if pool is not None:
                    pool.close()
                row = {"reward": name, "ms_per_call": ms, "num_workers": workers,
                       "responses_per_s": round(statistics.median(rates), 1),
                       "ideal_responses_per_s": round(1000 / ms * max(workers, 1), 1), "load": load}
                configs.append(row)
                print(json.dumps(row), flush=True)
    result = {"bench": "reward_workers", "batch": args.batch, "runs": args.runs, "cores": os.cpu_count(),
              "python": platform.python_version(), "configs": configs}
    result.update(verdict([row["load"] for row in configs]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
