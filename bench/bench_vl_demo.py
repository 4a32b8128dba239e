"""The learning curve of the vl_demo preset: a tiny Qwen2-VL (random weights, a short format-only warm start),
GRPO on `larger_shape` (which of a red and a blue shape on a 56x56 picture is larger).

Runs `plait train --config vl_demo` (plus any overrides given after --) with a fresh model cache, so the
model build and its warm start count in the wall time, then reads the run's metrics.jsonl and writes
  bench/results/vl_demo.json   the validation accuracy (val-core/larger_shape/reward/mean@1, greedy) by step
                               with the seconds since the start of the run, the training score and s/step,
                               first/best/last accuracy, wall time (and the warm start's part of it), the load
                               average sampled every 15 s, the host's capability (bench/machine.py)
  docs/img/vl_demo.png         accuracy against step and against wall time
A run whose mean load is over bench/machine.py's limit is marked `valid: false`: its wall time measures
neighbours, not plait; its curve by step still shows what the preset learns.

    python bench/bench_vl_demo.py [--out bench/results/vl_demo.json] [--png docs/img/vl_demo.png]
                                  [--run-dir DIR] [--plot-only] [-- key=value ...]

needs: matplotlib for the PNG (optional).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time

from machine import busy_limit, capability

ACC = "val-core/larger_shape/reward/mean@1"
VAL_LEN = "val-aux/response_length/mean"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESET = "vl_demo"


def run_preset(run_dir: str, overrides: list[str]) -> tuple[float, list[float], int, list[tuple[float, str]]]:
    """Train the preset into run_dir with a fresh $PLAIT_CACHE; return wall seconds, the load samples, the exit
    status and (seconds since start, line) for every console line (the validation lines give the curve's times)."""
    cache = os.path.join(run_dir, "plait_cache")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "plait.cli", "train", "--config", PRESET, "--no-progress",
           f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable", *overrides]
    print("running:", " ".join(cmd), flush=True)
    loads, done, lines = [os.getloadavg()[0]], threading.Event(), []

    def sample():
        while not done.wait(15):
            loads.append(os.getloadavg()[0])
    threading.Thread(target=sample, daemon=True).start()
    start = time.monotonic()
    env = {**os.environ, "PLAIT_CACHE": cache, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        lines.append((round(time.monotonic() - start, 1), line.rstrip()))
        print(line, end="", flush=True)
    rc = proc.wait()
    done.set()
    loads.append(os.getloadavg()[0])
    return time.monotonic() - start, loads, rc, lines


def val_times(lines: list[tuple[float, str]]) -> dict[int, float]:
    """Seconds since the start at which each step's console line (with its validation) was printed."""
    out = {}
    for t, line in lines:
        if line.startswith("step ") and ACC in line:
            out[int(line.split()[1])] = t
    return out


def curves(run_dir: str, lines: list[tuple[float, str]]) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    at = val_times(lines)
    val = [r for r in records if ACC in r]
    train = [r for r in records if "critic/score/mean" in r]
    return {
        "val": [{"step": r["step"], "accuracy": r[ACC], "response_length": r.get(VAL_LEN),
                 "wall_s": at.get(r["step"])} for r in val],
        "train": [{"step": r["step"], "score": r["critic/score/mean"], "response_length": r.get("response_length/mean"),
                   "s_per_step": r.get("perf/time_per_step"), "gen_s": r.get("timing_s/gen"),
                   "update_actor_s": r.get("timing_s/update_actor")} for r in train],
    }


def plot(result: dict, png: str) -> None:
    try:
        import matplotlib
    except ImportError:  # the result file is written already; the picture is optional
        print("no PNG: matplotlib is not installed (pip install matplotlib, then --plot-only)", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    val, train = result["val"], result["train"]
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 3.8))
    by_step.plot([v["step"] for v in val], [v["accuracy"] for v in val], "o-", label="validation (greedy)")
    by_step.plot([t["step"] for t in train], [t["score"] for t in train], ".-", alpha=0.5, label="training samples")
    by_step.set_xlabel("step")
    timed = [v for v in val if v["wall_s"] is not None]
    by_time.plot([v["wall_s"] / 60 for v in timed], [v["accuracy"] for v in timed], "o-", label="validation (greedy)")
    by_time.set_xlabel("minutes since start (model build and warm start included)")
    for ax in (by_step, by_time):
        ax.axhline(0.5, color="grey", lw=0.8, ls=":", label="chance")
        ax.set_ylabel("accuracy (larger_shape)")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"tiny Qwen2-VL (random weights + format warm start), GRPO on larger_shape (plait vl_demo); "
                 f"{result['wall_s'] / 60:.1f} min, load {result['load']['mean']:.1f} on {result['machine']['cpus']} CPUs",
                 fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=110)
    print("wrote", png)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", f"{PRESET}.json"))
    p.add_argument("--png", default=os.path.join(ROOT, "docs", "img", f"{PRESET}.png"))
    p.add_argument("--run-dir", default=os.path.join(ROOT, "outputs", f"bench_{PRESET}"))
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out, run nothing")
    p.add_argument("overrides", nargs="*", help="after --: key=value overrides of the preset")
    args = p.parse_args()
    if args.plot_only:
        with open(args.out) as f:
            plot(json.load(f), args.png)
        return
    wall, loads, rc, lines = run_preset(args.run_dir, args.overrides)
    if rc != 0:
        sys.exit(f"plait train exited with {rc}; no result written")
    result = {"preset": PRESET, "overrides": args.overrides, "wall_s": round(wall, 1), **curves(args.run_dir, lines)}
    starts = [t for t, line in lines if "the format warm start" in line]
    accs = [v["accuracy"] for v in result["val"]]
    result["accuracy"] = {"first": accs[0], "best": max(accs), "last": accs[-1], "gain": round(max(accs) - accs[0], 4),
                          "gain_last": round(accs[-1] - accs[0], 4)}
    mean_load = sum(loads) / len(loads)
    result["load"] = {"mean": round(mean_load, 2), "max": round(max(loads), 2), "samples_every_s": 15,
                      "samples": [round(x, 2) for x in loads], "busy_limit": busy_limit()}
    result["valid"] = mean_load <= busy_limit() + 2  # + the run's own threads
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                         **capability()}
    if starts:  # the model build and warm start end where step 0's validation is printed (val[0]["wall_s"])
        result["warm_start_began_s"] = starts[0]
    if not result["valid"]:
        print(f"INVALID for timing: mean load {mean_load:.1f} over {busy_limit() + 2}; the wall time measures "
              "neighbours. The curve by step stands.", flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("wall_s", "accuracy", "load", "valid")}))
    print("wrote", args.out)
    plot(result, args.png)


if __name__ == "__main__":
    main()
