"""`plait profile report`: the merged trace, the page and the memory analysis, from real tiny runs.

- a sync run with torch windows on actor and rollout (local backend, one process);
- a fully_async run on Ray (driver, actor and rollout processes) with torch windows on both:
  every process's events on one clock, the rollouter's generate spans overlapping updates;
- a torch_memory window on CPU whose reward plants a known allocation: peak, stage and site found;
- a CUDA snapshot in torch's own format (checked by torch's memory viewer), and a real one on a GPU;
- the page in a real headless Chromium when one is installed.
"""

import gzip
import json
import os
import shutil
import subprocess

import pytest
import torch

from plait import cli, driver
from plait.profiler.analysis import memory as mem
from plait.profiler.analysis import build_report

torch.set_num_threads(1)
PROFILE_BOTH = ["trainer.test_freq=-1", "trainer.val_before_train=false", "global_profiler.tool=torch",
                "global_profiler.steps=[2]", "actor_rollout_ref.actor.profiler.enable=true",
                "actor_rollout_ref.rollout.profiler.enable=true"]
SECTIONS = ("id='summary'", "id='gantt'", "id='breakdown'", "id='windows'", "id='memory'", "id='learning'")
PLANTED_MIB = 8
PLANTED_REWARD = f'''
import torch
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    planted = torch.ones({PLANTED_MIB} * 2**20 // 4)  # freed on return: the window's peak
    return float(planted[0]) - 1.0
'''


def load_merged(out, name="timeline.json.gz") -> list[dict]:
    """A merged trace of the report: the run's timeline, or a window's ("step2.trace.json.gz")."""
    with gzip.open(os.path.join(out, "report", name)) as f:
        return json.loads(f.read())["traceEvents"]


def names(events, kind) -> dict[int, str]:
    return {e["pid"] if kind == "process_name" else (e["pid"], e["tid"]): e["args"]["name"]
            for e in events if e.get("ph") == "M" and e["name"] == kind}


def inside(inner: dict, outer: dict, slack_us: float = 2000) -> bool:
    return outer["ts"] - slack_us <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + slack_us


def test_report_of_a_sync_run(tmp_path, tiny_config, capsys):
    cfg = tiny_config(tmp_path, *PROFILE_BOTH, f"global_profiler.save_path={tmp_path}/profile")
    driver.build(cfg, progress=False).run()
    assert cli.main(["profile", "report", str(tmp_path)]) == 0  # finds tmp_path/profile itself
    assert "time by stage" in capsys.readouterr().out
    events = load_merged(tmp_path, "step2.trace.json.gz")
    assert set(names(events, "process_name").values()) == {"actor-rollout rank 0"}  # one process, torch named it
    assert {"trainer stages (MainThread)"} <= set(names(load_merged(tmp_path), "thread_name").values())
    lanes = names(events, "thread_name")
    assert "trainer stages (MainThread)" in lanes.values()
    stages = [e for e in events if e.get("cat") == "plait.stage"]
    step2 = next(e for e in stages if e["name"] == "step" and e["args"]["step"] == 2)
    assert step2["args"]["policy_version"] == 1
    # The window's worker ranges (torch's clock) sit inside the timeline's step 2 (plait's clock).
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(("actor/", "rollout/"))]
    assert {"actor/update_actor", "rollout/gen"} <= {e["name"] for e in ranges}
    assert all(inside(e, step2) and e["args"]["policy_version"] == 1 for e in ranges)
    page = open(tmp_path / "report" / "index.html").read()
    assert all(s in page for s in SECTIONS) and "<svg" in page and "aten::" in page
    assert "http" not in page.replace("http://www.w3.org/2000/svg", "")  # offline: nothing fetched
    # sync mode measures idle too: the trainer waits through gen, the rollout through the training stages
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    for r in records:
        busy = sum(v for k, v in r.items() if k.startswith("timing_s/")  # the train step's own stages
                   and k not in ("timing_s/step", "timing_s/testing", "timing_s/save_checkpoint"))
        assert abs(r["trainer/idle_ratio"] - r["timing_s/gen"] / busy) < 1e-6
        assert "rollouter/idle_ratio" not in r  # colocated: no rollouter exists to be idle
    assert "trainer/idle_ratio</td><td>mean" in page and "rollouter/idle_ratio" not in page  # in the summary box
    assert "wall time</td>" in page and "profiler</td><td>1 window cost" in page
    assert "s from the step&#x27;s start" in page  # the Gantt's x axis says what it counts


@pytest.mark.ray
def test_report_of_a_fully_async_run_on_ray(tmp_path, tiny_config, ray_up):
    overrides = ["trainer.backend=ray", "trainer.placement=separated", "trainer.ray.num_cpu_workers=1",
                 "trainer.ray.cpus_per_worker=0.5", "trainer.mode=fully_async",
                 "async_training.trigger_parameter_sync_step=2", "async_training.staleness_threshold=1",
                 # 3 steps: the queue bound (2 steps' samples) makes the rollouter generate step 3's
                 # samples while step 2 trains.
                 "trainer.total_training_steps=3", *PROFILE_BOTH, f"global_profiler.save_path={tmp_path}/profile"]
    lifecycle = driver.build(tiny_config(tmp_path, *overrides), progress=False)
    roles = lifecycle.trainer.roles
    actor_pid, rollout_pid = roles.actor.pids[0], roles.rollout.pids[0]
    lifecycle.run()
    build_report(str(tmp_path))
    events = load_merged(tmp_path, "step2.trace.json.gz") + load_merged(tmp_path)
    procs = names(events, "process_name")
    assert procs[actor_pid] == "actor rank 0" and procs[rollout_pid] == "rollout rank 0"
    assert procs[os.getpid()] == "driver"
    assert {"trainer stages (MainThread)", "rollout stages (plait-rollouter)"} <= set(names(events, "thread_name").values())
    stages = [e for e in events if e.get("cat") == "plait.stage"]
    updates = [e for e in stages if e["name"] == "update_actor" and e["pid"] == os.getpid()]
    generates = [e for e in stages if e["name"] == "gen" and e["args"]["role"] == "rollout" and e["pid"] == os.getpid()]
    assert any(g["ts"] < u["ts"] + u["dur"] and u["ts"] < g["ts"] + g["dur"] for g in generates for u in updates)
    # The actor process's ranges, on its own clock, fall inside the driver's update spans.
    actor_updates = [e for e in events if e["pid"] == actor_pid and e.get("name") == "actor/update_actor"]
    assert actor_updates and all(any(inside(a, u) for u in updates) for a in actor_updates)
    assert any(e["pid"] == rollout_pid and e.get("ph") == "X" for e in events)
    page = open(tmp_path / "report" / "index.html").read()
    assert all(s in page for s in SECTIONS) and "rollout (plait-rollouter)" in page and "rollouter/idle_ratio" in page


@pytest.fixture(scope="module")
def ray_up(tmp_path_factory):
    pytest.importorskip("ray")
    import ray
    from plait.backends import LEAN_RAY_ENV
    from plait.backends.ray import start_local_ray, stop_local_ray
    os.environ.update(LEAN_RAY_ENV)
    if ray.is_initialized():
        yield
        return
    link_dir = start_local_ray(str(tmp_path_factory.mktemp("ray")), num_cpus=4, object_store_memory_mb=128)
    yield
    stop_local_ray(link_dir)


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    """A 2-step run with a torch_memory window on step 2 whose reward allocates PLANTED_MIB."""
    from tests.conftest import TINY
    from plait.config import load_config
    out = tmp_path_factory.mktemp("planted")
    (out / "planted.py").write_text(PLANTED_REWARD)
    cfg = load_config(None, [*TINY, f"trainer.default_local_dir={out}", "trainer.total_training_steps=2",
                             "trainer.test_freq=-1", "global_profiler.tool=torch_memory", "global_profiler.steps=[2]",
                             f"global_profiler.save_path={out}/profile", "actor_rollout_ref.actor.profiler.enable=true",
                             f"custom_reward_function.path={out}/planted.py",
                             "reward.num_workers=0"])  # in the driver's process, where the profiler sees it
    driver.build(cfg, progress=False).run()
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA torch_memory writes snapshots (tested below)")
def test_memory_report_finds_a_planted_allocation(planted_run):
    text = build_report(str(planted_run))
    page = open(planted_run / "report" / "index.html").read()
    assert "window peak" in text and "in reward at" in text and "s into step 2 (" in text and "planted.py" in text
    assert "Counts CPU tensor allocations made inside the window" in page
    assert "The process&#x27;s own peak in these steps" in page
    assert "id='memory'" in page and "class=\"memory\"" in page and "compute_score" in page
    from plait.profiler import read_manifest
    from plait.profiler.analysis.traces import Clock, load_trace
    from plait.profiler.timeline import read_timeline
    record = read_manifest(str(planted_run / "profile"))[0]
    clock = Clock(int(record["start_time"]) * 10**9)
    trace = load_trace(str(planted_run / "profile" / record["path"]), record, clock)
    stages = [s for s in read_timeline(str(planted_run / "timeline.jsonl")) if s["role"] == "trainer"]
    r = mem.cpu_trace(trace.events, stages, origin_s=clock.origin_ns / 1e9)
    site, size = r.top_sites[0]
    assert r.peak_stage == "reward" and "planted.py" in site and "compute_score" in site
    assert size >= PLANTED_MIB * 2**20 and r.peak_bytes >= size
    assert r.growth["reward"] < PLANTED_MIB * 2**20  # freed before the stage ended


def snapshot_fixture(t0_us: int) -> dict:
    """A snapshot in the format of torch.cuda.memory._snapshot() (its documented TypedDicts):
    a 1 MiB block alive from before the history began, 4 MiB allocated and freed in "actor/update_actor",
    2 MiB allocated in "rollout/gen" and still alive at the dump."""
    def frames(name):
        return [{"filename": "/x/torch/nn/functional.py", "line": 10, "name": "linear"},
                {"filename": "/x/plait/workers/actor.py", "line": 42, "name": name}]
    mib = 2**20
    trace = [
        {"action": "segment_alloc", "addr": 0x1000000, "size": 20 * mib, "stream": 0, "time_us": t0_us + 100, "frames": frames("update")},
        {"action": "alloc", "addr": 0x1100000, "size": 4 * mib, "stream": 0, "time_us": t0_us + 200, "frames": frames("update")},
        {"action": "free_requested", "addr": 0x1100000, "size": 4 * mib, "stream": 0, "time_us": t0_us + 400, "frames": frames("update")},
        {"action": "free_completed", "addr": 0x1100000, "size": 4 * mib, "stream": 0, "time_us": t0_us + 401, "frames": frames("update")},
        {"action": "alloc", "addr": 0x1600000, "size": 2 * mib, "stream": 0, "time_us": t0_us + 700, "frames": frames("generate")},
    ]
    blocks = [{"address": 0x1000000, "size": mib, "requested_size": mib, "state": "active_allocated", "frames": frames("init")},
              {"address": 0x1600000, "size": 2 * mib, "requested_size": 2 * mib, "state": "active_allocated", "frames": frames("generate")},
              {"address": 0x1800000, "size": 17 * mib, "requested_size": 17 * mib, "state": "inactive", "frames": []}]
    segment = {"device": 0, "address": 0x1000000, "total_size": 20 * mib, "stream": 0, "segment_type": "large",
               "segment_pool_id": (0, 0), "allocated_size": 3 * mib, "active_size": 3 * mib, "blocks": blocks}
    annotations = [{"device": 0, "stage": "START", "name": "actor/update_actor", "time_us": t0_us + 150},
                   {"device": 0, "stage": "END", "name": "actor/update_actor", "time_us": t0_us + 500},
                   {"device": 0, "stage": "START", "name": "rollout/gen", "time_us": t0_us + 600},
                   {"device": 0, "stage": "END", "name": "rollout/gen", "time_us": t0_us + 800}]
    return {"segments": [segment], "device_traces": [trace], "external_annotations": annotations}


def test_cuda_snapshot_analysis_on_a_fixture_in_torchs_format():
    from torch.cuda import _memory_viz
    snapshot = snapshot_fixture(t0_us=1_700_000_000_000_000)
    assert "<html" in _memory_viz.trace_plot(snapshot).lower()  # torch's own viewer reads the fixture
    r = mem.cuda_snapshot(snapshot, mem.snapshot_stages(snapshot))
    mib = 2**20
    assert r.peak_bytes == 5 * mib and r.peak_stage == "actor/update_actor"
    assert r.top_sites == [("/x/plait/workers/actor.py(42): update", 4 * mib), ("/x/plait/workers/actor.py(42): init", mib)]
    assert r.growth == {"actor/update_actor": 0, "rollout/gen": 2 * mib}
    assert r.series[-1][1] == 3 * mib


@pytest.mark.gpu
def test_cuda_snapshot_analysis_on_a_real_snapshot():
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python")
    try:
        with torch.profiler.record_function("actor/planted"):
            planted = torch.ones(16 * 2**20 // 4, device="cuda")
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    r = mem.cuda_snapshot(snapshot, mem.snapshot_stages(snapshot), device=torch.cuda.current_device())
    assert r.peak_bytes >= planted.numel() * 4
    assert any("test_report.py" in site and size >= 16 * 2**20 for site, size in r.top_sites)


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)")
def test_the_page_renders_in_a_headless_browser(planted_run, tmp_path):
    build_report(str(planted_run))
    page = f"file://{planted_run}/report/index.html"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path}/profile"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page], capture_output=True, text=True, timeout=120).stdout
    assert dom.count("<svg") >= 4 and "id=\"gantt\"" in dom and "id=\"memory\"" in dom  # parsed by the browser
    shot = tmp_path / "page.png"
    subprocess.run([CHROMIUM, *flags, f"--screenshot={shot}", "--window-size=1400,2000", page],
                   capture_output=True, timeout=120)
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one


def test_top_ops_self_time_per_stage_on_hand_made_events():
    from plait.profiler.analysis.traces import Trace, op_totals, top_ops
    x = lambda cat, name, ts, dur, tid=1: {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}  # noqa: E731
    events = [x("user_annotation", "actor/update_actor", 0, 100), x("cpu_op", "aten::linear", 10, 50),
              x("cpu_op", "aten::mm", 20, 20), x("cpu_op", "aten::mm", 70, 5), x("cpu_op", "aten::add", 200, 5),
              x("kernel", "gemm", 30, 15, tid=99)]
    ops = top_ops(op_totals(Trace({"role": "actor", "rank": 0}, events, "actor rank 0")))
    assert ops["actor/update_actor"] == [("aten::linear", 30, 1), ("aten::mm", 25, 2), ("[gpu] gemm", 15, 1)]
    assert ops["(no stage)"] == [("aten::add", 5, 1)]


def test_gpu_rows_of_two_ranks_stay_apart_in_the_merged_trace(tmp_path):
    from plait.profiler.analysis.traces import Clock, MergedTrace, load_trace, read_merged

    def trace(host, rank):
        events = [{"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
                  {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 1000.0 + rank, "dur": 5},
                  {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": host, "tid": host, "ts": 1000.0, "dur": 9}]
        path = tmp_path / f"rank{rank}.json"
        path.write_text(json.dumps({"baseTimeNanoseconds": 10**18, "traceEvents": events}))
        return str(path), {"role": "actor", "rank": rank, "pid": host, "policy_version": 3, "steps": [1, 1]}
    merged = MergedTrace(str(tmp_path / "m.json.gz"), Clock(10**18))
    for host, rank in ((10, 0), (11, 1)):
        load_trace(*trace(host, rank), merged.clock, merged)
    merged.close()
    events = read_merged(str(tmp_path / "m.json.gz"))["traceEvents"]
    kernels = [e for e in events if e.get("name") == "gemm"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert len({k["pid"] for k in kernels}) == 2 and sorted(k["ts"] for k in kernels) == [1000, 1001]
    assert sorted(procs[k["pid"]] for k in kernels) == ["actor rank 0 (GPU 0)", "actor rank 1 (GPU 0)"]
    assert procs[10] == "actor rank 0" and procs[11] == "actor rank 1"


def test_the_process_memory_peak_is_the_first_stage_to_reach_it():
    """With freed memory kept the resident size is flat, so stages tie: the summary and the report both name
    the first (memory.process_peak), not whichever sorts last."""
    records = [{"step": 1, "memory/update_actor/peak_rss_gb": 2.0, "memory/step/peak_rss_gb": 9.0},
               {"step": 2, "memory/gen/peak_rss_gb": 2.0, "memory/save_checkpoint/peak_rss_gb": 2.0, "log": True}]
    assert mem.process_peak(records) == {"gb": 2.0, "metric": "memory/update_actor/peak_rss_gb",
                                         "stage": "update_actor", "step": 1, "tied": ["gen", "save_checkpoint"]}
    assert mem.process_peak([{"step": 1, "perf/mfu/actor": 0.5}]) is None


def test_a_tied_memory_peak_says_the_stage_named_is_only_the_first():
    """issue 52: a tie named one stage as if it alone held the peak."""
    tied = mem.process_peak([{"step": 1, "memory/gen/peak_rss_gb": 2.0, "memory/update_actor/peak_rss_gb": 2.0},
                             {"step": 2, "memory/reward/peak_rss_gb": 2.0, "memory/adv/peak_rss_gb": 1.0}])
    assert mem.peak_text(tied) == ("2 GB in stage gen at step 1 (memory/gen/peak_rss_gb); reward, update_actor reached "
                                   "the same peak, within 1 % (the first is named: a held resident size, not one stage's)")
    alone = mem.process_peak([{"step": 1, "memory/gen/peak_rss_gb": 1.0, "memory/update_actor/peak_rss_gb": 2.0}])
    assert mem.peak_text(alone) == "2 GB in stage update_actor at step 1 (memory/update_actor/peak_rss_gb)"


def test_a_peak_that_creeps_by_pages_names_the_same_stage_in_identical_runs():
    """issue 52: the peak named an arbitrary stage when stages tie: a held resident size creeps by a few pages
    from stage to stage, so the highest was whichever crept last. Peaks within 1 % tie: the earliest is named
    whichever of them is a page higher, with the highest value."""
    run_a = [{"step": 1, "memory/gen/peak_rss_gb": 2.000, "memory/update_actor/peak_rss_gb": 2.004},
             {"step": 2, "memory/gen/peak_rss_gb": 2.008, "memory/update_actor/peak_rss_gb": 2.006}]
    run_b = [{"step": 1, "memory/gen/peak_rss_gb": 2.002, "memory/update_actor/peak_rss_gb": 2.009},
             {"step": 2, "memory/gen/peak_rss_gb": 2.001, "memory/update_actor/peak_rss_gb": 2.003}]
    a, b = mem.process_peak(run_a), mem.process_peak(run_b)
    assert (a["stage"], a["step"], a["gb"]) == ("gen", 1, 2.008) and (b["stage"], b["step"], b["gb"]) == ("gen", 1, 2.009)
    assert a["tied"] == b["tied"] == ["update_actor"]
    grew = mem.process_peak([{"step": 1, "memory/gen/peak_rss_gb": 2.0, "memory/update_actor/peak_rss_gb": 2.5}])
    assert (grew["stage"], grew["tied"]) == ("update_actor", [])  # 25 % more is a stage's own peak

def test_a_profiler_windows_own_memory_is_not_the_runs_peak():
    """issue 52: a torch_memory window's own recording became the run's peak. Its steps are left out while
    another step has a peak, and its higher peak is named as the window's; a run profiled on every step says so;
    a peak after a window above the one before it names that one too (what a window frees can stay resident)."""
    records = [{"step": 1, "memory/update_actor/peak_rss_gb": 1.5}, {"step": 2, "memory/update_actor/peak_rss_gb": 3.0},
               {"step": 3, "memory/gen/peak_rss_gb": 1.5, "memory/update_actor/peak_rss_gb": 1.2}]
    peak = mem.process_peak(records, {2})
    assert (peak["gb"], peak["stage"], peak["step"]) == (1.5, "update_actor", 1) and peak["tied"] == ["gen"]
    assert peak["window"] == {"gb": 3.0, "stage": "update_actor", "step": 2} and "before_windows" not in peak
    assert mem.peak_text(peak).endswith("; a profiler window reached 3 GB in stage update_actor at step 2, its own "
                                        "recording's memory included (left out of the run's peak)")
    assert "window" not in mem.process_peak(records, {1})  # a window below the run's peak is not news
    every = mem.process_peak(records[:2], {1, 2})
    assert every["step"] == 2 and mem.peak_text(every).endswith("inside a profiler window (every step was "
                                                                "profiled: its recording's memory is in it)")
    kept = mem.process_peak([{"step": 1, "memory/gen/peak_rss_gb": 0.51}, {"step": 2, "memory/gen/peak_rss_gb": 0.9},
                             {"step": 3, "memory/gen/peak_rss_gb": 0.64}], {2})
    assert (kept["gb"], kept["step"], kept["before_windows"]) == (0.64, 3, {"gb": 0.51, "stage": "gen", "step": 1})
    assert "; before the first profiler window it was 0.51 GB (stage gen at step 1): memory a window frees can " \
           "stay resident after it" in mem.peak_text(kept)


def test_the_run_summary_leaves_a_windows_steps_out_of_its_memory_peak(tmp_path):
    """The end-of-run summary reads the windows from the timeline (profiler_start .. profiler_stop)."""
    from plait.trainers.summary import RunClock, summarise_run
    spans = [{"step": 1, "role": "trainer", "stage": "step", "start": 0.0, "end": 1.0},
             {"step": 2, "role": "trainer", "stage": "profiler_start", "start": 1.0, "end": 1.1},
             {"step": 2, "role": "trainer", "stage": "step", "start": 1.1, "end": 2.0},
             {"step": 2, "role": "trainer", "stage": "profiler_stop", "start": 2.0, "end": 2.5},
             {"step": 3, "role": "trainer", "stage": "step", "start": 2.5, "end": 3.5}]
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps({"pid": 1, "thread": "MainThread", "tid": 1,
                                                                 "version": 0, **s}) + "\n" for s in spans))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": n, "timing_s/step": 1.0,
                                                                "memory/update_actor/peak_rss_gb": gb}) + "\n"
                                                    for n, gb in ((1, 1.0), (2, 3.0), (3, 1.2))))
    summarise_run(str(tmp_path), str(tmp_path / "metrics.jsonl"), None, None, {}, 1, 3, RunClock(), 0.6, "done")
    peak = json.loads((tmp_path / "summary.json").read_text())["memory_peak"]
    assert (peak["gb"], peak["step"], peak["window"]["step"]) == (1.2, 3, 2)
