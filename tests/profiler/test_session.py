"""ProfilerSession with each tool that runs here, around a real tiny training step.

Artifacts are checked by loading them: traces are gzipped Chrome JSON that must name the stages,
memory artifacts must show allocations. GPU-only paths are marked `gpu` and skip without CUDA.
"""

import gzip
import json
import logging
import os
import pickle

import pytest
import torch

from plait.configtree import ConfigError, build
from plait.profiler import NULL_RANGE, GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig

torch.set_num_threads(1)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU artifact of torch_memory")


def role(enable=True, contents=(), discrete=False, **kw):
    return build(RoleProfilerConfig, {"enable": enable, "tool_config": {"torch": {
        "contents": list(contents), "discrete": discrete}}, **kw})


def session(tmp_path, tool, roles, rank=0, world_size=1, **cfg):
    g = GlobalProfilerConfig(tool=tool, steps=[1], save_path=str(tmp_path / "profile"), **cfg)
    return ProfilerSession(g, roles, rank, world_size)


class Workload:
    """A two-layer MLP trained by the "actor", evaluated by the "ref"."""

    def __init__(self, device="cpu"):
        torch.manual_seed(0)
        self.device = device
        self.model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def step(self, s: ProfilerSession, raise_in_update=False):
        before = self.model[0].weight.detach().clone()
        with s.for_role("actor").annotate("update_actor"):
            loss = self.model(torch.randn(16, 32, device=self.device)).pow(2).mean()  # []
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            if raise_in_update:
                raise RuntimeError("reward function failed")
        if "ref" in s._handles:
            with s.for_role("ref").annotate("compute_ref_log_prob"), torch.no_grad():
                self.model(torch.randn(16, 32, device=self.device))
        assert not torch.equal(before, self.model[0].weight)


def events(path):
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def names(path):
    return {e.get("name") for e in events(path)}


def files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def test_torch_window_is_one_trace_naming_every_stage(tmp_path):
    s = session(tmp_path, "torch", {"actor": role(), "ref": role(enable=False)})
    work = Workload()
    work.step(s)  # outside any window: nothing written
    assert not (tmp_path / "profile").exists()
    s.start(2, 2, version=1)
    work.step(s)
    records = s.stop()
    assert [(r["steps"], r["role"], r["stage"], r["rank"], r["tool"], r["path"], r["policy_version"], r["complete"])
            for r in records] == [([2, 2], "actor", None, 0, "torch", "step2/actor_rank0.pt.trace.json.gz", 1, True)]
    assert records[0]["pid"] == os.getpid() and records[0]["start_time"] <= records[0]["end_time"]
    assert files(tmp_path / "profile") == ["step2/actor_rank0.pt.trace.json.gz"]
    # the ref is not profiled on its own, but its stage is named inside the shared collection
    assert {"actor/update_actor", "ref/compute_ref_log_prob"} <= names(tmp_path / "profile" / records[0]["path"])
    assert not any(e.get("name") == "[memory]" for e in events(tmp_path / "profile" / records[0]["path"]))


def test_annotate_outside_a_window_is_the_shared_null_range(tmp_path):
    s = session(tmp_path, "torch", {"actor": role(), "ref": role(enable=False)})
    actor, ref = s.for_role("actor"), s.for_role("ref")
    assert actor.annotate("update_actor") is NULL_RANGE and ref.annotate("x") is NULL_RANGE
    assert not s.active
    s.start(1, 1, version=0)
    assert s.active and actor.annotate("update_actor") is not NULL_RANGE
    s.stop()
    assert actor.annotate("update_actor") is NULL_RANGE and not s.active
    assert s.stop() == []  # a second stop has nothing to close
    off = session(tmp_path, None, {"actor": role()})
    off.start(1, 1, version=0)
    assert not off.active and off.for_role("actor").annotate("x") is NULL_RANGE and off.stop() == []


def test_discrete_gives_one_trace_per_stage_named_by_role_and_stage(tmp_path):
    s = session(tmp_path, "torch", {"actor": role(discrete=True), "ref": role(discrete=True)})
    work = Workload()
    s.start(2, 3, version=1)
    work.step(s)
    work.step(s)
    records = s.stop()
    expected = ["step2-3/actor_rank0_update_actor-2.pt.trace.json.gz", "step2-3/actor_rank0_update_actor.pt.trace.json.gz",
                "step2-3/ref_rank0_compute_ref_log_prob-2.pt.trace.json.gz",
                "step2-3/ref_rank0_compute_ref_log_prob.pt.trace.json.gz"]
    assert files(tmp_path / "profile") == expected
    assert sorted(r["path"] for r in records) == expected
    assert [(r["role"], r["stage"]) for r in records] == [
        ("actor", "update_actor"), ("ref", "compute_ref_log_prob"), ("actor", "update_actor-2"),
        ("ref", "compute_ref_log_prob-2")]
    for r in records:
        found = names(tmp_path / "profile" / r["path"])
        assert f"{r['role']}/{r['stage'].split('-')[0]}" in found
        assert len({"actor/update_actor", "ref/compute_ref_log_prob"} & found) == 1


def test_discrete_stage_that_raises_runs_once_and_its_trace_is_written(tmp_path):
    s = session(tmp_path, "torch", {"actor": role(discrete=True)})
    work = Workload()
    s.start(1, 1, version=0)
    with pytest.raises(RuntimeError, match="reward function failed"):
        work.step(s, raise_in_update=True)
    records = s.stop(complete=False)
    assert [(r["stage"], r["complete"]) for r in records] == [("update_actor", False)]
    assert "actor/update_actor" in names(tmp_path / "profile" / records[0]["path"])


def test_contents_memory_shapes_stack(tmp_path):
    s = session(tmp_path, "torch", {"actor": role(contents=["memory", "shapes", "stack"])})
    s.start(1, 1, version=0)
    Workload().step(s)
    evs = events(tmp_path / "profile" / s.stop()[0]["path"])
    assert any(e.get("name") == "[memory]" and e["args"]["Bytes"] > 0 for e in evs)
    assert max(e["args"]["bytes"] for e in evs if e.get("name") == "memory allocated (cpu)") > 0
    assert any("Input Dims" in e.get("args", {}) for e in evs)
    assert any(e.get("cat") == "python_function" for e in evs)


@cpu_only
def test_torch_memory_on_cpu_writes_allocations_and_stages(tmp_path):
    s = session(tmp_path, "torch_memory", {"actor": role(), "ref": role()})
    work = Workload()
    s.start(1, 1, version=0)
    work.step(s)
    records = s.stop()
    assert [(r["role"], r["tool"], r["path"]) for r in records] == [
        ("actor-ref", "torch_memory", "step1/actor-ref_rank0.pt.trace.json.gz")]
    evs = events(tmp_path / "profile" / records[0]["path"])
    allocs = [e["args"]["Bytes"] for e in evs if e.get("name") == "[memory]"]
    assert len(allocs) > 10 and max(allocs) >= 64 * 32 * 4  # the first Linear's weight or its grad
    assert max(e["args"]["bytes"] for e in evs if e.get("ph") == "C") > 0
    assert {"actor/update_actor", "ref/compute_ref_log_prob"} <= {e.get("name") for e in evs}


def test_colocated_roles_share_one_artifact_named_in_role_order(tmp_path):
    s = session(tmp_path, "torch", {"critic": role(), "ref": role(), "rollout": role(enable=False), "actor": role()})
    assert s.name == "actor-ref-critic"
    s.start(1, 1, version=0)
    assert [r["path"] for r in s.stop()] == ["step1/actor-ref-critic_rank0.pt.trace.json.gz"]


def test_rank_selection(tmp_path):
    off = session(tmp_path, "torch", {"actor": role()}, rank=1, world_size=2)  # default: rank 0 only
    off.start(1, 1, version=0)
    assert off.name == "" and not off.active and off.stop() == []
    assert session(tmp_path, "torch", {"actor": role(ranks=[1])}, rank=1, world_size=2).name == "actor"
    assert session(tmp_path, "torch", {"actor": role(ranks=[1])}, rank=0, world_size=2).name == ""
    assert session(tmp_path, "torch", {"actor": role(all_ranks=True)}, rank=3, world_size=4).name == "actor"
    assert not (tmp_path / "profile").exists()


def test_ranks_beyond_the_world_warn_and_profile_the_rest(tmp_path, caplog):
    # verl's ranks=[0,4] in a script shrunk to 2 workers: a warning naming rank 4, rank 0 still profiled
    with caplog.at_level("WARNING"):
        s = session(tmp_path, "torch", {"actor": role(ranks=[0, 4])}, rank=0, world_size=2)
    assert s.name == "actor"
    assert "rank(s) [4] do not exist at world size 2" in caplog.text
    assert session(tmp_path, "torch", {"actor": role(ranks=[4])}, rank=0, world_size=2).name == ""


def test_colocated_roles_must_agree_on_discrete(tmp_path):
    with pytest.raises(ConfigError, match="share one collection"):
        session(tmp_path, "torch", {"actor": role(discrete=True), "ref": role()})
    session(tmp_path, "torch", {"actor": role(discrete=True), "ref": role(enable=False)})  # only profiled roles count


def test_unknown_role_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="not hosted"):
        session(tmp_path, "torch", {"actor": role()}).for_role("critic")


def test_export_failure_is_reported_once_and_training_continues(tmp_path, caplog):
    s = session(tmp_path, "torch", {"actor": role(discrete=True)})
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "step1").write_text("a file where the step folder should be")
    work = Workload()
    s.start(1, 1, version=0)
    with caplog.at_level(logging.WARNING, logger="plait.profiler"):
        work.step(s)
        work.step(s)
    records = s.stop()
    assert [(r["stage"], r["path"], r["complete"]) for r in records] == [
        ("update_actor", None, False), ("update_actor-2", None, False)]
    assert len(caplog.records) == 1 and "marked incomplete" in caplog.records[0].getMessage()


def test_another_running_profiler_is_refused_not_crashed_into(tmp_path, caplog):
    s = session(tmp_path, "torch", {"actor": role()})
    work = Workload()
    outer = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    outer.start()
    try:
        with caplog.at_level(logging.WARNING, logger="plait.profiler"):
            s.start(1, 1, version=0)
            assert s.for_role("actor").annotate("x") is NULL_RANGE  # not collecting
            work.step(s)
            records = s.stop()
    finally:
        outer.stop()
    assert [(r["path"], r["complete"]) for r in records] == [(None, False)]
    assert "already running" in caplog.records[0].getMessage()


def test_stop_incomplete_still_flushes_the_trace(tmp_path):
    s = session(tmp_path, "torch", {"actor": role()})
    s.start(4, 6, version=3)
    Workload().step(s)
    records = s.stop(complete=False)
    assert [(r["steps"], r["complete"]) for r in records] == [([4, 6], False)]
    assert "actor/update_actor" in names(tmp_path / "profile" / records[0]["path"])


# -- GPU-only paths ------------------------------------------------------------------------------


@gpu
@needs_cuda
def test_torch_memory_cuda_snapshot_per_window_cleared_between_windows(tmp_path):
    s = session(tmp_path, "torch_memory", {"actor": role()},
                global_tool_config={"torch_memory": {"trace_alloc_max_entries": 1000, "stack_depth": 4}})
    work = Workload("cuda")
    sizes = {}
    for first, mib in [(1, 7), (2, 9)]:
        s.start(first, first, version=first - 1)
        with s.for_role("actor").annotate("marker"):
            keep = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
        work.step(s)
        del keep
        [record] = s.stop()
        with open(tmp_path / "profile" / record["path"], "rb") as f:
            snap = pickle.load(f)
        trace = [e for t in snap["device_traces"] for e in t]
        sizes[first] = {e["size"] for e in trace if e["action"] == "alloc"}
        assert all(len(e.get("frames", [])) <= 4 for e in trace)
        assert "actor/marker" in str(snap["external_annotations"])  # stage ranges are annotated
    assert 7 * 2**20 in sizes[1] and 7 * 2**20 not in sizes[2] and 9 * 2**20 in sizes[2]
    assert not any(torch.cuda.memory._snapshot()["device_traces"])  # no history outside windows


@gpu
@needs_cuda
def test_torch_memory_cuda_oom_dumps_a_snapshot(tmp_path):
    s = session(tmp_path, "torch_memory", {"actor": role()})
    s.start(1, 1, version=0)
    with pytest.raises(torch.OutOfMemoryError):
        with s.for_role("actor").annotate("oom"):
            torch.empty(2**50, dtype=torch.uint8, device="cuda")
    records = s.stop(complete=False)
    assert sorted(r["stage"] or "" for r in records) == ["", "oom"]
    for r in records:
        with open(tmp_path / "profile" / r["path"], "rb") as f:
            assert "segments" in pickle.load(f)


@gpu
@needs_cuda
def test_torch_trace_has_cuda_kernels(tmp_path):
    s = session(tmp_path, "torch", {"actor": role()})
    s.start(1, 1, version=0)
    Workload("cuda").step(s)
    evs = events(tmp_path / "profile" / s.stop()[0]["path"])
    assert any(e.get("cat") == "kernel" for e in evs)


@gpu
@needs_cuda
def test_nsys_window_runs_and_records_the_capture_range(tmp_path):
    pytest.importorskip("nvtx")
    s = session(tmp_path, "nsys", {"actor": role()})
    s.start(1, 1, version=0)
    Workload("cuda").step(s)
    assert [(r["path"], r["complete"]) for r in s.stop()] == [(None, True)]


def _cuda_snapshot(tmp_path, **memory_cfg):
    from plait.profiler import GlobalToolConfig, TorchMemoryToolConfig
    s = session(tmp_path, "torch_memory", {"actor": role()},
                global_tool_config=GlobalToolConfig(torch_memory=TorchMemoryToolConfig(**memory_cfg)))
    s.start(1, 1, 0)
    with s.for_role("actor").annotate("update_actor"):
        x = torch.ones(1 << 20, device="cuda")
        del x
    (record,) = s.stop()
    with open(tmp_path / "profile" / record["path"], "rb") as f:
        return pickle.load(f)


@gpu
@needs_cuda
def test_torch_memory_context_and_stacks_change_what_is_recorded(tmp_path):
    """verl's `context` and `stacks`: frees carry stacks only with context=all; C++ frames only with stacks=all."""
    def events(snapshot, action):
        return [e for trace in snapshot["device_traces"] for e in trace if e["action"] == action]
    every = _cuda_snapshot(tmp_path / "all", context="all", stacks="all")
    allocs_only = _cuda_snapshot(tmp_path / "alloc", context="alloc", stacks="python")
    assert any(e["frames"] for e in events(every, "free_requested"))
    assert not any(e["frames"] for e in events(allocs_only, "free_requested"))
    frames = lambda snap: [f["filename"] for e in events(snap, "alloc") for f in e["frames"]]  # noqa: E731
    assert any(not name.endswith(".py") for name in frames(every))  # C++ frames recorded
    assert frames(allocs_only) and all(name.endswith(".py") for name in frames(allocs_only))
