"""The merged traces keep Perfetto's rules, checked structurally on real runs and on a CUDA trace fixture:

- sync, fully_async (local backend, a rollouter thread whose generate began before the window) and
  torch_memory runs: every merged trace has 0 slices that start inside another on their thread and end
  after it, 0 flow ids whose arrows touch two sources, and 0 operators left in "(no stage)" (the
  rollouter's included: a window that cut its generate charges them to the timeline's `gen`);
- the 2-rank Ray run is tests/backends/test_ray_ranks.py;
- GPU kernels are charged to the CPU operator that launched them through the correlation id, on a trace in
  the format Kineto writes (tests/fixtures/kineto: no GPU was lent to this work, so not a real CUDA run);
- integer µs from one origin keep nesting that wall-clock floats lose.
"""

import json
import os
from collections import defaultdict

import pytest

from plait import driver
from plait.profiler.analysis import build_report
from plait.profiler.analysis.inputs import locate
from plait.profiler.analysis.traces import (NO_STAGE, Clock, MergedTrace, Trace, load_trace, nesting_violations,
                                            op_totals, origin_of, read_merged, timeline_lanes)

QUIET = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.total_training_steps=3"]
BOTH = ["global_profiler.tool=torch", "global_profiler.steps=[2]", "actor_rollout_ref.actor.profiler.enable=true",
        "actor_rollout_ref.rollout.profiler.enable=true"]
RUNS = {
    "sync": BOTH,
    "fully_async": [*BOTH, "trainer.mode=fully_async", "trainer.placement=separated", "data.max_response_length=24",
                    "actor_rollout_ref.rollout.ignore_eos=true", "async_training.staleness_threshold=1"],
    "torch_memory": ["global_profiler.tool=torch_memory", "global_profiler.steps=[2]",
                     "actor_rollout_ref.actor.profiler.enable=true"],
}
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "kineto", "cuda_trace.json")


def shared_flow_ids(events: list[dict]) -> int:
    """Flow ids whose events lie in two sources (a source: one process and its GPU rows, "<role> rank <r>")."""
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    sources = defaultdict(set)
    for e in events:
        if e.get("ph") in ("s", "t", "f"):
            sources[e["id"]].add(procs.get(e["pid"], str(e["pid"])).split(" (")[0])
    return sum(1 for s in sources.values() if len(s) > 1)


@pytest.mark.parametrize("mode", list(RUNS))
def test_merged_traces_nest_keep_flows_apart_and_leave_no_op_without_a_stage(mode, tmp_path, tiny_config):
    driver.build(tiny_config(tmp_path, *QUIET, *RUNS[mode]), progress=False).run()
    build_report(str(tmp_path))
    merged = sorted(n for n in os.listdir(tmp_path / "report") if n.endswith(".json.gz"))
    assert merged == ["step2.trace.json.gz", "timeline.json.gz"]
    flows = 0
    for name in merged:
        events = read_merged(str(tmp_path / "report" / name))["traceEvents"]
        assert all(isinstance(e["ts"], int) and isinstance(e.get("dur", 0), int) for e in events if "ts" in e)
        assert nesting_violations(events) == 0, name
        assert shared_flow_ids(events) == 0, name
        flows += sum(1 for e in events if e.get("ph") == "s")
    assert flows > 0 or mode == "torch_memory"  # forward-backward arrows of the update
    inp = locate(str(tmp_path))
    clock = Clock(origin_of(inp.spans, inp.manifest))
    lanes = timeline_lanes(inp.spans, clock)
    rollouter = {(s["pid"], s["tid"]) for s in inp.spans if s["role"] == "rollout"}
    [record] = inp.manifest
    trace = load_trace(os.path.join(inp.profile_dir, record["path"]), record, clock)
    totals = op_totals(trace, lanes)
    assert NO_STAGE not in totals, sorted(totals)
    if mode == "fully_async":  # the rollouter's thread: its ops are in the rollout's stages (on a loaded machine
        # it may not have generated inside the window at all: then it has no ops there)
        own = op_totals(Trace(record, [e for e in trace.events if (e["pid"], e["tid"]) in rollouter], "r"), lanes)
        assert all(stage.startswith("rollout/") for stage in own), sorted(own)


def test_gpu_kernels_are_charged_to_the_operator_that_launched_them(tmp_path):
    """On the Kineto-format fixture: the add's kernel runs after the update's range, while the CPU is in
    the rollout's; by its correlation id it is the update's (by its start time it would be the rollout's)."""
    record = {"role": "actor", "rank": 0, "pid": 4242, "policy_version": 1, "steps": [1, 1]}
    clock = Clock(1_790_000_000_000_000_000)
    totals = op_totals(load_trace(FIXTURE, record, clock))
    update, gen = totals["actor/update_actor"], totals["rollout/gen"]
    assert update["[gpu] ampere_sgemm_64x64_nn (from aten::mm)"] == [300, 1]
    add = "[gpu] void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>> (from aten::add)"
    assert update[add] == [40, 1] and not any("elementwise" in op for op in gen)
    assert gen["[gpu] Memcpy HtoD (Pageable -> Device) (from aten::copy_)"] == [15, 1]
    assert not any("cudaLaunchKernel" in op for ops in totals.values() for op in ops)  # a launch is not an operator


def test_two_ranks_of_the_fixture_merge_into_one_trace_that_keeps_their_rows_and_arrows_apart(tmp_path):
    merged = MergedTrace(str(tmp_path / "m.json.gz"), Clock(1_790_000_000_000_000_000))
    for rank, host in ((0, 4242), (1, 4343)):
        trace = json.load(open(FIXTURE))
        for e in trace["traceEvents"]:
            e["pid"] = host if e.get("pid") == 4242 else e.get("pid")
            e["tid"] = host if e.get("tid") == 4242 else e.get("tid")
        path = tmp_path / f"rank{rank}.json"
        path.write_text(json.dumps(trace))
        load_trace(str(path), {"role": "actor", "rank": rank, "pid": host, "policy_version": 1, "steps": [1, 1]},
                   merged.clock, merged)
    merged.close()
    events = read_merged(str(tmp_path / "m.json.gz"))["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    assert {"actor rank 0 (GPU 0)", "actor rank 1 (GPU 0)", "actor rank 0", "actor rank 1"} <= set(procs.values())
    assert nesting_violations(events) == 0 and shared_flow_ids(events) == 0
    assert len({e["id"] for e in events if e.get("cat") == "ac2g"}) == 6  # 3 arrows per rank, none merged
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert len({e["pid"] for e in kernels}) == 2


def test_integer_microseconds_from_one_origin_keep_what_wall_clock_floats_lose(tmp_path):
    """A parent and a child 0.05 µs apart at each end, a trace based 1.8e15 µs after the epoch: as wall-clock
    floats (the old merge) the child ends after its parent; on the report's clock it nests."""
    base = 1_796_304_555_000_000_000
    parent = {"ph": "X", "cat": "cpu_op", "name": "parent", "pid": 1, "tid": 1, "ts": 5447539405468.08, "dur": 10.0}
    child = {**parent, "name": "child", "ts": 5447539405468.13, "dur": 9.9}
    floats = [{**e, "ts": base / 1000 + e["ts"]} for e in (parent, child)]
    assert floats[1]["ts"] + floats[1]["dur"] > floats[0]["ts"] + floats[0]["dur"]  # the bug: 0.25 µs float spacing
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"baseTimeNanoseconds": base, "traceEvents": [parent, child]}))
    events = load_trace(str(path), {"role": "a", "rank": 0, "pid": 1, "policy_version": 0, "steps": [1, 1]},
                        Clock(base + 5_447_539_000_000_000_000)).events
    assert nesting_violations(events) == 0 and all(isinstance(e["ts"], int) for e in events)


def test_overlapping_timeline_spans_of_one_lane_get_lanes_of_their_own(tmp_path):
    """Agent loops' tool calls of several rows overlap on one thread: each gets a sub-lane that nests."""
    span = {"step": 1, "role": "rollout", "stage": "tool_calls", "pid": 5, "thread": "MainThread", "version": 0}
    spans = [{**span, "start": 10.0, "end": 12.0}, {**span, "start": 11.0, "end": 13.0}, {**span, "start": 11.5, "end": 11.7}]
    merged = MergedTrace(str(tmp_path / "m.json.gz"), Clock(0))
    merged.spans(spans, {})
    merged.close()
    events = read_merged(str(tmp_path / "m.json.gz"))["traceEvents"]
    assert nesting_violations(events) == 0 and len({e["tid"] for e in events if e.get("ph") == "X"}) == 2


def test_a_merged_trace_labels_each_process_with_its_roles_and_ranks_and_says_its_one_rank(tmp_path):
    """HTA read every merged trace as rank 0 (no `distributedInfo`); a process running several roles (the
    local backend's one process) was named after one of them. One rank's window: its rank in the header, and
    every process labelled with each role and rank it ran."""
    span = {"step": 1, "stage": "update_actor", "pid": 4242, "thread": "MainThread", "version": 0, "start": 1.0, "end": 2.0}
    merged = MergedTrace(str(tmp_path / "m.json.gz"), Clock(1_790_000_000_000_000_000), rank=1)
    merged.spans([{**span, "role": "trainer"}, {**span, "role": "actor", "rank": 1}], {4242: "actor rank 1"})
    load_trace(FIXTURE, {"role": "actor", "rank": 1, "pid": 4242, "policy_version": 1, "steps": [1, 1]}, merged.clock, merged)
    merged.close()
    trace = read_merged(str(tmp_path / "m.json.gz"))
    assert trace["distributedInfo"] == {"rank": 1}
    labels = {e["pid"]: e["args"]["labels"] for e in trace["traceEvents"] if e.get("ph") == "M" and e["name"] == "process_labels"}
    assert labels[4242] == "trainer, actor rank 1"
    several = MergedTrace(str(tmp_path / "n.json.gz"), Clock(0))
    several.close()
    assert "distributedInfo" not in read_merged(str(tmp_path / "n.json.gz"))
