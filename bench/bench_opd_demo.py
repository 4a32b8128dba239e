"""On-policy distillation against GRPO alone on the built-in demo, at equal training time.

1. The teacher: the built-in `demo-grpo-teacher` (the demo's own GRPO run, 150 steps, exported), built first
   when $PLAIT_CACHE does not hold it yet.
2. Two students from the same start, trained side by side, one torch thread each, so that both see the same
   machine: `--config opd_demo` (k1 as a policy gradient against the teacher, no task reward) and `--config demo`
   (GRPO on the task reward). `--student same` (the default): the model the teacher's run started from (the
   demo's tiny Qwen2 and its supervised warm start, seed 1), each seed changing only the data and the sampling,
   as a fresh copy of the teacher's base model learns from it; `--student own`: each seed's own demo model
   (another random init and its warm start).
3. Their greedy validation accuracy (`val-core/arithmetic/reward/mean@1`) against the training time spent
   (the sum of `perf/time_per_step` less validation and checkpoints up to that step: generation, reward, teacher,
   update; start-up not counted), and the accuracy of each when the other has spent as much.

Writes
  bench/results/opd_demo.json   both curves (step, training seconds, accuracy), the teacher's accuracy, the
                                comparison at equal time, the load average sampled every 15 s (bench/machine.py)
  docs/img/opd_demo.png         accuracy against training time and against step

    python bench/bench_opd_demo.py [--steps 60] [--seeds 1 2 3] [--student same|own] [--plot-only] [-- key=value ...]

The two runs share the machine with each other (and with whatever else runs): their seconds compare with each
other, not with other machines. The load is recorded; a learning curve by step does not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time

from machine import busy_limit, capability

ACC = "val-core/arithmetic/reward/mean@1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def plait(*args: str, log: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "plait.cli", *args]
    print("running:", " ".join(cmd), flush=True)
    out = open(log, "w") if log else None
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=out or subprocess.DEVNULL, stderr=subprocess.STDOUT)


def make_teacher() -> tuple[str, float]:
    """The built-in teacher's folder (built now if not cached) and its run's last validation accuracy."""
    folder = subprocess.run([sys.executable, "-c", "from plait.builtin_models import demo_teacher_dir; "
                             "print(demo_teacher_dir())"], cwd=ROOT, env=ENV, capture_output=True, text=True)
    if folder.returncode:
        sys.exit(f"building demo-grpo-teacher failed: {folder.stderr[-2000:]}")
    model = folder.stdout.strip().splitlines()[-1]
    with open(os.path.join(os.path.dirname(model), "run", "metrics.jsonl")) as f:
        return model, [json.loads(line) for line in f if ACC in line][-1][ACC]


def curve(run_dir: str) -> list[dict]:
    """Per validated step: the step, the training seconds spent by then, the accuracy."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    spent, out = 0.0, []
    for r in records:
        spent += r.get("perf/time_per_step", 0.0) - r.get("timing_s/testing", 0.0) - r.get("timing_s/save_checkpoint", 0.0)
        if ACC in r:
            out.append({"step": r["step"], "train_s": round(spent, 2), "accuracy": r[ACC],
                        "distillation_loss": r.get("actor/distillation/abs_loss"), "score": r.get("critic/score/mean")})
    return out


def at_time(points: list[dict], seconds: float) -> float | None:
    """The accuracy of the last validation whose training time is within `seconds`."""
    done = [p for p in points if p["train_s"] <= seconds]
    return done[-1]["accuracy"] if done else None


def side_by_side(run_dir: str, steps: int, seed: int, overrides: list[str]) -> tuple[dict, list[float]]:
    """One OPD and one GRPO run of `seed`, at once; their curves and the comparison at equal training time."""
    common = ["trainer.resume_mode=disable", "trainer.num_threads=1", f"trainer.seed={seed}",
              f"trainer.total_training_steps={steps}", "trainer.save_freq=-1", "trainer.test_freq=5", *overrides]
    dirs = {name: os.path.join(run_dir, f"{name}_seed{seed}") for name in ("opd", "grpo")}
    loads, done = [os.getloadavg()[0]], threading.Event()

    def sample():
        while not done.wait(15):
            loads.append(os.getloadavg()[0])
    threading.Thread(target=sample, daemon=True).start()
    procs = {name: plait("train", "--no-progress", "--config", config, f"trainer.default_local_dir={dirs[name]}", *common,
                         log=dirs[name] + ".log") for name, config in (("opd", "opd_demo"), ("grpo", "demo"))}
    for name, proc in procs.items():
        if proc.wait():
            sys.exit(f"the {name} run failed: {dirs[name]}.log")
    done.set()
    curves = {name: curve(d) for name, d in dirs.items()}
    budget = min(curves["opd"][-1]["train_s"], curves["grpo"][-1]["train_s"])
    marks = sorted({p["train_s"] for c in curves.values() for p in c if p["train_s"] <= budget})
    equal = [{"train_s": t, "opd": at_time(curves["opd"], t), "grpo": at_time(curves["grpo"], t)} for t in marks]
    return {"seed": seed, **curves, "equal_time": equal, "budget_s": budget,
            "at_budget": {"opd": at_time(curves["opd"], budget), "grpo": at_time(curves["grpo"], budget)}}, loads


def plot(result: dict, png: str) -> None:
    try:
        import matplotlib
    except ImportError:  # the result file is written already; the picture is optional
        print("no PNG: matplotlib is not installed (pip install matplotlib, then --plot-only)", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(10, 3.8))
    for run in result["runs"]:
        for name, style in (("opd", "o-"), ("grpo", "s--")):
            c = run[name]
            label = f"{'OPD (k1, teacher)' if name == 'opd' else 'GRPO alone'}, seed {run['seed']}"
            by_time.plot([p["train_s"] / 60 for p in c], [p["accuracy"] for p in c], style, ms=3, label=label)
            by_step.plot([p["step"] for p in c], [p["accuracy"] for p in c], style, ms=3, label=label)
    for ax in (by_time, by_step):
        ax.axhline(result["teacher_accuracy"], color="grey", lw=0.8, ls=":", label="the teacher")
        ax.set_ylabel("greedy validation accuracy")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    by_time.set_xlabel("training minutes (steps' time; start-up and validation not counted)")
    by_step.set_xlabel("step")
    fig.suptitle(f"plait demo (tiny Qwen2, 2-digit sums): on-policy distillation vs GRPO, side by side, load "
                 f"{result['load']['mean']:.1f} on {result['machine']['cpus']} CPUs", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png) or ".", exist_ok=True)
    fig.savefig(png, dpi=110)
    print("wrote", png)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--student", choices=("same", "own"), default="same",
                   help="same: the teacher's own starting model for every seed; own: each seed's demo model")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "opd_demo.json"))
    p.add_argument("--png", default=os.path.join(ROOT, "docs", "img", "opd_demo.png"))
    p.add_argument("--run-dir", default=os.path.join(ROOT, "outputs", "bench_opd_demo"))
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from --out, run nothing")
    p.add_argument("overrides", nargs="*", help="after --: key=value overrides of both students")
    args = p.parse_args()
    if args.plot_only:
        with open(args.out) as f:
            plot(json.load(f), args.png)
        return
    os.makedirs(args.run_dir, exist_ok=True)
    start = time.monotonic()
    teacher, teacher_accuracy = make_teacher()
    start_model = os.path.join(os.path.dirname(teacher), "run", "demo_model", "warmstart")  # the teacher run's start
    overrides = [f"actor_rollout_ref.model.path={start_model}"] * (args.student == "same") + args.overrides
    cache = os.path.dirname(os.path.dirname(teacher))  # written as $PLAIT_CACHE: no machine's path in the result
    result = {"teacher": "demo-grpo-teacher", "teacher_accuracy": teacher_accuracy, "student": args.student,
              "steps": args.steps, "overrides": [o.replace(cache, "$PLAIT_CACHE") for o in overrides], "runs": []}
    loads = []
    for seed in args.seeds:
        run, run_loads = side_by_side(args.run_dir, args.steps, seed, overrides)
        result["runs"].append(run)
        loads += run_loads
    result["wall_s"] = round(time.monotonic() - start, 1)
    result["load"] = {"mean": round(sum(loads) / len(loads), 2), "max": round(max(loads), 2), "samples_every_s": 15,
                      "samples": [round(x, 2) for x in loads], "busy_limit": busy_limit()}
    result["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                         **capability()}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"teacher_accuracy": result["teacher_accuracy"], "load": result["load"]["mean"],
                      "at_budget": [r["at_budget"] for r in result["runs"]], "budget_s": [r["budget_s"] for r in result["runs"]]}))
    print("wrote", args.out)
    plot(result, args.png)


if __name__ == "__main__":
    main()
