"""The cost of the weight-sync check and of the rollout engine's health checks, on the SmolLM2 preset.

The check (plait/workers/weight_sync.py) runs once per step, on the step's critical path, right after the
weight sync: a forward of the 24-token probe on the actor and on the engine. Each run times it itself
(`perf/weight_sync_check_s`), so its share of the step is measured directly, step by step; a paired run
with `trainer.check_weight_sync=false` gives the whole-step difference as a cross-check (noisier).
The health checks: on the hf engine nothing runs per step (a dead Ray worker is Ray's own report); on
vLLM every call into the engine core passes a guard (a lock it takes anyway, two clock reads, a flag)
and a watch thread sleeps on the core's process handle, waking once a second: the guard is timed here
in a loop (`--engine vllm`, in the vLLM environment) and multiplied by the engine calls of a step.

    python bench/bench_weight_sync_check.py [--config smollm2_gsm8k] [--steps 6] [--rounds 2]
                                            [--engine hf|vllm] [--out FILE] [-- key=value ...]
writes bench/results/weight_sync_check.json (or --out). Goal (issue 46): under 1 % of a step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from machine import capability, measured, verdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "weight_sync_check.json")


def train(config: str, run_dir: str, steps: int, check: bool, overrides: list[str]) -> list[dict]:
    """One run of `steps` steps (no validation, no checkpoints); its step records."""
    cmd = [sys.executable, "-m", "plait.cli", "train", "--config", config, "--no-progress",
           f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable", f"trainer.total_training_steps={steps}",
           "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[]",
           f"trainer.check_weight_sync={str(check).lower()}", *overrides]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r.get("step", 0) >= 1]


def guard_seconds(calls: int = 200_000) -> float | None:
    """Seconds one pass through VLLMEngine._call costs (with no engine behind it), or None without vLLM."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        return None
    import threading
    from types import SimpleNamespace

    from plait.workers.vllm_engine import VLLMEngine
    fake = SimpleNamespace(_dead=None, _io=threading.Lock(), _busy_since=None)
    start = time.perf_counter()
    for _ in range(calls):
        with VLLMEngine._call(fake):
            pass
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2_gsm8k")
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first is not counted (warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs, check on and off, alternating order")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    overrides = [f"actor_rollout_ref.rollout.name={args.engine}", *args.overrides]
    loads, runs = [], {"on": [], "off": []}
    for r in range(args.rounds):
        for check in ((True, False) if r % 2 == 0 else (False, True)):
            with tempfile.TemporaryDirectory(prefix="plait-bench-sync-") as run_dir:
                records, load = measured(train, args.config, run_dir, args.steps, check, overrides)
            loads.append(load)
            runs["on" if check else "off"].append(records[1:])
            print(f"round {r + 1} check={'on' if check else 'off'}: s/step "
                  f"{statistics.median(x['perf/time_per_step'] for x in records[1:]):.3f}", flush=True)
    on = [x for run in runs["on"] for x in run]
    off = [x for run in runs["off"] for x in run]
    share = statistics.median(x["perf/weight_sync_check_s"] / x["perf/time_per_step"] for x in on)
    step_on, step_off = (statistics.median(x["perf/time_per_step"] for x in rs) for rs in (on, off))
    guard = guard_seconds() if args.engine == "vllm" else None
    calls = statistics.median(x.get("response_length/max", 0) for x in on) + 2  # decode steps + probe + sync per step
    result = {
        "config": args.config, "engine": args.engine, "steps_per_run": args.steps, "rounds": args.rounds,
        "overrides": args.overrides,
        "check_s_median": statistics.median(x["perf/weight_sync_check_s"] for x in on),
        "check_share_of_step_median": share,
        "step_s_median": {"check_on": step_on, "check_off": step_off},
        "whole_step_difference": step_on / step_off - 1,
        "health_guard_s_per_call": guard,
        "health_share_of_step": None if guard is None else guard * calls / step_on,
        "goal": "under 1 % of a step", "capability": capability(), "loads": loads, **verdict(loads),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k not in ("capability", "loads")}, indent=2))


if __name__ == "__main__":
    main()
