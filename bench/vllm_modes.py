"""The issue's "Done when" for rollout.name=vllm, run for real: verl's GRPO command line
(bench/verl_grpo_vllm.sh) for 3 steps on SmolLM2-135M-Instruct in every mode on both backends.

Runs, one at a time (each its own `plait train` and its own vLLM engine core): sync colocated, sync
separated, one_step_off and fully_async with partial rollout, on the local and the Ray backend.
Per run it records the steps done, `training/rollout_probs_diff_{mean,max}` per step (max is
reported when the actor recomputes old log-probs, i.e. more than one mini-batch: the default
sizes have two), whether step 1's profile holds the rollout's generation (the manifest lists a
`vllm_engine` trace for steps [1, 1] and that trace holds vLLM's attention ops from the engine-core
process), the wall time and the load average around the run (bench/machine.py). These are
correctness runs: the load is recorded, not required to be low.

    python bench/vllm_modes.py [--runs sync-colocated-local,...] [--out bench/results/vllm_modes.json] [overrides]

Run it in the vLLM environment (docs/rollout.md); about 3-5 minutes a run on 2 cores.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from machine import measured

HERE = Path(__file__).parent
RUNS = [f"{mode}-{place}-{backend}" for backend in ("local", "ray")
        for mode, place in (("sync", "colocated"), ("sync", "separated"), ("one_step_off", "separated"),
                            ("fully_async", "separated"))]
# small batch: 2 prompts x n=2, 32 response tokens, two mini-batches (so the old log-probs are recomputed)
SMALL = ["data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=1"]
# Per-mode additions (none now). Partial rollout is on in fully_async, but a sync cuts a generate short only
# when one is running: at these sizes the rollouter is a sync period ahead and idle at every sync (also
# with 192 fixed-length tokens), so `partial_rollouts` is recorded, not required. Rollout-heavy overrides
# (384-token responses with ignore_eos, no KL loss, no gradient checkpointing: docs/rollout.md) make every
# sync after step 1 cut a generate short (bench/results/vllm_partial.json); tests/trainers/
# test_vllm_modes.py forces one on the tiny model and checks the abort and resume.
MODE_EXTRA: dict[str, list[str]] = {}
GENERATION_OP = "vllm::unified_attention"  # the model's attention, run by the engine core while it generates


def step1_holds_generation(profile: Path) -> dict:
    """What step 1's profile says about the rollout's generation."""
    manifest = profile / "manifest.jsonl"
    if not manifest.exists():
        return {"holds_generation": False, "why": "no manifest"}
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    engine = [r for r in rows if r.get("stage") == "vllm_engine" and r.get("steps") == [1, 1]]
    if not engine:
        return {"holds_generation": False, "why": "no vllm_engine trace for step 1 in the manifest"}
    with gzip.open(profile / engine[0]["path"]) as f:
        events = json.load(f)["traceEvents"]
    ops = [e for e in events if e.get("name", "").startswith(GENERATION_OP)]
    pids = {e.get("pid") for e in ops}
    return {"holds_generation": bool(ops) and engine[0]["pid"] not in pids, "trace": engine[0]["path"],
            "attention_ops": len(ops), "engine_core_pids": sorted(str(p) for p in pids),
            "worker_pid": engine[0]["pid"], "policy_version": engine[0].get("policy_version")}


def run(name: str, out: str, extra: list[str]) -> dict:
    mode, place, backend = name.split("-")
    env = {**os.environ, "MODE": mode, "PLACEMENT": place, "BACKEND": backend, "OUT": out}
    start = time.perf_counter()
    proc = subprocess.run(["bash", str(HERE / "verl_grpo_vllm.sh"), *SMALL, *MODE_EXTRA.get(mode, []), *extra], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    Path(out, "run.log").write_text(proc.stdout + proc.stderr)
    metrics = Path(out, "metrics.jsonl")
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    per_step = [{"step": r["step"], **{k.removeprefix("training/rollout_probs_diff_"): r.get(k) for k in
                                      ("training/rollout_probs_diff_mean", "training/rollout_probs_diff_max")},
                 "staleness_max": r.get("training/staleness/max"),
                 "partial_ratio": r.get("fully_async/partial/partial_ratio")} for r in records]
    means = [s["mean"] for s in per_step if s["mean"] is not None]
    row = {"run": name, "mode": mode, "backend": backend, "placement": place, "mode_overrides": MODE_EXTRA.get(mode, []),
           "returncode": proc.returncode,
           "steps_done": len(records), "wall_s": round(wall, 1), "per_step": per_step,
           "probs_diff_mean_max": max(means) if means else None,
           "probs_diff_below_1e-3": bool(means) and len(means) == len(records) and max(means) < 1e-3,
           "step1_profile": step1_holds_generation(Path(out, "profile"))}
    if mode == "fully_async":  # did a sync cut a generate short (and Rollout.resume finish it)?
        row["partial_rollouts"] = any((s["partial_ratio"] or 0) > 0 for s in per_step)
    if proc.returncode != 0:
        row["error_tail"] = (proc.stdout + proc.stderr)[-2000:]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from {RUNS}")
    ap.add_argument("--out", default=str(HERE / "results" / "vllm_modes.json"))
    ap.add_argument("--update", action="store_true", help="replace these runs in an existing --out, keep the others")
    ap.add_argument("--keep", default=None, help="keep each run's outputs (metrics, profile, log) under this folder")
    ap.add_argument("extra", nargs="*", help="more key=value overrides for every run")
    args = ap.parse_args()
    result = {"what": "verl GRPO command line with rollout.name=vllm (bench/verl_grpo_vllm.sh), 3 steps, small batch",
              "overrides": SMALL + args.extra,
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "load_avg_start": os.getloadavg()},
              "runs": []}
    root = args.keep or tempfile.mkdtemp(prefix="plait-vllm-modes-")
    for name in args.runs.split(","):
        row, load = measured(run, name, os.path.join(root, name), args.extra, threads=2)
        result["runs"].append({**row, "load": load})
        prof = row["step1_profile"]
        print(f"{name:>28}: rc {row['returncode']}, {row['steps_done']} steps, probs diff mean per step "
              f"{[s['mean'] for s in row['per_step']]}, step-1 trace holds generation {prof['holds_generation']}, "
              f"{row['wall_s']} s, load {load['load_before']}->{load['load_after']}", flush=True)
    result["machine"]["load_avg_end"] = os.getloadavg()
    if args.update and Path(args.out).exists():  # the other runs as they were, in RUNS order
        done = {r["run"] for r in result["runs"]}
        old = [r for r in json.loads(Path(args.out).read_text())["runs"] if r["run"] not in done]
        result["runs"] = sorted(old + result["runs"], key=lambda r: RUNS.index(r["run"]) if r["run"] in RUNS else len(RUNS))
    result["all_ok"] = all(r["returncode"] == 0 and r["steps_done"] == 3 and r["probs_diff_below_1e-3"]
                           and r["step1_profile"]["holds_generation"] for r in result["runs"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"all ok: {result['all_ok']}; wrote {args.out}; run outputs in {root}")


if __name__ == "__main__":
    main()
