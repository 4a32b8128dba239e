"""Past one process on CPU: training steps/s at world size 1 vs 2 on the Ray backend, and the
weight sync to a separated rollout, old path (actor -> driver -> rollout through Ray's object
store) vs new (a gloo broadcast from actor rank 0 to the rollout).

    python bench/bench_ray.py [--size s] [--steps 6] [--syncs 10] [--rounds 2] [--out bench/results/ray.json]

steps: the same sync GRPO run (demo task, `--size` model without warm start, fixed response length)
at world size 1 and 2, with strategy fsdp (whole replicas, one gradient all-reduce) and fsdp2
(sharded); measured over steps 2..last (step 1 warms up), as samples/s. At world size 2 each rank
has one core on a 2-core machine, so the ideal is 2x on the data-parallel stages (old_log_prob, ref,
update_actor) and 1x on generation (one rollout engine). sync: `--syncs` weight syncs of the
`--sync-size` model (actor at world size 1, the rollout in its own process), each path; seconds
per sync and MB/s. Every run records the load average around it (bench/machine.py); a busy run
marks the result `valid: false`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

from machine import capability, measured, verdict

RUN = ["demo.warmstart_steps=0", "data.train_size=256", "data.val_size=4", "data.train_batch_size=8",
       "data.max_response_length=32", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.ignore_eos=true",
       "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
       "actor_rollout_ref.actor.use_kl_loss=true", "trainer.test_freq=-1", "trainer.val_before_train=false",
       "trainer.logger=[]", "trainer.backend=ray", "trainer.ray.cpus_per_worker=1", "trainer.num_threads=1"]


def steps_once(size: str, world: int, strategy: str, steps: int, out_dir: str) -> dict:
    from plait import driver
    from plait.config import load_config
    from plait.trainers.lifecycle import read_metrics
    cfg = load_config(None, [*RUN, f"demo.model_size={size}", f"trainer.ray.num_cpu_workers={world}",
                             f"actor_rollout_ref.actor.strategy={strategy}", f"trainer.total_training_steps={steps}",
                             f"trainer.default_local_dir={out_dir}"])
    _, load = measured(driver.build(cfg, progress=False).run, threads=world + 1)
    records = read_metrics(os.path.join(out_dir, "metrics.jsonl"))[1:]
    wall = sum(r["timing_s/step"] for r in records)
    stage = lambda k: statistics.mean(r.get(f"timing_s/{k}", 0.0) for r in records)  # noqa: E731
    return {"samples_per_s": len(records) * 8 * 4 / wall, "step_s": wall / len(records),
            **{f"{k}_s": stage(k) for k in ("gen", "old_log_prob", "ref", "update_actor")}, **load}


def sync_once(size: str, path: str, syncs: int, out_dir: str) -> dict:
    from plait.backends.ray import RayBackend
    from plait.config import ActorConfig, load_config
    from plait.models import build_char_tokenizer, create_tiny_model
    from plait.profiler import RoleProfilerConfig
    from plait.workers.actor import Actor
    from plait.workers.rollout import Rollout
    from plait.workers.weight_sync import sync_weights
    model = create_tiny_model(os.path.join(out_dir, "m"), size=size, seed=0)
    cfg = load_config(None, [*RUN, f"trainer.default_local_dir={out_dir}", "trainer.placement=separated",
                             "trainer.ray.num_cpu_workers=1", f"trainer.ray.weight_sync={path}"])
    backend = RayBackend(cfg, {r: RoleProfilerConfig() for r in ("actor", "rollout")}, "cpu")
    try:
        actor = backend.spawn("actor", Actor, model, ActorConfig(), 1, 1.0)
        rollout = backend.spawn("rollout", Rollout, model, 8, build_char_tokenizer())
        mb = sum(v.numel() * v.element_size() for v in actor.call(Actor.state_dict).values()) / 2**20
        sync_weights(actor, rollout, 0)  # opens the channel (new path); warms both
        times = []

        def run():
            for version in range(1, syncs + 1):
                start = time.perf_counter()
                sync_weights(actor, rollout, version)
                times.append(time.perf_counter() - start)
        _, load = measured(run, threads=2)
    finally:
        backend.shutdown()
    s = statistics.median(times)
    return {"model_mb": mb, "s_per_sync": s, "mb_per_s": mb / s, **load}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="s", help="tiny model size of the training runs (xs, s, m)")
    ap.add_argument("--sync-size", default="m", help="tiny model size of the weight-sync runs")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--syncs", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="bench/results/ray.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for world, strategy in ((1, "fsdp"), (2, "fsdp"), (2, "fsdp2")):
                name = f"steps_world{world}_{strategy}"
                runs.setdefault(name, []).append(steps_once(args.size, world, strategy, args.steps,
                                                            os.path.join(tmp, f"{name}-{i}")))
                print(name, runs[name][-1], flush=True)
            for path in ("object_store", "process_group"):
                name = f"sync_{path}"
                runs.setdefault(name, []).append(sync_once(args.sync_size, path, args.syncs, os.path.join(tmp, f"{name}-{i}")))
                print(name, runs[name][-1], flush=True)
    median = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "valid"} for name, rs in runs.items()}
    base = median["steps_world1_fsdp"]["samples_per_s"]
    summary = {"world2_fsdp_vs_world1": median["steps_world2_fsdp"]["samples_per_s"] / base,
               "world2_fsdp2_vs_world1": median["steps_world2_fsdp2"]["samples_per_s"] / base,
               "sync_process_group_vs_object_store": median["sync_object_store"]["s_per_sync"]
               / median["sync_process_group"]["s_per_sync"]}
    result = {"args": vars(args), "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                              "torch": torch.__version__, **capability()},
              **verdict([r for rs in runs.values() for r in rs]), "summary": summary, "median": median, "runs": runs}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(summary), f"-> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
