"""The gateway's cost: per request, and on a real agentic training run.

overhead: the demo's tiny model (xs) served by the gateway's server (plait serve's loop, a 1 ms batching
window); N sequential one-token chat requests through the `openai` SDK, against the same prompt ids put on
the engine queue directly in-process. The difference of the medians is what HTTP, the body checks, the
chat template and answer parsing add to a call.

preset: the calculator task on SmolLM2-135M-Instruct, trained K steps by the in-process tool loop
(smollm2_gsm8k_tools: tool_agent runs the calculator) and K steps through the gateway (the same problems
and system line, agent_name=openai_agent, the shipped ReAct calculator agent written against the openai
SDK), from the same weights (the tools preset's warm start, made once and shared), alternating order per
round. Headline: trained (sampled) response tokens per second of step time, steps 2..K (step 1 warms up).

    python bench/bench_gateway.py [--part overhead,preset] [--requests 200] [--steps 6] [--rounds 1]
                                  [--out bench/results/gateway.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from machine import capability, measured, verdict

REPO = Path(__file__).resolve().parents[1]


def overhead(requests: int, work: Path) -> dict:
    import openai

    from plait.agents.runner import EventLoopThread, Scheduler, run_round
    from plait.models import create_tiny_model, load_tokenizer
    from plait.profiler.config import GlobalProfilerConfig, RoleProfilerConfig
    from plait.profiler.session import ProfilerSession
    from plait.serving.gateway import Gateway
    from plait.serving.server import Server
    from plait.workers.rollout import Rollout
    path = create_tiny_model(work / "tiny", size="xs", seed=0)
    tokenizer = load_tokenizer(path)
    profiler = ProfilerSession(GlobalProfilerConfig(), {"rollout": RoleProfilerConfig()}, rank=0).for_role("rollout")
    rollout = Rollout(path, 16, tokenizer, profiler)
    queue, thread, stop = Scheduler(16), EventLoopThread(), threading.Event()
    gateway = Gateway(tokenizer, "qwen2", "hermes", rollout.eos_ids, "tiny", generate=queue.generate)
    server = Server(gateway, thread.loop)
    engine_round = rollout._round(seed=0)

    def drive():
        while not stop.is_set():
            batch = queue.take(lambda: 1 << 30, 0.001, stop.is_set)
            if batch:
                run_round(batch, engine_round, 0)
    threading.Thread(target=drive, daemon=True).start()
    messages = [{"role": "user", "content": "12+7="}]
    ids = gateway.ct.render(messages, True)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "do_sample": False, "max_tokens": 1}

    def direct() -> float:
        start = time.perf_counter()
        asyncio.run_coroutine_threadsafe(queue.generate(prompt_ids=ids, sampling_params=sampling), thread.loop).result()
        return time.perf_counter() - start

    def http() -> float:
        start = time.perf_counter()
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, temperature=0)
        return time.perf_counter() - start
    for fn in (direct, http):  # warm up: the first calls import and allocate
        for _ in range(10):
            fn()
    times = {"direct": [], "http": []}
    for _ in range(requests):  # interleaved, so both see the same machine
        times["direct"].append(direct())
        times["http"].append(http())
    stop.set()
    queue.notify()
    server.close()
    thread.close()
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    return {"requests": requests, "direct_ms_median": round(med["direct"], 3), "http_ms_median": round(med["http"], 3),
            "overhead_ms_per_request": round(med["http"] - med["direct"], 3),
            "http_ms_p90": round(sorted(times["http"])[int(0.9 * requests)] * 1000, 3)}


PRESET = ["data.train_size=256", "data.val_size=8", "trainer.test_freq=-1", "trainer.val_before_train=false",
          "trainer.logger=[console,file]", "warmstart.steps=0"]


def preset(steps: int, rounds: int, work: Path) -> tuple[dict, list[dict]]:
    from plait.agents.warmstart import transcript_warmstart
    from plait.models import smollm2_dir
    model = transcript_warmstart(smollm2_dir(), "gsm8k_synthetic_tools", work / "warm", steps=30, batch_size=8, lr=5e-5)
    sides = {"in_process": ["smollm2_gsm8k_tools"], "gateway": ["smollm2_gsm8k_gateway"]}
    runs, loads = [], []
    for r in range(rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        result = {}
        for name in order:
            config, *extra = sides[name]
            result[name], load = measured(train, work, f"{name}_{r}", config, model, steps, extra, threads=2)
            result[name]["load"] = load
            loads.append(load)
        result["ratio_gateway_vs_in_process"] = round(result["gateway"]["trained_tokens_per_s"]
                                                      / result["in_process"]["trained_tokens_per_s"], 3)
        runs.append(result)
    return {"rounds": runs, "ratio_median": statistics.median(r["ratio_gateway_vs_in_process"] for r in runs)}, loads


def train(work: Path, name: str, config: str, model: str, steps: int, extra: list[str]) -> dict:
    """`plait train --config CONFIG` for `steps` steps from `model`; its trained tokens/s over steps 2..steps."""
    out = work / name
    cmd = [sys.executable, "-m", "plait.cli", "train", "--config", config, "--no-progress", *PRESET,
           f"actor_rollout_ref.model.path={model}", f"trainer.total_training_steps={steps}",
           f"trainer.default_local_dir={out}", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    timed = [r for r in records if "timing_s/step" in r][1:]  # step 1 warms up
    tokens = sum(r["timing_s/gen"] * 1000 / r["timing_per_token_ms/gen"] for r in timed)
    seconds = sum(r["timing_s/step"] for r in timed)
    return {"trained_tokens_per_s": round(tokens / seconds, 2),
            "step_s_median": round(statistics.median(r["timing_s/step"] for r in timed), 2),
            "gen_s_median": round(statistics.median(r["timing_s/gen"] for r in timed), 2),
            "turns_mean": round(statistics.mean(r.get("num_turns/mean", 0) for r in timed), 2),
            "score_mean": round(statistics.mean(r.get("critic/score/mean", 0) for r in timed), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", default="overhead,preset")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "gateway.json"))
    args = parser.parse_args()
    parts, loads, out = args.part.split(","), [], {}
    with tempfile.TemporaryDirectory(prefix="plait-bench-gateway-") as tmp:
        if "overhead" in parts:
            out["overhead"], load = measured(overhead, args.requests, Path(tmp), threads=2)
            out["overhead"]["load"] = load
            loads.append(load)
            print("overhead:", json.dumps(out["overhead"]), flush=True)
        if "preset" in parts:
            out["preset"], preset_loads = preset(args.steps, args.rounds, Path(tmp))
            loads += preset_loads
            print("preset:", json.dumps(out["preset"]), flush=True)
    out.update(verdict(loads), host=platform.node(), capability=capability(), steps=args.steps,
               commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=REPO).stdout.strip())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
