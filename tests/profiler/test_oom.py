"""torch_memory: a CUDA out-of-memory error outside any window dumps the allocator's snapshot and
summary on the profiling ranks, listed in the manifest when the run closes its profiler.

On CPU the path is driven from a reward that does what the CUDA allocator does at OOM: calls the
observer, then raises torch.cuda.OutOfMemoryError. Only the two CUDA readers (snapshot, summary),
which cannot run without a GPU, are replaced; on a GPU the second test makes a real OOM.
"""

import os
import pickle

import pytest
import torch

from plait import driver
from plait.profiler import read_manifest
from tests.profiler.test_report import snapshot_fixture

torch.set_num_threads(1)
OOM_REWARD = '''
import torch
from plait.profiler.tools.torch_memory import _OomObserver
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    _OomObserver._on_oom(0, 2**40, 0, 0)  # what the CUDA allocator calls before raising
    raise torch.cuda.OutOfMemoryError("CUDA out of memory (planted)")
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU test below makes a real one")
def test_an_oom_outside_a_window_is_dumped_and_listed(tmp_path, tiny_config, monkeypatch):
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: snapshot_fixture(1_700_000_000_000_000))
    monkeypatch.setattr(torch.cuda, "memory_summary", lambda: "|  PyTorch CUDA memory summary (planted) |")
    (tmp_path / "oom_reward.py").write_text(OOM_REWARD)
    save = tmp_path / "profile"
    cfg = tiny_config(tmp_path, "trainer.test_freq=-1", "global_profiler.tool=torch_memory",
                      "global_profiler.steps=[3]", f"global_profiler.save_path={save}",
                      "actor_rollout_ref.actor.profiler.enable=true",
                      f"custom_reward_function.path={tmp_path}/oom_reward.py",
                      "reward.num_workers=0")  # the planted OOM must happen in the driver's process
    with pytest.raises(torch.cuda.OutOfMemoryError):
        driver.build(cfg, progress=False).run()
    records = read_manifest(str(save))
    assert [(r["stage"], r["role"], r["steps"], r["complete"]) for r in records] == [("oom", "actor", None, True)] * 2
    paths = sorted(r["path"] for r in records)
    assert paths == ["oom/" + os.path.basename(p) for p in paths] and paths[0].endswith("_oom-1.pickle")
    with open(save / paths[0], "rb") as f:
        assert pickle.load(f)["segments"]  # the allocator's state at the error
    assert "memory summary" in (save / paths[1]).read_text()


@pytest.mark.gpu
def test_a_real_cuda_oom_outside_a_window_is_dumped(tmp_path):
    from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig
    cfg = GlobalProfilerConfig(tool="torch_memory", steps=[5], save_path=str(tmp_path))
    session = ProfilerSession(cfg, {"actor": RoleProfilerConfig(enable=True)}, rank=0)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    records = session.stop(complete=False)
    assert sorted(os.path.splitext(r["path"])[1] for r in records) == [".pickle", ".txt"]
    assert all(os.path.exists(tmp_path / r["path"]) for r in records)
