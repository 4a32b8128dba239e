"""Throughput of the trainer modes on one machine: sync vs one_step_off vs fully_async (and verl's V1 modes).

The same GRPO run in every mode (the demo's s-size model without warm start, so every response
runs to max_response_length), two workloads: `balanced` (8 prompts x n=8 x 96 tokens per step,
2 optimizer steps per step) and `rollout_heavy` (4 prompts x n=2 x 320 tokens, one optimizer step
per step, pi_old fused: generation was 65 % of a sync step in a smoke run), on the local backend (the rollout generates in a thread of the driver) and optionally on
Ray (the rollout in its own process). fully_async: require_batches=2 x ppo_mini_batch_size=4
prompts per local update (rollout_heavy: 1 x 4), one local update per step, staleness_threshold=1, partial rollouts,
4 prompts per generate call. Each round runs every mode once, back to back, so the ratios within
a round share the machine's load; rounds repeat, and the median ratio is reported with the load
average around each run. Measured: steps 2..last-1 (step 1 warms up; the last step writes
a checkpoint): samples/s (responses trained on), tokens/s (prompt+response tokens trained
on), in the async modes the share of update_actor time during which the rollout was generating
(`gen_during_update_share`, from timeline.jsonl), the mean trainer/rollouter idle ratios (for sync: the trainer idles while it generates and the
rollout while it learns), and learn_s, the trainer's own stages per step: overlap can only help
when that does not grow, i.e. when a core is free for the rollout. The overlap bound of a
workload is 1 / (1 - the sync trainer's idle ratio); each mode reports the share of it reached.
Every run records the load average around it (bench/machine.py) and a busy run marks the result
`valid: false`.

    python bench/bench_modes.py [--rounds 3] [--steps 8] [--threads 1] [--backend local|ray] [--device cpu|cuda]
                                [--workloads balanced,rollout_heavy] [--modes sync,one_step_off,...]
                                [--out bench/results/modes.json]
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

MODES = {
    "sync": ["trainer.mode=sync"],
    "one_step_off": ["trainer.mode=one_step_off"],
    "fully_async": ["trainer.mode=fully_async", "async_training.require_batches=2",
                    "async_training.trigger_parameter_sync_step=1", "async_training.staleness_threshold=1",
                    "async_training.partial_rollout=true", "async_training.gen_batch_size=8"],
    # verl 0.9.1's V1 modes with their defaults (one warmup batch, threshold 8, drop); separate_async's
    # parameter_sync_step is the workload's train_batch_size / ppo_mini_batch_size (WORKLOADS)
    "colocate_async": ["trainer.v1.trainer_mode=colocate_async"],
    "separate_async": ["trainer.v1.trainer_mode=separate_async"],
}
WORKLOAD = ["demo.model_size=s", "demo.warmstart_steps=0", "data.train_size=512", "data.val_size=8",
            "data.train_batch_size=8", "data.max_response_length=96", "actor_rollout_ref.rollout.n=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=64", "trainer.placement=separated",
            "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.logger=[]"]
# Generation >= 60 % of a sync step: long responses from few rows (decode runs one token at a time,
# so its per-step cost barely shrinks with the batch) and one optimizer step per batch (pi_old fused).
ROLLOUT_HEAVY = [*WORKLOAD, "data.train_batch_size=4", "data.max_response_length=320", "actor_rollout_ref.rollout.n=2",
                 "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
# name: (overrides, samples/step, per mode the overrides on top of MODES: fully_async's one local update = one
# step's batch; separate_async's one local update per PPO mini-batch)
WORKLOADS = {"balanced": (WORKLOAD, 8 * 8, {"separate_async": ["trainer.v1.separate_async.parameter_sync_step=2"]}),
             "rollout_heavy": (ROLLOUT_HEAVY, 4 * 2, {"fully_async": ["async_training.require_batches=1",
                                                                      "async_training.gen_batch_size=4"],
                                                      "separate_async": ["trainer.v1.separate_async.parameter_sync_step=1"]})}


def run_once(workload: str, mode: str, steps: int, threads: int, backend: str, device: str, out_dir: str) -> dict:
    from plait import driver
    from plait.config import load_config
    from plait.trainers.lifecycle import read_metrics
    extra = ["trainer.ray.num_cpu_workers=1", "trainer.ray.cpus_per_worker=1"] if backend == "ray" else []
    overrides, samples_per_step, async_overrides = WORKLOADS[workload]
    cfg = load_config(None, [*overrides, *MODES[mode], *async_overrides.get(mode, []), f"trainer.total_training_steps={steps}",
                             f"trainer.num_threads={threads}", f"trainer.backend={backend}", f"trainer.device={device}", *extra,
                             f"trainer.default_local_dir={out_dir}"])
    _, load = measured(driver.build(cfg, progress=False).run, threads=threads * (1 if mode == "sync" else 2))
    records = read_metrics(os.path.join(out_dir, "metrics.jsonl"))[1:-1]  # steps 2..last-1
    wall = sum(r["timing_s/step"] for r in records)
    samples = len(records) * samples_per_step
    mean = lambda key: statistics.mean(r[key] for r in records)  # noqa: E731
    learn = ("reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor")
    out = {"samples_per_s": samples / wall, "tokens_per_s": sum(r["perf/total_num_tokens"] for r in records) / wall,
           "step_s": wall / len(records),
           # the trainer's own work per step: under overlap it slows down when no core is free for it
           "learn_s": statistics.mean(sum(r.get(f"timing_s/{k}", 0.0) for k in learn) for r in records),
           **load}
    if mode == "sync":  # the trainer waits while the rollout generates; the rollout idles while it learns
        gen = statistics.mean(r["timing_s/gen"] / r["timing_s/step"] for r in records)
        out.update(trainer_idle_ratio=gen, rollouter_idle_ratio=1 - gen, gen_s=mean("timing_s/gen"),
                   overlap_bound=1 / max(gen, 1 - gen), mfu_actor=mean("perf/mfu/actor"), mfu_gen=mean("perf/mfu/gen"))
    else:
        out.update(trainer_idle_ratio=mean("trainer/idle_ratio"), rollouter_idle_ratio=mean("rollouter/idle_ratio"),
                   staleness_mean=mean("training/staleness/mean"))
        if mode == "fully_async":
            out["partial_ratio"] = mean("fully_async/partial/partial_ratio")
        # the overlap itself, on the timeline's wall clock: generation running while the actor updates
        out["gen_during_update_share"] = gen_during_update(os.path.join(out_dir, "timeline.jsonl"),
                                                           {r["step"] for r in records})
    return out


def gen_during_update(path: str, steps: set) -> float:
    """The share of update_actor time (the measured steps) during which a rollout generate/resume ran."""
    from plait.profiler.timeline import read_timeline
    spans = read_timeline(path)
    gens = [s for s in spans if s["role"] == "rollout" and s["stage"] in ("gen", "generate", "resume")
            and s.get("rank") is None]  # the driver's rollouter ("generate" before issue 43), not a worker's own span
    updates = [s for s in spans if s["role"] == "trainer" and s["stage"] == "update_actor" and s["step"] in steps]
    both = sum(max(0.0, min(u["end"], g["end"]) - max(u["start"], g["start"])) for u in updates for g in gens)
    return both / (sum(u["end"] - u["start"] for u in updates) or 1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each process")
    ap.add_argument("--backend", choices=["local", "ray"], default="local")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--modes", default=",".join(MODES), help="modes to run (sync, the baseline, always runs)")
    ap.add_argument("--out", default="bench/results/modes.json")
    args = ap.parse_args()
    args.modes = ["sync", *(m for m in args.modes.split(",") if m != "sync")]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: {', '.join(unknown)}: not one of {', '.join(MODES)}")
    torch.set_num_threads(args.threads)
    for workload in args.workloads.split(","):
        run_workload(workload, args)


def run_workload(workload: str, args) -> None:
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            runs = {}
            for mode in args.modes:
                runs[mode] = run_once(workload, mode, args.steps, args.threads, args.backend, args.device,
                                      os.path.join(tmp, f"{mode}-{i}"))
                print(f"{workload} round {i} {mode:13s} " + " ".join(f"{k}={v:.3g}" for k, v in runs[mode].items()),
                      flush=True)
            rounds.append(runs)
    ratio = lambda mode, key: statistics.median(r[mode][key] / r["sync"][key] for r in rounds)  # noqa: E731
    summary = {mode: {"samples_per_s_vs_sync": ratio(mode, "samples_per_s"), "tokens_per_s_vs_sync": ratio(mode, "tokens_per_s"),
                      **{k: statistics.median(r[mode][k] for r in rounds) for k in rounds[0][mode] if k != "valid"}}
               for mode in args.modes}
    bound = summary["sync"]["overlap_bound"]
    # Perfect overlap makes a step as long as the longer of generation and learning: the bound is
    # 1 / max(gen share, 1 - gen share) of a sync step (1 / (1 - gen) holds only while learning is longer).
    for mode in args.modes:
        summary[mode]["share_of_overlap_bound"] = summary[mode]["samples_per_s_vs_sync"] / bound
    setting = f"{workload}: {args.backend}, {args.device}, torch threads {args.threads}, {os.cpu_count()} cores"
    result = {"setting": setting, "cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
              "capability": capability(args.device),
              "workload": WORKLOADS[workload][0], "modes": {m: MODES[m] for m in args.modes}, "steps": args.steps, "summary": summary,
              "rounds": rounds, **verdict([r[mode] for r in rounds for mode in args.modes])}
    results = json.load(open(args.out)) if os.path.exists(args.out) else {}
    results[setting] = result
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    for mode, s in summary.items():
        print(f"{setting}: {mode:13s} samples/s x{s['samples_per_s_vs_sync']:.2f} tokens/s x{s['tokens_per_s_vs_sync']:.2f} "
              f"trainer idle {s['trainer_idle_ratio']:.2f} rollouter idle {s['rollouter_idle_ratio']:.2f} "
              f"share of overlap bound {s['share_of_overlap_bound']:.2f}")


if __name__ == "__main__":
    main()
