"""The GPU proof: plait's CUDA paths run and are measured in one prepared run (issue 13).

    python bench/gpu_check.py [--device cuda|cpu] [--only a,b] [--budget-s 300] [--work DIR] [--out FILE]
    bench/gpu_run.sh            # the device machine's command line: carried wheels, then this script

Each check runs on its own, records what it saw and passes, fails, is skipped (needs what is not
here) or reports a feature "absent" (not merged yet); a failing check never stops the others.
`--device cpu` rehearses every check at tiny sizes (the CUDA-only ones are skipped there).

    torch_memory_windows  tool=torch_memory, steps [1, 3], actor and rollout profiled: one snapshot
                          pickle per window that loads, holds allocation events and the stage
                          annotations, keeps <= stack_depth frames per event; a marker tensor allocated
                          in step 1 is in the first snapshot only and step 3's in the second only
                          (history cleared between windows); no allocator history after the run  [CUDA]
    torch_cuda_kernels    tool=torch, step 2: the trace has CUDA kernel events and the stage names  [CUDA]
    nsys_nvtx             tool=nsys, steps [1, 3]: NVTX ranges pushed and popped per stage with the
                          stage names, the CUDA profiler capture range started and stopped once per
                          window (manifest records with path null)  [CUDA, nvtx]
    torch_memory_oom      tool=torch_memory, step 1, a reward that allocates 1 PiB: the OOM surfaces,
                          <name>_oom.pickle was dumped, the window is incomplete  [CUDA]
    mode_sync, mode_one_step_off, mode_fully_async, mode_diffusion
                          the trainer mode (local backend) with a torch_memory window on step 1:
                          its artifacts exist, load and hold allocations (on CUDA: allocator
                          snapshots; on CPU: memory traces); the per-stage peak metrics are recorded
    stage_peak_memory     a plain sync run logs memory/<stage>/peak_*_gb, on CUDA peak_allocated_gb > 0
                          ("absent" until merged)
    oom_outside_window    torch_memory configured for step 1, the reward runs out of memory in step 2
                          (outside any window): an OOM snapshot is dumped ("absent" until merged)
    fsdp2_world           FSDP2 (strategy=fsdp2) at world size W: 2 gloo ranks on CPU, the visible GPUs
                          up to 2 with NCCL (one GPU: W=1, still sharded); the update equals one
                          unsharded worker's, the sharded checkpoint loads back at W and at 1, and
                          the next update from each agrees
    profile_report        `plait profile report` on mode_sync's artifacts ("absent" until merged)
    bench_vs_trl          plait vs TRL's GRPOTrainer (bench/bench_vs_trl.py's workers) on a
                          Qwen2-architecture model of about 0.5B parameters built from a config (random
                          weights, fixed response length), bf16: tokens/s, step breakdown, MFU
    bench_decode          plait's rollout engine vs HF generate, new tokens/s, ms per decode step (at
                          batch 1 against the step's weight-read floor) and the share of a generate
                          call the GPU is busy in kernels (is launch overhead dominant?)
    gpu_tests             `pytest -m gpu` in a subprocess: the summary line and counts
    nsys_cli              with the `nsys` CLI on PATH: a .nsys-rep whose NVTX summary names the stages

Results go to ONE JSON file (GPU model, driver, versions, date, each check's status, numbers, and
a short traceback on failure), rewritten after every check so a killed run keeps what it did:
--out, default bench/results/gpu_check_cuda.json on CUDA and bench/_work/gpu_check_cpu.json for
the CPU rehearsal (never committed as a GPU result); a copy goes to $OUT when OUT is set.
`--budget-s`: no check starts after that many seconds (the device allows 10 minutes a command).
Exit status: 0 nothing failed, 1 a check failed, 2 nothing could run (no CUDA with --device cuda,
or plait does not import).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import functools
import gzip
import importlib.metadata
import importlib.util
import json
import logging
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

# The same tiny LM run as tests/conftest.py, without validation before step 3 (the device is added per run).
TINY = ["demo.model_size=xs", "demo.warmstart_steps=0", "data.train_size=64", "data.val_size=8",
        "data.train_batch_size=4", "data.max_response_length=6", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.logger=[]"]
ACTOR_AND_ROLLOUT = ["actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.rollout.profiler.enable=true"]
STAGES = ("actor/update_actor", "actor/old_log_prob", "rollout/gen")
CALLS_PER_STEP = 4 * 4  # the reward is called once per response: 4 prompts x 4 samples

# Each trainer mode on the local backend, as tests/profiler/test_matrix.py runs it.
LM_MODES = {
    "sync": ["trainer.mode=sync"],
    "one_step_off": ["trainer.mode=one_step_off", "trainer.placement=separated"],
    "fully_async": ["trainer.mode=fully_async", "trainer.placement=separated", "async_training.gen_batch_size=1"],
}
DIFFUSION = ["trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
             "trainer.logger=[]", "data.train_size=8", "data.val_size=4", "data.train_batch_size=2",
             "actor_rollout_ref.rollout.n=2", "diffusion.pretrain_steps=3", "diffusion.model.width=16",
             "diffusion.model.depth=1", "diffusion.actor.kl_loss_coef=0.01", "diffusion.actor.num_inference_steps=4",
             "diffusion.actor.sde_window_size=2", "diffusion.actor.sde_window_range=[0,4]"]
PEAK_METRIC = re.compile(r"^memory/(.+)/peak_\w+_gb$")  # peak_allocated/reserved on CUDA, peak_rss on CPU

# Benchmark sizes. On CUDA: Qwen2.5-0.5B's widths (hidden 896, 14 heads, 2 KV heads, MLP 4864) with
# 32 layers instead of 24, which makes up for plait's 260-token char vocabulary: 0.48B parameters.
BENCH_MODEL = {
    "cuda": dict(hidden_size=896, num_hidden_layers=32, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864),
    "cpu": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128),
}
BENCH_TRL = {"cuda": dict(prompts=8, n=8, length=128, warmup=1, steps=3, dtype="bfloat16"),
             "cpu": dict(prompts=2, n=2, length=8, warmup=1, steps=1, dtype="float32")}
# (batch, new tokens); batch 1 shows per-step launch overhead against the weight-read floor
BENCH_DECODE = {"cuda": dict(configs=[(64, 128), (256, 128), (1, 64)], runs=2),
                "cpu": dict(configs=[(4, 8), (1, 8)], runs=1)}
H200_BF16_DENSE_TFLOPS = 989.0  # NVIDIA's H200 SXM datasheet, dense (no sparsity); matmuls reach ~790 here
H200_HBM_TB_S = 4.8             # datasheet HBM3e bandwidth: the floor of a decode step is its weight read

# A custom reward that allocates a (20 + step) MiB marker on the device at the first call of each step.
MARKER_REWARD = f'''
import torch
from plait.data.rewards import default_compute_score
CALLS = []
KEEP = []
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if len(CALLS) % {CALLS_PER_STEP} == 0:
        step = len(CALLS) // {CALLS_PER_STEP} + 1
        KEEP[:] = [torch.empty((20 + step) * 2**20, dtype=torch.uint8, device="cuda")]
    CALLS.append(1)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
'''
# Runs out of memory from the reward's call `first_call` on: 1 PiB on any GPU; on CPU the error is
# raised by hand, which rehearses the check's logic (the CUDA allocator's hooks cannot fire there).
OOM_REWARD = '''
import torch
CALLS = []
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append(1)
    if len(CALLS) > {first_call}:
        if torch.cuda.is_available():
            torch.empty(2**50, dtype=torch.uint8, device="cuda")
        raise torch.OutOfMemoryError("gpu_check rehearsal on CPU: a simulated out-of-memory")
    return 0.0
'''


class Skipped(Exception):
    pass


class Absent(Exception):
    """The feature a check looks for has not landed (yet): recorded, not a failure."""


@dataclass(eq=False)  # hashed by identity: bench_model caches per context
class Ctx:
    device: str       # "cuda" or "cpu"
    root: Path        # each check works in root/<check name>
    deadline: float   # time.time() after which no check starts and benchmarks shrink their waits

    def left(self) -> float:
        return self.deadline - time.time()

    def needs_cuda(self) -> None:
        if self.device != "cuda":
            raise Skipped("CUDA only (the CPU paths of this feature are covered by the test suite)")


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def plait_run(ctx: Ctx, work: Path, *overrides: str, config: str | None = None, base: list[str] = TINY,
              raises: type | None = None) -> list[dict]:
    """A plait run profiled into work/profile (its outputs in work/run); returns its manifest records."""
    from plait import driver
    from plait.cli import builtin_config
    from plait.config import load_config
    from plait.profiler import read_manifest
    cfg = load_config(builtin_config(config), [*base, f"trainer.device={ctx.device}",
                                               f"trainer.default_local_dir={work / 'run'}",
                                               f"global_profiler.save_path={work / 'profile'}", *overrides])
    lifecycle = driver.build(cfg, progress=False)
    if raises is None:
        lifecycle.run()
    else:
        try:
            lifecycle.run()
        except raises:
            pass
        else:
            raise AssertionError(f"the run did not raise {raises.__name__}")
    return read_manifest(str(work / "profile")) if (work / "profile").exists() else []


def reward(work: Path, source: str) -> list[str]:
    path = work / "reward.py"
    path.write_text(source)
    # num_workers=0: in the trainer's process, where the planted allocation and OOM are observed
    return [f"reward.custom_reward_function.path={path}", "reward.custom_reward_function.name=compute_score",
            "reward.num_workers=0"]


def load_snapshot(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)


def trace_events(snapshot: dict) -> list[dict]:
    return [e for trace in snapshot["device_traces"] for e in trace]


def memory_events(ctx: Ctx, path: Path) -> int:
    """Allocation events in a torch_memory artifact: the CUDA allocator's snapshot, or on CPU the
    torch.profiler memory trace that stands in for it."""
    if ctx.device == "cuda":
        expect(path.suffix == ".pickle", f"{path.name}: expected an allocator snapshot pickle on CUDA")
        return sum(e["action"] == "alloc" for e in trace_events(load_snapshot(path)))
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sum(e.get("name") == "[memory]" and e["args"].get("Bytes", 0) > 0 for e in events)


def peak_metrics(work: Path) -> dict | str:
    """memory/<stage>/peak_*_gb per step from the run's metrics, or "absent"."""
    from plait.trainers.lifecycle import read_metrics
    records = read_metrics(str(work / "run" / "metrics.jsonl"))
    keys = sorted({k for r in records for k in r if PEAK_METRIC.match(k)})
    return {k: [r.get(k) for r in records] for k in keys} or "absent"


# -- the checks: each fills `d` with what it saw and raises on a failure --------------------------

def torch_memory_windows(ctx: Ctx, work: Path, d: dict) -> None:
    ctx.needs_cuda()
    import torch
    records = plait_run(ctx, work, "global_profiler.tool=torch_memory", "global_profiler.steps=[1,3]",
                        "global_profiler.global_tool_config.torch_memory.stack_depth=4", *ACTOR_AND_ROLLOUT,
                        *reward(work, MARKER_REWARD))
    d["manifest"] = [(r["path"], r["steps"], r["policy_version"], r["complete"]) for r in records]
    expect([r["path"] for r in records] == ["step1/actor-rollout_rank0.pickle", "step3/actor-rollout_rank0.pickle"]
           and all(r["complete"] for r in records), "expected one complete snapshot per window")
    snaps = [load_snapshot(work / "profile" / r["path"]) for r in records]
    events = [trace_events(s) for s in snaps]
    d["alloc_events"] = [sum(e["action"] == "alloc" for e in ev) for ev in events]
    expect(all(n > 0 for n in d["alloc_events"]), "a snapshot has no allocation events")
    annotations = [str(s.get("external_annotations", "")) for s in snaps]
    d["stages_annotated"] = [[name for name in STAGES if name in a] for a in annotations]
    expect(all(len(found) == len(STAGES) for found in d["stages_annotated"]), "stage annotations missing")
    d["max_frames_per_event"] = max(len(e.get("frames", [])) for ev in events for e in ev)
    expect(d["max_frames_per_event"] <= 4, "stack_depth=4 not applied")
    sizes = [{e["size"] for e in ev if e["action"] == "alloc"} for ev in events]
    marker1, marker3 = 21 * 2**20, 23 * 2**20
    d["markers"] = {"window1": [marker1 in sizes[0], marker3 in sizes[0]],
                    "window2": [marker1 in sizes[1], marker3 in sizes[1]]}
    expect(d["markers"] == {"window1": [True, False], "window2": [False, True]},
           "history not cleared between windows (or the step markers were not recorded)")
    d["history_after_run"] = sum(len(t) for t in torch.cuda.memory._snapshot()["device_traces"])
    expect(d["history_after_run"] == 0, "allocator history still recorded outside windows")


def torch_cuda_kernels(ctx: Ctx, work: Path, d: dict) -> None:
    ctx.needs_cuda()
    records = plait_run(ctx, work, "global_profiler.tool=torch", "global_profiler.steps=[2]", *ACTOR_AND_ROLLOUT)
    d["manifest"] = [(r["path"], r["steps"], r["complete"]) for r in records]
    expect([r["path"] for r in records] == ["step2/actor-rollout_rank0.pt.trace.json.gz"], "expected one trace")
    with gzip.open(work / "profile" / records[0]["path"], "rt") as f:
        trace = json.load(f)
    cats = collections.Counter(e.get("cat") for e in trace["traceEvents"])
    d["event_categories"] = dict(cats.most_common(8))
    d["device_properties"] = [p.get("name") for p in trace.get("deviceProperties", [])]
    expect(cats["kernel"] > 0, "no CUDA kernel events in the trace")
    names = {e.get("name") for e in trace["traceEvents"]}
    d["stages_found"] = [s for s in STAGES if s in names]
    expect(len(d["stages_found"]) == len(STAGES), "stage names missing from the trace")


def nsys_nvtx(ctx: Ctx, work: Path, d: dict) -> None:
    ctx.needs_cuda()
    import nvtx
    import torch
    calls = collections.Counter()
    labels = set()

    class Counted:
        def __init__(self, inner):
            self.inner = inner

        def __enter__(self):
            calls["push"] += 1
            return self.inner.__enter__()

        def __exit__(self, *exc):
            calls["pop"] += 1
            return self.inner.__exit__(*exc)

    def annotate(message=None, *args, **kwargs):
        labels.add(message)
        return Counted(original["annotate"](message, *args, **kwargs))

    def counted(name):
        def call():
            calls[name] += 1
            original[name]()
        return call

    original = {"annotate": nvtx.annotate, "start": torch.cuda.profiler.start, "stop": torch.cuda.profiler.stop}
    nvtx.annotate, torch.cuda.profiler.start, torch.cuda.profiler.stop = annotate, counted("start"), counted("stop")
    try:
        records = plait_run(ctx, work, "global_profiler.tool=nsys", "global_profiler.steps=[1,3]", *ACTOR_AND_ROLLOUT)
    finally:
        nvtx.annotate, torch.cuda.profiler.start, torch.cuda.profiler.stop = original.values()
    d["manifest"] = [(r["path"], r["steps"], r["complete"]) for r in records]
    d["calls"] = dict(calls)
    d["stages_found"] = [s for s in STAGES if s in labels]
    expect([(r["steps"], r["path"], r["complete"]) for r in records] == [([1, 1], None, True), ([3, 3], None, True)],
           "expected one record (path null) per window")
    expect(calls["start"] == calls["stop"] == 2, "capture range not started and stopped once per window")
    expect(calls["push"] == calls["pop"] > 0, "NVTX pushes and pops do not balance")
    expect(len(d["stages_found"]) == len(STAGES), "NVTX ranges missing stage names")


def torch_memory_oom(ctx: Ctx, work: Path, d: dict) -> None:
    ctx.needs_cuda()
    import torch
    records = plait_run(ctx, work, "global_profiler.tool=torch_memory", "global_profiler.steps=[1]",
                        "actor_rollout_ref.actor.profiler.enable=true", *reward(work, OOM_REWARD.format(first_call=0)),
                        raises=torch.cuda.OutOfMemoryError)
    d["manifest"] = [(r["path"], r["stage"], r["complete"]) for r in records]
    expect(sorted((r["path"], r["complete"]) for r in records) == [
        ("step1/actor_rank0.pickle", False), ("step1/actor_rank0_oom.pickle", False)],
        "expected the window's snapshot and an _oom snapshot, both incomplete")
    oom = load_snapshot(work / "profile" / "step1" / "actor_rank0_oom.pickle")
    d["oom_events"] = sum(e["action"] == "oom" for e in trace_events(oom))
    expect("segments" in oom, "the OOM snapshot does not load as an allocator snapshot")


def nsys_cli(ctx: Ctx, work: Path, d: dict) -> None:
    ctx.needs_cuda()
    nsys = shutil.which("nsys")
    if nsys is None:
        raise Skipped("no nsys CLI on PATH: NVTX ranges and the capture range were checked in-process (nsys_nvtx)")
    d["nsys_version"] = subprocess.run([nsys, "--version"], capture_output=True, text=True).stdout.strip()
    run = [*TINY, "trainer.device=cuda", f"trainer.default_local_dir={work / 'run'}",
           f"global_profiler.save_path={work / 'profile'}",
           "global_profiler.tool=nsys", "global_profiler.steps=[2]", *ACTOR_AND_ROLLOUT]
    cmd = [nsys, "profile", "--trace=cuda,nvtx", "--capture-range=cudaProfilerApi", "--capture-range-end=repeat",
           "--force-overwrite=true", "-o", str(work / "report"), sys.executable, "-m", "plait.cli", "train",
           "--no-progress", *run]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100)
    d["profile_returncode"] = proc.returncode
    d["profile_output_tail"] = (proc.stdout + proc.stderr)[-1500:]
    reports = sorted(work.glob("report*.nsys-rep"))
    d["reports"] = [p.name for p in reports]
    expect(proc.returncode == 0 and reports, "nsys profile wrote no .nsys-rep")
    for report in ("nvtx_sum", "nvtxsum"):  # renamed in newer Nsight Systems
        stats = subprocess.run([nsys, "stats", "--report", report, "--format", "csv", str(reports[0])],
                               capture_output=True, text=True, timeout=60)
        if stats.returncode == 0 and stats.stdout.strip():
            break
    d["nvtx_summary_tail"] = (stats.stdout or stats.stderr)[-1500:]
    d["stages_found"] = [s for s in STAGES if s in stats.stdout]
    expect(len(d["stages_found"]) == len(STAGES), "the report's NVTX summary lacks the stage ranges")


def mode_window(ctx: Ctx, work: Path, d: dict, mode: str) -> None:
    """The mode's run with a torch_memory window on step 1 (the seeds' failure cases): the window's
    artifacts exist, load and hold allocations; the per-stage peak metrics are recorded."""
    if mode == "diffusion":
        records = plait_run(ctx, work, "global_profiler.tool=torch_memory", "global_profiler.steps=[1]",
                            "actor_rollout_ref.actor.profiler.enable=true", config="diffusion_demo", base=DIFFUSION)
    else:
        # Without CUDA, torch_memory records only the driver's main thread, so plait refuses it for
        # the async modes' local rollout thread: the CPU rehearsal profiles their actor alone.
        roles = ACTOR_AND_ROLLOUT if ctx.device == "cuda" or mode == "sync" else ACTOR_AND_ROLLOUT[:1]
        records = plait_run(ctx, work, *LM_MODES[mode], "trainer.total_training_steps=2",
                            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
                            "global_profiler.tool=torch_memory", "global_profiler.steps=[1]", *roles)
    d["manifest"] = [(r["path"], r["role"], r["steps"], r["complete"]) for r in records]
    d["stage_peak_memory"] = peak_metrics(work)
    expect(bool(records) and all(r["steps"] == [1, 1] and r["complete"] for r in records),
           "expected complete step-1 windows only")
    d["alloc_events"] = {r["path"]: memory_events(ctx, work / "profile" / r["path"]) for r in records}
    expect(all(n > 0 for n in d["alloc_events"].values()), "an artifact holds no allocation events")


def stage_peak_memory(ctx: Ctx, work: Path, d: dict) -> None:
    plait_run(ctx, work, "trainer.total_training_steps=2")
    d["metrics"] = peak_metrics(work)
    if d["metrics"] == "absent":
        raise Absent("no memory/<stage>/peak_*_gb metrics in the run's metrics.jsonl")
    values = [v for vs in d["metrics"].values() for v in vs if v is not None]
    expect(bool(values) and all(v >= 0 for v in values), "peak metrics logged without values")
    if ctx.device == "cuda":
        cuda = [v for k, vs in d["metrics"].items() if k.endswith("/peak_allocated_gb") for v in vs if v is not None]
        expect(bool(cuda) and max(cuda) > 0, "no per-stage CUDA peak_allocated_gb above zero")


def oom_outside_window(ctx: Ctx, work: Path, d: dict) -> None:
    import torch
    records = plait_run(ctx, work, "global_profiler.tool=torch_memory", "global_profiler.steps=[1]",
                        "actor_rollout_ref.actor.profiler.enable=true",
                        *reward(work, OOM_REWARD.format(first_call=CALLS_PER_STEP)), raises=torch.OutOfMemoryError)
    d["manifest"] = [(r["path"], r["steps"], r["stage"], r["complete"]) for r in records]
    found = sorted(str(p.relative_to(work / "profile")) for p in (work / "profile").rglob("*oom*"))
    d["oom_files"] = found
    if not found:
        raise Absent("the OOM in step 2 (no window open) left no snapshot")
    snapshots = [load_snapshot(work / "profile" / p) for p in found if p.endswith(".pickle")]
    expect(bool(snapshots) and all("segments" in s for s in snapshots), "the OOM snapshot does not load")
    d["oom_segments"] = [len(s["segments"]) for s in snapshots]  # outside a window there is no history


def fsdp2_world(ctx: Ctx, work: Path, d: dict) -> None:
    """torch.distributed as a launcher would start it (env vars), W fresh processes: see fsdp_worker.
    W = 2 with gloo on CPU; on CUDA the visible GPUs up to 2 (NCCL puts one rank on each GPU)."""
    import torch
    world = min(2, torch.cuda.device_count()) if ctx.device == "cuda" else 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
               **({"CUDA_VISIBLE_DEVICES": str(rank)} if ctx.device == "cuda" else {})}
        procs.append(subprocess.Popen([sys.executable, __file__, "--fsdp-worker", str(work), "--device", ctx.device],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=max(60, ctx.left() + 60))[0] for p in procs]
    result = work / "fsdp.json"
    d["world_size"], d["returncodes"] = world, [p.returncode for p in procs]
    if any(p.returncode != 0 for p in procs):
        d["output_tail"] = "\n".join(o[-1500:] for o in outputs)
    expect(all(p.returncode == 0 for p in procs) and result.exists(), "an FSDP2 worker failed")
    d.update(json.loads(result.read_text()))


def fsdp_worker(work: Path, device: str) -> None:
    """One rank of W: the FSDP2 actor's update (strategy=fsdp2) equals one unsharded worker's (rank 0
    computes it before joining the group); its sharded checkpoint (torch.distributed.checkpoint,
    each rank its shards) loads back at world size W and, after the group is gone, into one
    unsharded actor at world size 1, and the next update from each agrees."""
    import torch
    import torch.distributed as dist
    from plait.config import ActorConfig, OptimConfig
    from plait.models import create_tiny_model
    from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig
    from plait.workers.actor import Actor
    from plait.workers.parallel import is_sharded
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if device == "cuda":
        torch.cuda.set_device(0)
    model = create_tiny_model(work / f"m{rank}", size="xs", seed=0)
    profiler = ProfilerSession(GlobalProfilerConfig(), {"actor": RoleProfilerConfig()}, rank=rank).for_role("actor")

    def actor(strategy: str) -> Actor:
        cfg = ActorConfig(optim=OptimConfig(lr=1e-3), ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=3,
                          ppo_epochs=2, shuffle=True, strategy=strategy)
        return Actor(model, cfg, 4, 1.0, profiler, device=device, seed=3)

    def diff(a: dict, b: dict) -> float:
        return max((a[k].float().cpu() - b[k].float().cpu()).abs().max().item() for k in a)

    batch, ckpt = tiny_batch(16), str(work / "ckpt")
    if rank == 0:  # one worker, before torch.distributed runs: the reference
        plain = actor("fsdp")
        before = {k: v.clone() for k, v in plain.state_dict().items()}  # state_dict() shares the weights' storage
        plain_metrics = plain.update(batch)
        reference = {k: v.clone() for k, v in plain.state_dict().items()}
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    try:
        sharded = actor("fsdp2")
        metrics = sharded.update(batch)
        updated = sharded.state_dict()  # a collective: every rank
        sharded.save_checkpoint(ckpt)
        again = actor("fsdp2")
        again.load_checkpoint(ckpt)
        load_same = diff(again.state_dict(), updated)
        for a in (sharded, again):
            a.update(batch)
        after = [sharded.state_dict(), again.state_dict()]
        sharded_flag = is_sharded(sharded.model)
        backend = dist.get_backend()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return
    at_one = actor("fsdp")  # the group is gone: world size 1, unsharded
    at_one.load_checkpoint(ckpt)
    load_one = diff(at_one.state_dict(), updated)
    at_one.update(batch)
    out = {"backend": backend, "world_size": world, "sharded": sharded_flag,
           "param_change": diff(reference, before), "update_max_abs_diff": diff(updated, reference),
           "pg_loss": [metrics["actor/pg_loss"], plain_metrics["actor/pg_loss"]],
           "grad_norm": [metrics["actor/grad_norm"], plain_metrics["actor/grad_norm"]],
           "checkpoint_files": sorted(os.listdir(ckpt)), "shard_files": sorted(os.listdir(os.path.join(ckpt, "sharded"))),
           "load_same_world_max_abs_diff": load_same, "load_world1_max_abs_diff": load_one,
           "resumed_update_max_abs_diff": max(diff(after[0], after[1]), diff(after[0], at_one.state_dict()))}
    (work / "fsdp.json").write_text(json.dumps(out))
    expect(out["sharded"] and out["param_change"] > 1e-4, "the update did not move the weights (or no sharding)")
    # Adam moves each weight by about lr (1e-3): 1e-4 on the GPU allows for another reduction order
    update_tol = 1e-4 if device == "cuda" else 1e-5
    for key, tol in (("update_max_abs_diff", update_tol), ("resumed_update_max_abs_diff", update_tol),
                     ("load_same_world_max_abs_diff", 1e-6), ("load_world1_max_abs_diff", 1e-6)):
        expect(out[key] <= tol, f"{key} = {out[key]:.2e} > {tol}")


def tiny_batch(n_rows: int, prompt_len: int = 5, resp_len: int = 6):
    """A RolloutBatch of random tokens and advantages, as tests/backends/test_ray.py builds it."""
    import torch
    from plait.types import RolloutBatch
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, resp_len + 1, (n_rows,), generator=g)
    response_mask = (torch.arange(resp_len) < lengths[:, None]).float()        # [rows, resp_len]
    prompt_mask = torch.ones(n_rows, prompt_len, dtype=torch.long)
    prompt_mask[::3, :2] = 0                                                    # some left padding
    rand = lambda: torch.randn(n_rows, resp_len, generator=g) * response_mask  # noqa: E731
    return RolloutBatch(
        prompts=torch.randint(4, 90, (n_rows, prompt_len), generator=g) * prompt_mask, prompt_mask=prompt_mask,
        responses=torch.randint(4, 90, (n_rows, resp_len), generator=g), response_mask=response_mask,
        rollout_logprobs=-rand().abs(), group_ids=torch.arange(n_rows) // 4,
        versions=torch.zeros(n_rows, dtype=torch.long),
        data_sources=["t"] * n_rows, ground_truths=[""] * n_rows, extra_infos=[{}] * n_rows,
        stop_reasons=["eos"] * n_rows, old_logprobs=-rand().abs() - 3.0, advantages=rand())


def profile_report(ctx: Ctx, work: Path, d: dict) -> None:
    cli = [sys.executable, "-m", "plait.cli"]
    usage = subprocess.run([*cli, "--help"], capture_output=True, text=True, timeout=120).stdout
    if not re.search(r"\bprofile\b", usage):
        raise Absent("`plait profile` is not a command of this checkout")
    source = ctx.root / "mode_sync"
    if not (source / "profile" / "manifest.jsonl").exists():  # mode_sync did not run (--only): make artifacts here
        plait_run(ctx, work, "trainer.total_training_steps=2", "global_profiler.tool=torch_memory",
                  "global_profiler.steps=[1]", *ACTOR_AND_ROLLOUT)
        source = work
    command = ["profile", "report", str(source / "run"), "--profile", str(source / "profile")]
    proc = subprocess.run([*cli, *command], capture_output=True, text=True, timeout=max(60, ctx.left()))
    d["command"] = "plait " + " ".join(command)
    d["report_files"] = sorted(p.name for p in (source / "run" / "report").glob("*"))
    d["returncode"] = proc.returncode
    d["output"] = (proc.stdout + proc.stderr)[-4000:]
    expect(proc.returncode == 0, "the report command failed")
    # the memory artifact parsed: "memory <path>: peak <MiB> in <stage>; top site <file(line): function>"
    d["memory_lines"] = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip().startswith("memory ")]
    expect(any(" peak " in ln and "top site" in ln and not ln.endswith("top site -") for ln in d["memory_lines"]),
           "the report names no memory peak with its stage and top allocation site")


def gpu_tests(ctx: Ctx, work: Path, d: dict) -> None:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", "-o", "addopts=", str(REPO / "tests")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=max(60, ctx.left() + 60),
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    d["returncode"] = proc.returncode
    d["summary"] = lines[-1] if lines else proc.stderr[-500:]
    d["counts"] = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", d["summary"])}
    d["failures"] = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))][:20]
    if proc.returncode not in (0, 5):  # 5: no test selected
        d["output_tail"] = proc.stdout[-3000:]
    expect(proc.returncode in (0, 5), "gpu-marked tests failed")
    if ctx.device == "cuda":
        expect(d["counts"].get("passed", 0) > 0, "no gpu-marked test ran")


@functools.cache
def bench_model(ctx: Ctx) -> tuple[str, int]:
    """The benchmark's Qwen2 (random weights, plait's char tokenizer), saved once; (path, parameters)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from plait.models import MAX_LENGTH, build_char_tokenizer
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=MAX_LENGTH, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, dtype=BENCH_TRL[ctx.device]["dtype"],
                         **BENCH_MODEL[ctx.device])
    torch.manual_seed(0)
    with torch.device(ctx.device):  # 0.48B parameters initialise in seconds on the GPU
        model = Qwen2ForCausalLM(config).to(getattr(torch, BENCH_TRL[ctx.device]["dtype"]))
    path = ctx.root / "bench_model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), sum(p.numel() for p in model.parameters())


def bench_decode(ctx: Ctx, work: Path, d: dict) -> None:
    """bench/bench_decode.py's alternating HF-generate / plait-engine timing on the benchmark model."""
    import torch
    import bench_decode as decode
    from plait.models import load_causal_lm
    path, params = bench_model(ctx)
    dtype = BENCH_TRL[ctx.device]["dtype"]
    model = load_causal_lm(path, dtype=getattr(torch, dtype), device=ctx.device).eval()
    d.update(params=params, dtype=dtype, prompt_len=decode.PROMPT_LEN, configs=[])
    if ctx.device == "cuda":  # a decode step reads every weight once: far above this is launch overhead
        d["h200_weight_read_floor_ms"] = round(params * model.dtype.itemsize / (H200_HBM_TB_S * 1e12) * 1e3, 3)
    for batch, new in BENCH_DECODE[ctx.device]["configs"]:
        if ctx.left() < 0:
            d["cut_by_budget"] = True
            break
        row = decode.throughput(model, batch, new, BENCH_DECODE[ctx.device]["runs"], eos=[])
        row.update(batch=batch, new_tokens=new, hf_ms_per_step=round(1e3 * batch / row["hf_tok_s"], 3),
                   plait_ms_per_step=round(1e3 * batch / row["plait_tok_s"], 3))
        row["gpu_busy_share"] = gpu_busy_share(model, batch, min(new, 32))
        d["configs"].append(row)
    expect(bool(d["configs"]) and all(r["plait_tok_s"] > 0 and r["hf_tok_s"] > 0 for r in d["configs"]),
           "no decode measurement")


def gpu_busy_share(model, batch: int, new: int) -> float:
    """Share of one plait generate call's wall time that the device spends in kernels (torch.profiler).
    Far below 1: the decode loop waits on kernel launches and the host, the case for CUDA graphs.
    0 on CPU, where there are no device kernels (the rehearsal runs the code path only)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from plait.workers.rollout_engine import SamplingParams, TransformersEngine
    engine = TransformersEngine(model, pad_token_id=0, eos_token_ids=[])
    prompts = torch.randint(3, 128, (batch, 16), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_new_tokens=new)
    engine.generate(prompts, params)  # warm-up
    start = time.perf_counter()
    engine.generate(prompts, params)  # ends in a host sync (the tokens it returns are read)
    wall_us = (time.perf_counter() - start) * 1e6  # timed without the profiler, which slows the host
    cuda = model.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        engine.generate(prompts, params)
    busy_us = sum(e.self_device_time_total for e in prof.key_averages())
    return round(busy_us / wall_us, 3)


def bench_vs_trl(ctx: Ctx, work: Path, d: dict) -> None:
    """bench/bench_vs_trl.py's plait and TRL workers, one run each, on the benchmark model."""
    import statistics
    from dataclasses import asdict
    import pyarrow as pa
    import pyarrow.parquet as pq
    import bench_vs_trl as vs
    from plait.data.dataset import PromptDataset, load_rows
    from plait.data.tasks import make_task_rows
    from plait.models import load_tokenizer
    path, params = bench_model(ctx)
    s = vs.Settings(**BENCH_TRL[ctx.device], device=ctx.device)
    data = work / "arithmetic_train.parquet"
    pq.write_table(pa.Table.from_pylist(make_task_rows("arithmetic", "train", s.data_rows, seed=0)), data)
    items = PromptDataset(load_rows(str(data)), load_tokenizer(path), max_prompt_length=32).items
    prompt_len = statistics.mean(len(it.prompt_ids) for it in items)
    rows = s.prompts * s.n
    # Model FLOPs both frameworks must spend per step (2N per token forward, 6N forward+backward;
    # attention's own FLOPs left out): generation over prompt and response, then one update.
    # plait's extra old-log-prob forward (2N per token) is not counted as useful work.
    flops = 8 * params * rows * (prompt_len + s.length)
    d.update(params=params, settings={**asdict(s), "tokens_per_step": s.tokens_per_step},
             mean_prompt_len=round(prompt_len, 1), model_flops_per_step=flops,
             mfu_peak=f"H200 bf16 dense {H200_BF16_DENSE_TFLOPS:.0f} TFLOP/s (datasheet)" if ctx.device == "cuda"
             else None)
    frameworks = ["plait"] + (["trl"] if importlib.util.find_spec("trl") else [])
    if "trl" not in frameworks:
        d["trl"] = {"error": "trl is not importable (carry its wheel: bench/gpu_run.sh fetch)"}
    for framework in frameworks:
        try:
            run = vs.run_worker(framework, path, str(data), s, str(work), framework)
        except Exception as err:  # the other framework still runs
            d[framework] = {"error": f"{type(err).__name__}: {str(err)[-2000:]}"}
            continue
        tflops = flops / run["median_step_s"] / 1e12
        d[framework] = {"tokens_per_s": run["tokens_per_s"], "median_step_s": run["median_step_s"],
                        "step_wall_s": run["step_wall_s"], "breakdown_s": run["breakdown_s"],
                        "setup_s": run["setup_s"], "model_tflop_s": round(tflops, 4),
                        "mfu": round(tflops / H200_BF16_DENSE_TFLOPS, 4) if ctx.device == "cuda" else None}
    if "tokens_per_s" in d["plait"] and "tokens_per_s" in d.get("trl", {}):
        d["plait_over_trl"] = round(d["plait"]["tokens_per_s"] / d["trl"]["tokens_per_s"], 2)
    expect(all("error" not in d.get(f, {"error": 1}) for f in ("plait", "trl")), "a framework did not run")


CHECKS = {
    "torch_memory_windows": torch_memory_windows,
    "torch_cuda_kernels": torch_cuda_kernels,
    "nsys_nvtx": nsys_nvtx,
    "torch_memory_oom": torch_memory_oom,
    **{f"mode_{m}": functools.partial(mode_window, mode=m) for m in (*LM_MODES, "diffusion")},
    "stage_peak_memory": stage_peak_memory,
    "oom_outside_window": oom_outside_window,
    "fsdp2_world": fsdp2_world,
    "profile_report": profile_report,
    "bench_vs_trl": bench_vs_trl,
    "bench_decode": bench_decode,
    "gpu_tests": gpu_tests,
    "nsys_cli": nsys_cli,
}


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run_check(ctx: Ctx, name: str) -> dict:
    if ctx.left() < 0:
        return {"check": name, "status": "not_run", "reason": "--budget-s spent before it could start"}
    work = ctx.root / name
    work.mkdir(parents=True)
    details: dict = {}
    warnings = Collect()
    logging.getLogger("plait").addHandler(warnings)
    start = time.time()
    try:
        CHECKS[name](ctx, work, details)
        status = "pass"
    except Skipped as why:
        status, details["skipped"] = "skipped", str(why)
    except Absent as why:
        status, details["absent"] = "absent", str(why)
    except BaseException as err:  # a failed check must not stop the others
        if isinstance(err, KeyboardInterrupt):
            raise
        status, details["error"] = "fail", f"{type(err).__name__}: {str(err)[-1000:]}"
        details["traceback"] = traceback.format_exc()[-2000:]
    finally:
        logging.getLogger("plait").removeHandler(warnings)
    return {"check": name, "status": status, "seconds": round(time.time() - start, 1),
            "plait_warnings": warnings.lines[:20], **details}


def environment(device: str) -> dict:
    import platform
    import torch
    import transformers
    from bench_vs_trl import _git_commit
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": device, "torch": torch.__version__, "cuda_version": torch.version.cuda,
           "transformers": transformers.__version__, "python": platform.python_version(),
           "plait_commit": _git_commit() or os.environ.get("PLAIT_COMMIT"),  # the device's copy has no .git
           "cpu_count": os.cpu_count(), "command": " ".join(sys.argv)}
    for package in ("trl", "datasets", "accelerate", "nvtx"):
        try:
            env[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            env[package] = None
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        smi = shutil.which("nvidia-smi")
        if smi:
            q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True)
            env["nvidia_smi"] = q.stdout.strip() or q.stderr.strip()
    return env


def write_summary(summary: dict, out: Path) -> None:
    text = json.dumps(summary, indent=1, default=str) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: the rehearsal, tiny sizes, CUDA-only checks skipped")
    parser.add_argument("--only", help=f"comma-separated checks to run, of: {', '.join(CHECKS)}")
    parser.add_argument("--budget-s", type=float, default=300.0, help="start no check after this many seconds")
    parser.add_argument("--work", help="keep the runs and artifacts in this folder (default: a removed temp folder)")
    parser.add_argument("--out", help="the results JSON (default bench/results/gpu_check_cuda.json on CUDA, "
                                      "bench/_work/gpu_check_cpu.json on CPU)")
    parser.add_argument("--fsdp-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.fsdp_worker:
        fsdp_worker(Path(args.fsdp_worker), args.device)
        return 0
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"unknown checks {unknown}; choose from {', '.join(CHECKS)}")
    default_out = BENCH / ("results/gpu_check_cuda.json" if args.device == "cuda" else "_work/gpu_check_cpu.json")
    out = Path(args.out or default_out)
    start = time.time()
    try:
        import torch
        torch.set_num_threads(1)  # the CPU rehearsal shares its cores; on a GPU the host thread count does not matter
        cuda = torch.cuda.is_available()
        import plait.driver  # noqa: F401  (transformers and the rest of plait's dependencies)
    except ImportError as err:
        print(f"gpu_check: cannot import torch or plait: {err}; pip install -e . (and its dependencies)",
              file=sys.stderr)
        write_summary({"environment": {"device": args.device}, "passed": None, "error": str(err), "checks": []}, out)
        return 2
    if args.device == "cuda" and not cuda:
        print("gpu_check: CUDA is not available here (torch.cuda.is_available() is False); nothing checked. "
              "Run it on a machine with a GPU, or rehearse with --device cpu.", file=sys.stderr)
        write_summary({"environment": environment("cpu"), "passed": None, "checks": []}, out)
        return 2
    root = Path(args.work or tempfile.mkdtemp(prefix="plait_gpu_check_")).resolve()
    ctx = Ctx(args.device, root, start + args.budget_s)
    summary = {"environment": environment(args.device), "budget_s": args.budget_s, "passed": None, "checks": []}
    try:
        for name in names:
            result = run_check(ctx, name)
            summary["checks"].append(result)
            summary["seconds"] = round(time.time() - start, 1)
            write_summary(summary, out)
            print(f"gpu_check: {name:<22} {result['status']:<8} {result.get('seconds', 0):>6.1f} s  "
                  f"{result.get('error', result.get('absent', result.get('skipped', '')))[:150]}", flush=True)
    finally:
        if not args.work:
            shutil.rmtree(root, ignore_errors=True)
    summary["passed"] = all(r["status"] != "fail" for r in summary["checks"])
    summary["counts"] = dict(collections.Counter(r["status"] for r in summary["checks"]))
    write_summary(summary, out)
    print(f"gpu_check: {summary['counts']} in {summary['seconds']} s; wrote {out}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
