"""The per-step cost of the per-rank spans every Ray training rank now records (profiler/timeline.py
RankSpans), against the step they ride on.

    python bench/bench_rank_spans.py [--size s] [--steps 8] [--world 2] [--out bench/results/rank_spans.json]

1. a real sync GRPO run on the Ray backend at `--world` ranks (demo task, `--size` model, no warm start):
   its median step (steps 2..last) and how many worker spans each step wrote (timeline.jsonl "rank");
2. microbenchmarks of everything those spans add, per step: on a worker, a span's enter/exit (stages
   and collectives alike) and its reply (take() + pickling the step's spans); on the driver, writing
   them into the timeline (add_remote), the rank metrics of the step (rank_metrics) and their share
   of the step's one file append.
The bound is spans per step x (span + pickled bytes) + the driver's per-step work, as a share of the
median step; goal <= 0.5 %. Records the load around each part (bench/machine.py).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import statistics
import tempfile
import timeit

import torch

from machine import capability, measured, verdict

RUN = ["demo.warmstart_steps=0", "data.train_size=256", "data.val_size=4", "data.train_batch_size=8",
       "data.max_response_length=32", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.ignore_eos=true",
       "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
       "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[]", "trainer.backend=ray",
       "trainer.ray.cpus_per_worker=1", "trainer.num_threads=1"]


def real_run(size: str, world: int, steps: int, out_dir: str) -> dict:
    from plait import driver
    from plait.config import load_config
    from plait.trainers.lifecycle import read_metrics
    cfg = load_config(None, [*RUN, f"demo.model_size={size}", f"trainer.ray.num_cpu_workers={world}",
                             f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={out_dir}"])
    _, load = measured(driver.build(cfg, progress=False).run, threads=world + 1)
    records = read_metrics(os.path.join(out_dir, "metrics.jsonl"))[1:]
    spans = [json.loads(line) for line in open(os.path.join(out_dir, "timeline.jsonl"))]
    per_step = [sum(1 for s in spans if s.get("rank") is not None and s["step"] == r["step"]) for r in records]
    return {"step_s": statistics.median(r["timing_s/step"] for r in records), "worker_spans_per_step": statistics.median(per_step),
            "spans": [s for s in spans if s.get("rank") is not None and s["step"] == records[-1]["step"]], **load}


def micro(example: list[dict]) -> dict:
    """Seconds per span on a worker, per step's reply, and per step on the driver (the example step's spans)."""
    from plait.profiler.timeline import TIMELINE, RankSpans, rank_metrics, rank_stages
    rec = RankSpans()
    rec.enable(0)

    def span():
        with rec.stage("actor", "update_actor"):
            with rec.collective("all_reduce"):
                pass
        rec._spans.clear()
    per_span = min(timeit.repeat(span, number=20000, repeat=5)) / 20000 / 2  # two spans per call
    spans = [(s["role"], s["stage"], s["thread"], s.get("tid") or 0, s["start"], s["end"], s["rank"]) for s in example]
    reply = min(timeit.repeat(lambda: pickle.dumps(list(spans)), number=2000, repeat=5)) / 2000
    with tempfile.TemporaryDirectory() as tmp:
        TIMELINE.open(os.path.join(tmp, "timeline.jsonl"))

        def driver_side():
            TIMELINE.add_remote(1234, spans)
            rank_metrics(rank_stages([(r, st, k, 1234, t, a, b) for r, st, _, t, a, b, k in spans]))
            TIMELINE.flush(1)
        per_step = min(timeit.repeat(driver_side, number=200, repeat=5)) / 200
        TIMELINE.close(1)
    return {"span_s": per_span, "reply_pickle_s_per_step": reply, "driver_s_per_step": per_step,
            "pickled_bytes_per_step": len(pickle.dumps(spans))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="s")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default="bench/results/rank_spans.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        run = real_run(args.size, args.world, args.steps, os.path.join(tmp, "run"))
    example = run.pop("spans")
    cost, load = measured(micro, example)
    per_step = run["worker_spans_per_step"] * cost["span_s"] + cost["reply_pickle_s_per_step"] + cost["driver_s_per_step"]
    result = {"args": vars(args), "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                              "torch": torch.__version__, **capability()},
              **verdict([{k: run[k] for k in ("load_before", "load_after", "busy_limit", "valid")}, load]),
              "run": run, "micro": cost, "added_s_per_step_bound": per_step,
              "overhead_pct_of_step_bound": 100 * per_step / run["step_s"], "goal_pct": 0.5}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("run", "micro", "overhead_pct_of_step_bound", "valid")}, indent=1))


if __name__ == "__main__":
    main()
