"""What the health checks cost a run: the token ledger and the alarms against the step time (issue 52; goal <= 0.5 %).

The demo's tiny run (its preset: 32 prompts x n=8, 8 response tokens; model size s, no warm start) for STEPS steps,
then, over that run's own files:
- the ledger (plait/trainers/metrics.py TokenLedger): its per-step work, `trained(batch)` + `step_metrics()`, on a
  batch of the run's shape (prompts x n rows, max_response_length columns, the run's mean response length sampled,
  a quarter of the groups at zero advantage), median of REPEATS; it runs in the trainer's step, once per step.
- the alarms (plait/profiler/analysis/alarms.py `alarms()`): evaluated over the run's timeline.jsonl, metrics.jsonl
  and summary.json settings, as the run's end does once (trainers/summary.py) and each live-report refresh does in
  its child process (over the spans so far: the run's whole files are the last refresh's, the largest), median of
  REPEATS.
Each divided by the median step time (steps 2..STEPS): the ledger per step; the alarms once per run, spread over its
steps (`alarms_share_per_run`), and per live refresh spread over report_freq steps (`alarms_share_per_refresh`,
report_freq=REPORT_FREQ; CPU of a nice-19 child, not the step's own thread). Neither has a switch of its own (the
ledger always counts; the end-of-run alarms always run; only the live report is off by default,
global_profiler.report_freq=0), so there is no on/off pair of runs: the work is timed directly.
Results: bench/results/health_cost.json with the load average around the run (bench/machine.py).

    PYTHONPATH=$PWD python bench/bench_health_cost.py [--steps 20] [--repeats 50] [--report-freq 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch

from machine import capability, measured, verdict


def timed(fn, repeats: int) -> float:
    """Median seconds of fn() over repeats."""
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--report-freq", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "health_cost.json"))
    args = parser.parse_args()
    from plait import driver
    from plait.config import load_config
    from plait.profiler.analysis.alarms import alarms
    from plait.profiler.timeline import read_timeline
    from plait.trainers.lifecycle import read_metrics
    from plait.trainers.metrics import TokenLedger
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, ["demo.model_size=s", "demo.warmstart_steps=0", "data.train_size=2048", "data.val_size=8",
                                 f"trainer.total_training_steps={args.steps}", "trainer.test_freq=-1",
                                 "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[]", "trainer.num_threads=1",
                                 f"trainer.default_local_dir={out}"])
        _, load = measured(driver.build(cfg, progress=False).run)
        records = read_metrics(os.path.join(out, "metrics.jsonl"))
        spans = read_timeline(os.path.join(out, "timeline.jsonl"))
        with open(os.path.join(out, "summary.json")) as f:
            settings = json.load(f).get("settings")
    step_s = statistics.median(r["timing_s/step"] for r in records[1:])
    prompts, n, width = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, cfg.data.max_response_length

    # the ledger on a batch of the run's shape: responses of the run's mean length, 1 group in 4 with no signal
    g = torch.Generator().manual_seed(0)
    mean_len = statistics.mean(r["response_length/mean"] for r in records)
    lengths = torch.binomial(torch.full((prompts * n,), float(width)), torch.full((prompts * n,), mean_len / width), g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    advantages = torch.randn(prompts * n, 1, generator=g).expand(-1, width).clone() * mask
    advantages[: (prompts // 4) * n] = 0.0
    batch = SimpleNamespace(response_mask=mask, loss_mask=None, advantages=advantages)
    ledger = TokenLedger()
    ledger_s = timed(lambda: (ledger.trained(batch), ledger.step_metrics()), args.repeats)

    # the alarms over the whole run: the run's end, and the last (largest) live refresh
    alarms_s = timed(lambda: alarms(spans, records, settings), args.repeats)
    found = [a.rule for a in alarms(spans, records, settings)]

    result = {"steps": args.steps, "workload": {"prompts": prompts, "n": n, "max_response_length": width},
              "step_median_s": round(step_s, 4), "spans": len(spans),
              "ledger_ms_per_step": round(ledger_s * 1e3, 4), "ledger_share": ledger_s / step_s,
              "alarms_ms_per_run": round(alarms_s * 1e3, 3), "alarms_share_per_run": alarms_s / (args.steps * step_s),
              "report_freq": args.report_freq, "alarms_share_per_refresh": alarms_s / (args.report_freq * step_s), "alarms_found": found,
              "goal_share": 0.005, "load": load, "machine": {"capability": capability(), **verdict([load])}}
    result["within_goal"] = result["ledger_share"] + result["alarms_share_per_run"] <= 0.005
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"health cost over {args.steps} demo steps (median step {step_s * 1e3:.1f} ms): ledger "
          f"{ledger_s * 1e3:.3f} ms/step = {100 * result['ledger_share']:.3f} %; alarms at the run's end "
          f"{alarms_s * 1e3:.2f} ms = {100 * result['alarms_share_per_run']:.3f} % of the run's steps; per live refresh "
          f"(the last) {100 * result['alarms_share_per_refresh']:.3f} % of {args.report_freq} steps "
          f"(goal <= 0.5 %: {'met' if result['within_goal'] else 'NOT met'}) -> {args.out}")


if __name__ == "__main__":
    main()
