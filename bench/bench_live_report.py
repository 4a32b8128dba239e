"""The cost of the live report (global_profiler.report_freq) to the steps of the run it reports on.

    python bench/bench_live_report.py [--size s] [--steps 30] [--freq 5] [--rounds 3] [--out bench/results/live_report.json]

Paired rounds of the same sync GRPO run (demo task, `--size` model, no warm start, local backend), one
without a live report and one refreshing it every `--freq` steps (a child process at nice 19 writing
report/index.html and verdict.json), in alternating order. A round's cost is the ratio of the two runs'
median step time (perf/time_per_step, steps 2..last); the result is the median over rounds, and the
no-report vs no-report noise floor is measured the same way (`noise`). Goal: <= 0.5 % of a step.
On a 2-core machine the child competes for the cores; nice 19 makes it yield.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile

import torch

from machine import capability, measured, verdict

RUN = ["demo.warmstart_steps=0", "data.train_size=512", "data.val_size=4", "data.train_batch_size=8",
       "data.max_response_length=16", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
       "critic.ppo_mini_batch_size=8", "trainer.test_freq=-1",
       "trainer.val_before_train=false", "trainer.logger=[]", "trainer.save_freq=-1"]


def once(size: str, steps: int, freq: int, out_dir: str) -> dict:
    from plait import driver
    from plait.config import load_config
    from plait.trainers.lifecycle import read_metrics
    cfg = load_config(None, [*RUN, f"demo.model_size={size}", f"trainer.total_training_steps={steps}",
                             f"global_profiler.report_freq={freq}", f"trainer.default_local_dir={out_dir}"])
    lifecycle = driver.build(cfg, progress=False)
    _, load = measured(lifecycle.run, threads=2)
    records = read_metrics(os.path.join(out_dir, "metrics.jsonl"))[1:]
    return {"step_s": statistics.median(r["perf/time_per_step"] for r in records), "refreshes": lifecycle.live.started,
            "skipped": lifecycle.live.skipped, **load}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="s")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--freq", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench/results/live_report.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {"off": [], "off_again": [], "live": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = ["off", "live", "off_again"] if i % 2 == 0 else ["live", "off_again", "off"]
            for name in order:
                runs[name].append(once(args.size, args.steps, args.freq if name == "live" else 0,
                                       os.path.join(tmp, f"{name}-{i}")))
                print(name, runs[name][-1], flush=True)
    ratio = lambda a, b: statistics.median(x["step_s"] / y["step_s"] for x, y in zip(runs[a], runs[b]))  # noqa: E731
    result = {"args": vars(args), "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                              "torch": torch.__version__, **capability()},
              **verdict([r for rs in runs.values() for r in rs]),
              "live_overhead_pct": 100 * (ratio("live", "off") - 1), "noise_pct": 100 * (ratio("off_again", "off") - 1),
              "goal_pct": 0.5, "runs": runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("live_overhead_pct", "noise_pct", "valid")}, indent=1))


if __name__ == "__main__":
    main()
