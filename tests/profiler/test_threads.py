"""The torch tool with stages on two threads, as an async mode's rollout thread runs them.

Before: the window's collector recorded only the driver thread, and a discrete stage on another
thread could start a second collector (a segfault on torch 2.13) or, when the window closed
first, be saved under the window's name and then stopped a second time.
"""

import gzip
import json
import logging
import os
import threading

import torch

from plait.configtree import build
from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig

torch.set_num_threads(1)


def session(tmp_path, discrete=False, contents=()):
    cfg = GlobalProfilerConfig(tool="torch", steps=[1], save_path=str(tmp_path / "profile"))
    roles = {r: build(RoleProfilerConfig, {"enable": True, "tool_config": {"torch": {
        "discrete": discrete, "contents": list(contents)}}}) for r in ("actor", "rollout")}
    return ProfilerSession(cfg, roles, rank=0)


def names(path):
    with gzip.open(path, "rt") as f:
        return {e.get("name") for e in json.load(f)["traceEvents"]}


def in_thread(fn):
    t = threading.Thread(target=fn)
    t.start()
    return t


def test_window_trace_names_the_stages_of_another_thread(tmp_path):
    s = session(tmp_path)
    s.start(1, 1, version=0)

    def rollout():
        with s.for_role("rollout").annotate("gen"):
            torch.randn(8, 8) @ torch.randn(8, 8)
    in_thread(rollout).join()
    with s.for_role("actor").annotate("update_actor"):
        torch.randn(8, 8).sum()
    [record] = s.stop()
    assert {"rollout/gen", "actor/update_actor"} <= names(tmp_path / "profile" / record["path"])


def test_window_closing_while_a_discrete_stage_runs_on_another_thread(tmp_path, caplog):
    s = session(tmp_path, discrete=True)
    entered, release = threading.Event(), threading.Event()

    def rollout():
        with s.for_role("rollout").annotate("gen"):
            entered.set()
            release.wait(10)
    s.start(1, 1, version=0)
    t = in_thread(rollout)
    entered.wait(10)
    # the driver's own stage overlaps the running one: a range in its trace, no second collector
    with caplog.at_level(logging.WARNING, logger="plait.profiler"):
        with s.for_role("actor").annotate("update_actor"):
            torch.randn(8, 8).sum()
        records = s.stop()  # the window ends first: the rollout's trace is cut and saved as its own
        release.set()
        t.join()
    assert [(r["role"], r["stage"], r["path"]) for r in records] == [
        ("rollout", "gen", "step1/rollout_rank0_gen.pt.trace.json.gz")]
    assert os.listdir(tmp_path / "profile" / "step1") == ["rollout_rank0_gen.pt.trace.json.gz"]
    assert "actor/update_actor" in names(tmp_path / "profile" / records[0]["path"])
    assert caplog.records == []  # the stage's own exit found its collector already stopped, quietly


def test_memory_contents_still_record_allocations(tmp_path):
    # PyTorch records no allocations when profiling all threads: memory keeps to the driver thread.
    s = session(tmp_path, contents=["memory"])
    s.start(1, 1, version=0)
    with s.for_role("actor").annotate("update_actor"):
        torch.randn(64, 64).sum()
    [record] = s.stop()
    with gzip.open(tmp_path / "profile" / record["path"], "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name") == "[memory]" and e["args"]["Bytes"] > 0 for e in events)
