"""`plait profile report` on a multi-window run: wall time and peak memory, this tree against another.

    git worktree add /tmp/plait-before <commit before the streaming report>     # e.g. main before issue 43
    python bench/bench_report_scale.py --before /tmp/plait-before [--size m] [--windows 3] [--tokens 256]
                                       [--rounds 2] [--out bench/results/report_scale.json]

One run of this tree (sync GRPO, demo task, `--size` model, no warm start) profiles `--windows` steps
with the torch tool (shapes and stacks recorded, actor and rollout: big traces); then each tree's
`plait profile report` reads a copy of it in a child process (its own PYTHONPATH), alternating, and
the child reports its wall time and peak RSS (VmHWM). This tree runs twice: merged traces per
window (the default) and --no-merge. The traces' sizes are recorded; the issue's case was three
171 MB windows (100 s, 3.2 GB before).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

from machine import measured, verdict

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# VmHWM, not ru_maxrss: Linux carries a parent's peak into ru_maxrss across fork and exec
CHILD = """
import sys, time
t = time.perf_counter()
from plait.profiler.analysis import build_report
kw = {"merge": False} if sys.argv[2] == "no-merge" else {}
build_report(sys.argv[1], **kw)
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print("RESULT", time.perf_counter() - t, hwm * 1024)
"""


def make_run(size: str, windows: int, tokens: int, out_dir: str) -> dict:
    from plait import driver
    from plait.config import load_config
    steps = list(range(2, 2 * windows + 1, 2))
    cfg = load_config(None, ["demo.warmstart_steps=0", f"demo.model_size={size}", "data.train_size=256",
                             "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                             "critic.ppo_mini_batch_size=8", f"data.max_response_length={tokens}",
                             "actor_rollout_ref.rollout.ignore_eos=true", "trainer.test_freq=-1",
                             "trainer.val_before_train=false", "trainer.logger=[]", f"trainer.total_training_steps={steps[-1]}",
                             "global_profiler.tool=torch", f"global_profiler.steps={steps}",
                             "actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.rollout.profiler.enable=true",
                             "actor_rollout_ref.actor.profiler.tool_config.torch.contents=[shapes,stack]",
                             f"trainer.default_local_dir={out_dir}"])
    driver.build(cfg, progress=False).run()
    manifest = [json.loads(line) for line in open(os.path.join(out_dir, "profile", "manifest.jsonl"))]
    import gzip
    sizes = []
    for r in manifest:
        with gzip.open(os.path.join(out_dir, "profile", r["path"])) as f:
            sizes.append(sum(len(chunk) for chunk in iter(lambda: f.read(1 << 24), b"")))
    return {"windows": len(manifest), "trace_mb_decompressed": [round(s / 2**20, 1) for s in sizes]}


def report(tree: str, run_dir: str, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}
    def child():
        return subprocess.run([sys.executable, "-c", CHILD, run_dir, mode], env=env, capture_output=True, text=True,
                              cwd=tree, timeout=3600)
    out, load = measured(child)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT")), None)
    if line is None:
        return {"error": (out.stderr or out.stdout)[-500:], **load}
    _, seconds, rss = line.split()
    return {"s": float(seconds), "peak_rss_gb": int(rss) / 2**30, **load}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="a checkout of the tree to compare against (its root)")
    ap.add_argument("--size", default="m")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/report_scale.json")
    args = ap.parse_args()
    runs: dict[str, list[dict]] = {"before": [], "after": [], "after_no_merge": []}
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "run")
        traces = make_run(args.size, args.windows, args.tokens, source)
        print("run", traces, flush=True)
        for i in range(args.rounds):
            for name, tree, mode in (("before", args.before, "merge"), ("after", HERE, "merge"),
                                     ("after_no_merge", HERE, "no-merge"))[::1 if i % 2 == 0 else -1]:
                copy = os.path.join(tmp, f"{name}-{i}")
                shutil.copytree(source, copy)
                runs[name].append(report(tree, copy, mode))
                shutil.rmtree(copy)
                print(name, runs[name][-1], flush=True)
    median = {name: {k: statistics.median(r[k] for r in rs) for k in ("s", "peak_rss_gb")}
              for name, rs in runs.items() if rs and all("s" in r for r in rs)}
    result = {"args": vars(args), "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
              "traces": traces, **verdict([r for rs in runs.values() for r in rs]), "median": median, "runs": runs}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"median": median, "traces": traces, "valid": result["valid"]}, indent=1))


if __name__ == "__main__":
    main()
