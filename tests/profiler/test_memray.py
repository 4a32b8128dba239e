"""global_profiler.tool=memray: one memray capture per window and process, read back by memray itself, and
`plait profile report` linking memray's flame graph beside the capture's memory over the timeline's stages.

The trainer-mode matrix runs the tool too (test_matrix.py); here: what a capture holds (the window's
allocations, not those before it), the report of a real tiny run whose reward plants a known allocation,
and the refusal where memray cannot run.
"""

import importlib.util
import os
import sys

import pytest
import torch

from plait import driver
from plait.configtree import ConfigError
from plait.profiler import GlobalProfilerConfig, ProfilerSession, read_manifest, validate_environment
from plait.profiler.analysis import build_report

memray = pytest.importorskip("memray")
torch.set_num_threads(1)
MIB = 2**20
PLANTED_MIB = 48
PLANTED_REWARD = f'''
import time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    planted = b"x" * ({PLANTED_MIB} * 2**20)  # written, so resident; freed on return
    time.sleep(0.03)  # memray samples resident memory every 10 ms
    return float(len(planted) == 0)
'''


def role(enable=True):
    from plait.configtree import build
    from plait.profiler import RoleProfilerConfig
    return build(RoleProfilerConfig, {"enable": enable})


def capture_sizes(path) -> list[int]:
    reader = memray.FileReader(str(path))
    try:
        return [r.size for r in reader.get_allocation_records()]
    finally:
        reader.close()


def test_each_window_is_one_capture_of_its_own_allocations(tmp_path):
    save = tmp_path / "profile"
    s = ProfilerSession(GlobalProfilerConfig(tool="memray", steps=[2, 3], save_path=str(save)),
                        {"actor": role(), "ref": role(enable=False)}, rank=0)
    before = bytearray(24 * MIB + 5)  # allocated before any window: in no capture
    s.start(2, 2, version=1)
    with s.for_role("actor").annotate("update_actor"):
        second = bytearray(16 * MIB + 7)
    first = s.stop()
    s.start(3, 3, version=2)
    with s.for_role("ref").annotate("compute_ref_log_prob"):
        third = bytearray(8 * MIB + 3)
    records = first + s.stop()

    assert [(r["steps"], r["role"], r["tool"], r["path"], r["policy_version"], r["complete"]) for r in records] == [
        ([2, 2], "actor", "memray", "step2/actor_rank0.memray.bin", 1, True),
        ([3, 3], "actor", "memray", "step3/actor_rank0.memray.bin", 2, True)]
    assert sorted(os.listdir(save / "step2")) == ["actor_rank0.memray.bin"]  # the hidden recording was renamed
    window2, window3 = capture_sizes(save / records[0]["path"]), capture_sizes(save / records[1]["path"])
    # a bytearray of n bytes asks for n + 1 (its trailing NUL)
    assert len(second) + 1 in window2 and len(third) + 1 not in window2
    assert len(third) + 1 in window3 and len(second) + 1 not in window3
    assert len(before) + 1 not in window2 + window3


def test_a_window_whose_tracker_cannot_start_is_incomplete_and_training_goes_on(tmp_path, caplog):
    save = tmp_path / "profile"
    s = ProfilerSession(GlobalProfilerConfig(tool="memray", steps=[1], save_path=str(save)), {"actor": role()}, 0)
    with memray.Tracker(str(tmp_path / "outer.bin")):  # memray allows one tracker per process
        s.start(1, 1, version=0)
        with s.for_role("actor").annotate("update_actor"):
            ran = True
        records = s.stop()
    assert ran and [(r["path"], r["complete"]) for r in records] == [(None, False)]
    assert "memray failed starting" in caplog.text
    s.start(2, 2, version=1)  # the next window records again
    assert s.stop()[0]["path"] == "step2/actor_rank0.memray.bin"


def test_the_report_links_memrays_flame_graph_and_finds_the_planted_allocation(tmp_path, tiny_config):
    out = tmp_path
    (out / "planted.py").write_text(PLANTED_REWARD)
    cfg = tiny_config(out, "trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
                      "global_profiler.tool=memray", "global_profiler.steps=[2]",
                      "actor_rollout_ref.actor.profiler.enable=true", f"custom_reward_function.path={out}/planted.py",
                      "reward.num_workers=0")  # in the driver's process, where the tracker is
    driver.build(cfg, progress=False).run()

    records = read_manifest(str(out / "profile"))
    assert [(r["steps"], r["role"], r["path"]) for r in records] == [([2, 2], "actor", "step2/actor_rank0.memray.bin")]
    assert any(size >= PLANTED_MIB * MIB for size in capture_sizes(out / "profile" / records[0]["path"]))

    text = build_report(str(out))
    page = (out / "report" / "index.html").read_text()
    flame = out / "report" / "step2_actor_rank0.memray.html"
    assert flame.is_file() and "memray" in flame.read_text()[:5000].lower()
    assert "flame graph (memray): <a href='step2_actor_rank0.memray.html'>" in page
    assert "resident memory (RSS) as memray sampled it" in page
    # the allocation live at memray's high-water mark is the planted one, charged to its line
    assert "memory step2/actor_rank0.memray.bin: window peak" in text and "planted.py" in text
    assert "compute_score" in page


@pytest.mark.parametrize("platform, spec, match", [
    ("win32", True, "memray runs on Linux and macOS only, not win32"),
    ("linux", False, r"memray needs the memray package: pip install 'plait\[memray\]'")])
def test_memray_is_refused_in_one_line_where_it_cannot_run(monkeypatch, platform, spec, match):
    monkeypatch.setattr(sys, "platform", platform)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: real(name, *a) if spec or name != "memray" else None)
    with pytest.raises(ConfigError, match=r"global_profiler\.tool.*" + match):
        validate_environment(GlobalProfilerConfig(tool="memray", steps=[1]), {"actor": role()})


def test_memray_snapshot_num_steps_groups_windows_and_is_checked():
    from plait.config import load_config
    from plait.profiler import StepProfiler
    cfg = load_config(None, ["global_profiler.tool=memray", "global_profiler.steps=[1,3,5]",
                             "global_profiler.global_tool_config.memray.memory_snapshot_num_steps=2"])
    assert [(w.first, w.last) for w in StepProfiler(cfg.global_profiler, 10, []).plan.windows] == [(1, 3), (5, 5)]
    with pytest.raises(ConfigError, match="memory_snapshot_num_steps"):
        load_config(None, ["global_profiler.global_tool_config.memray.memory_snapshot_num_steps=0"])


def test_a_vllm_rollout_says_its_engine_process_is_not_followed():
    from plait.workers.vllm_notes import profiling_note
    note = profiling_note("memray", discrete=False, cuda=False)
    assert note.startswith("rollout.name=vllm with memray:") and "does not follow" in note


def test_a_capture_memray_cannot_read_is_one_note_and_the_page_is_still_written(tmp_path):
    from plait.profiler import append_manifest
    (tmp_path / "step1").mkdir()
    (tmp_path / "step1" / "actor_rank0.memray.bin").write_bytes(b"not a memray capture" * 100)
    append_manifest(str(tmp_path), [{"steps": [1, 1], "role": "actor", "stage": None, "rank": 0, "pid": 1, "tool": "memray",
                                     "path": "step1/actor_rank0.memray.bin", "start_time": 1.0, "end_time": 2.0,
                                     "policy_version": 0, "complete": True}])
    text = build_report(str(tmp_path))  # memray reads it in a child process: a crafted file cannot take the report down
    assert "not shown: step1/actor_rank0.memray.bin: " in text and "memray could not read it" in text
    assert (tmp_path / "report" / "index.html").is_file()
