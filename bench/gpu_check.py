"""The profiler's CUDA paths, checked through real tiny plait runs on a GPU machine (~1-2 minutes).

    pip install -e .          # torch with CUDA, transformers and nvtx must be importable
    python bench/gpu_check.py [--work DIR]

Each check runs on its own, records what it measured, and passes or fails:

    torch_memory_windows  tool=torch_memory, steps [1, 3], actor and rollout profiled, trainer.device=cuda:
                          one snapshot pickle per window that loads, holds allocation events and the stage
                          annotations, keeps <= stack_depth frames per event; a marker tensor allocated in
                          step 1 is in the first snapshot only and step 3's in the second only (history
                          cleared between windows); no allocator history is recorded after the run
    torch_cuda_kernels    tool=torch, step 2: the trace has CUDA kernel events and the stage names
    nsys_nvtx             tool=nsys, steps [1, 3]: the run works, NVTX ranges are pushed and popped per
                          stage with the stage names, and the CUDA profiler capture range is started and
                          stopped once per window (manifest records with path null)
    torch_memory_oom      tool=torch_memory, step 1, a reward that allocates 1 PiB on the GPU: the
                          OutOfMemoryError surfaces, <name>_oom.pickle was dumped, the window is incomplete
    nsys_cli              with the `nsys` CLI on PATH: `nsys profile --capture-range=cudaProfilerApi` of a
                          tiny run writes a .nsys-rep whose NVTX summary names the stages; skipped without it

The summary is printed as JSON and written to $OUT/gpu_check.json when OUT is set. Exit status:
0 every check passed (or was skipped), 1 a check failed, 2 nothing was checked (no CUDA, or plait
could not be imported). Artifacts are left in --work DIR when given, else in a removed temp folder.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

# The same tiny LM run as tests/conftest.py, on the GPU, without validation before step 3.
TINY = ["demo.model_size=xs", "demo.warmstart_steps=0", "data.train_size=64", "data.val_size=8",
        "data.train_batch_size=4", "data.max_response_length=6", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.logger=[]", "trainer.device=cuda"]
ACTOR_AND_ROLLOUT = ["actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.rollout.profiler.enable=true"]
STAGES = ("actor/update_actor", "actor/old_log_prob", "rollout/gen")
CALLS_PER_STEP = 4 * 4  # the reward is called once per response: 4 prompts x 4 samples

# A custom reward that allocates a (20 + step) MiB marker on the GPU at the first call of each step.
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
OOM_REWARD = '''
import torch
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    torch.empty(2**50, dtype=torch.uint8, device="cuda")  # 1 PiB: out of memory on any GPU
    return 0.0
'''


class Skipped(Exception):
    pass


def expect(ok: bool, message: str) -> None:
    if not ok:
        raise AssertionError(message)


def plait_run(work: Path, *overrides: str, raises: type | None = None) -> list[dict]:
    """A tiny plait run profiled into work/profile; returns its manifest records."""
    from plait import driver
    from plait.config import load_config
    from plait.profiler import read_manifest
    cfg = load_config(None, [*TINY, f"trainer.default_local_dir={work / 'run'}",
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
    return read_manifest(str(work / "profile"))


def reward(work: Path, source: str) -> list[str]:
    path = work / "reward.py"
    path.write_text(source)
    return [f"custom_reward_function.path={path}", "custom_reward_function.name=compute_score"]


def load_snapshot(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f)


def trace_events(snapshot: dict) -> list[dict]:
    return [e for trace in snapshot["device_traces"] for e in trace]


# -- the checks: each fills `d` with what it saw and raises on a failure --------------------------

def torch_memory_windows(work: Path, d: dict) -> None:
    import torch
    records = plait_run(work, "global_profiler.tool=torch_memory", "global_profiler.steps=[1,3]",
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


def torch_cuda_kernels(work: Path, d: dict) -> None:
    records = plait_run(work, "global_profiler.tool=torch", "global_profiler.steps=[2]", *ACTOR_AND_ROLLOUT)
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


def nsys_nvtx(work: Path, d: dict) -> None:
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
        records = plait_run(work, "global_profiler.tool=nsys", "global_profiler.steps=[1,3]", *ACTOR_AND_ROLLOUT)
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


def torch_memory_oom(work: Path, d: dict) -> None:
    import torch
    records = plait_run(work, "global_profiler.tool=torch_memory", "global_profiler.steps=[1]",
                        "actor_rollout_ref.actor.profiler.enable=true", *reward(work, OOM_REWARD),
                        raises=torch.cuda.OutOfMemoryError)
    d["manifest"] = [(r["path"], r["stage"], r["complete"]) for r in records]
    expect(sorted((r["path"], r["complete"]) for r in records) == [
        ("step1/actor_rank0.pickle", False), ("step1/actor_rank0_oom.pickle", False)],
        "expected the window's snapshot and an _oom snapshot, both incomplete")
    oom = load_snapshot(work / "profile" / "step1" / "actor_rank0_oom.pickle")
    d["oom_events"] = sum(e["action"] == "oom" for e in trace_events(oom))
    expect("segments" in oom, "the OOM snapshot does not load as an allocator snapshot")


def nsys_cli(work: Path, d: dict) -> None:
    nsys = shutil.which("nsys")
    if nsys is None:
        raise Skipped("no nsys CLI on PATH: NVTX ranges and the capture range were checked in-process (nsys_nvtx)")
    d["nsys_version"] = subprocess.run([nsys, "--version"], capture_output=True, text=True).stdout.strip()
    run = [*TINY, f"trainer.default_local_dir={work / 'run'}", f"global_profiler.save_path={work / 'profile'}",
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


CHECKS = [torch_memory_windows, torch_cuda_kernels, nsys_nvtx, torch_memory_oom, nsys_cli]


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def run_check(fn, work: Path) -> dict:
    work.mkdir(parents=True)
    details: dict = {}
    warnings = Collect()
    logging.getLogger("plait").addHandler(warnings)
    start = time.time()
    try:
        fn(work, details)
        status = "pass"
    except Skipped as why:
        status, details["skipped"] = "skipped", str(why)
    except BaseException as err:  # a failed check must not stop the others
        if isinstance(err, KeyboardInterrupt):
            raise
        status, details["error"] = "fail", f"{type(err).__name__}: {err}"
        details["traceback"] = traceback.format_exc()[-2000:]
    finally:
        logging.getLogger("plait").removeHandler(warnings)
    return {"check": fn.__name__, "status": status, "seconds": round(time.time() - start, 1),
            "plait_warnings": warnings.lines, **details}


def write_summary(summary: dict) -> None:
    text = json.dumps(summary, indent=2, default=str)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(text + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", help="keep the runs and artifacts in this folder (default: a removed temp folder)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError as err:
        cuda, torch = False, None
        print(f"gpu_check: cannot import torch: {err}", file=sys.stderr)
    if not cuda:
        print("gpu_check: CUDA is not available here (torch.cuda.is_available() is False); "
              "nothing checked. Run it on a machine with a GPU and a CUDA build of torch.", file=sys.stderr)
        write_summary({"cuda": False, "passed": None, "checks": []})
        return 2
    try:
        import plait.driver  # noqa: F401  (transformers and the rest of plait's dependencies)
    except ImportError as err:
        print(f"gpu_check: cannot import plait: {err}; pip install -e . (and its dependencies)", file=sys.stderr)
        write_summary({"cuda": True, "passed": None, "checks": [], "error": str(err)})
        return 2
    root = Path(args.work or tempfile.mkdtemp(prefix="plait_gpu_check_")).resolve()
    start = time.time()
    try:
        results = [run_check(fn, root / fn.__name__) for fn in CHECKS]
    finally:
        if not args.work:
            shutil.rmtree(root, ignore_errors=True)
    passed = all(r["status"] != "fail" for r in results)
    write_summary({"cuda": True, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "cuda_version": torch.version.cuda, "passed": passed, "seconds": round(time.time() - start, 1),
                   "checks": results})
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
