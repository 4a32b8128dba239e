"""bench/gpu_check.py, the prepared GPU run, rehearsed on CPU: its checks still fit plait's APIs
(the GPU machine is rare; a check broken by a refactor would waste its one run)."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402


def test_checks_run_on_cpu_and_record_what_they_saw(tmp_path):
    ctx = gpu_check.Ctx("cpu", tmp_path, time.time() + 600)
    sync = gpu_check.run_check(ctx, "mode_sync")
    assert sync["status"] == "pass", sync
    assert sync["manifest"] == [("step1/actor-rollout_rank0.pt.trace.json.gz", "actor-rollout", [1, 1], True)]
    assert list(sync["alloc_events"].values())[0] > 0  # the step-1 window's memory trace holds allocations
    oom = gpu_check.run_check(ctx, "oom_outside_window")
    assert oom["status"] in ("pass", "absent"), oom  # the run raised the OOM; "absent": no snapshot feature yet
    assert gpu_check.run_check(ctx, "torch_memory_windows")["status"] == "skipped"  # CUDA only


def test_a_spent_budget_starts_no_check(tmp_path):
    ctx = gpu_check.Ctx("cpu", tmp_path, time.time() - 1)
    assert gpu_check.run_check(ctx, "mode_sync") == {
        "check": "mode_sync", "status": "not_run", "reason": "--budget-s spent before it could start"}
    assert not (tmp_path / "mode_sync").exists()
    assert gpu_check.environment("cpu")["torch"]  # the results' header is built without a GPU too
