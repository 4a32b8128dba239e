"""A judge's throughput (a causal LM as the reward model, plait/workers/judge.py) through the path a trainer uses:
the judge served by ModelServer (plait's server and engine), a reward function in the reward worker processes
asking it with SGLang's /generate (FAPO's request), scored by the naive manager with the judge's address.

Per config (reward.num_workers: the judge's requests in flight; full_determinism: every request seeded, so each
is an engine call of its own) a warm-up batch (workers start, the tokenizer loads), then --runs timed batches of
--batch responses: judged responses/s, engine rounds per batch and requests per round (median), with the
load-average record (bench/machine.py: a busy run marks the result `valid: false`). It tests what the verdict's
judge rule assumes: more workers make fuller rounds; seeded requests cost a round each.

    python bench/bench_judge.py [--model tiny|smollm2-135m-instruct|FOLDER] [--workers 1 2 4 8] [--batch 32]
        [--tokens 32] [--runs 3] [--out bench/results/judge.json]
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

from plait.config import RolloutConfig  # noqa: E402
from plait.data.reward_pool import RewardPool, RewardSpec  # noqa: E402
from plait.data.rewards import ScoreRequest, guard_reward, naive_manager  # noqa: E402
from plait.profiler.config import GlobalProfilerConfig, RoleProfilerConfig  # noqa: E402
from plait.profiler.session import ProfilerSession  # noqa: E402
from plait.serving.serve import ModelServer  # noqa: E402

REWARD = '''
import httpx

async def judge(data_source, solution_str, ground_truth, extra_info, reward_router_address, reward_model_tokenizer,
                tokens=32):
    ids = reward_model_tokenizer.apply_chat_template([{"role": "user", "content": "Is this right? " + solution_str}],
                                                     tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    async with httpx.AsyncClient(timeout=None) as client:
        r = await client.post(f"http://{reward_router_address}/generate",
                              json={"input_ids": ids, "sampling_params": {"max_new_tokens": tokens}})
    return float(len(r.json()["output_ids"]))
'''


def judge_folder(model: str, tmp: str) -> str:
    from plait.builtin_models import builtin_model
    from plait.models import create_tiny_model
    if model == "tiny":
        return create_tiny_model(os.path.join(tmp, "judge"), size="xs", seed=1)
    built = builtin_model(model)
    return built.build() if built is not None else model


def run(folder: str, reward: str, workers: int, seeded: bool, args) -> dict:
    profiler = ProfilerSession(GlobalProfilerConfig(), {"reward_model": RoleProfilerConfig()}, rank=0).for_role("reward_model")
    server = ModelServer(folder, RolloutConfig(name="hf"), profiler, name="judge", max_tokens=args.tokens,
                         seed=42 if seeded else None, context=2048, stage="judge")
    pool = RewardPool(RewardSpec(reward, "judge", {"tokens": args.tokens}, folder), "judge", workers, timeout=600)
    fn = guard_reward(pool, "judge")
    n = args.batch
    request = ScoreRequest(["bench"] * n, [f"{i} + {i} = {2 * i}" for i in range(n)], ["x"] * n, [{}] * n, [1] * n,
                           [server.address])
    try:
        naive_manager(fn, request)  # warm-up: workers start and load the judge's tokenizer
        rates, rounds = [], []
        for _ in range(args.runs):
            start = time.perf_counter()
            wall = time.time()
            naive_manager(fn, request)
            rates.append(n / (time.perf_counter() - start))
            rounds.append(server.rounds_since(wall))
    finally:
        pool.close()
        server.close()
    per_round = [sum(r.requests for r in rs) / max(len(rs), 1) for rs in rounds]
    return {"num_workers": workers, "full_determinism": seeded, "responses_per_s": round(statistics.median(rates), 2),
            "rounds_per_batch": statistics.median(len(rs) for rs in rounds),
            "requests_per_round": round(statistics.median(per_round), 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="bench/results/judge.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        reward = os.path.join(tmp, "judge_reward.py")
        Path(reward).write_text(REWARD)
        folder = judge_folder(args.model, tmp)
        configs = []
        for seeded in (False, True):
            for workers in args.workers:
                row, load = measured(run, folder, reward, workers, seeded, args, threads=2)
                configs.append({**row, "load": load})
                print(json.dumps(configs[-1]), flush=True)
    result = {"bench": "judge", "model": args.model, "batch": args.batch, "tokens": args.tokens, "runs": args.runs,
              "cores": os.cpu_count(), "python": platform.python_version(), "configs": configs}
    result.update(verdict([row["load"] for row in configs]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
