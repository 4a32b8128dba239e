"""Profiler artifacts are written under a temp name and renamed, and the manifest keeps one
record per artifact path (a resumed window's record supersedes the interrupted one, marked so)."""

import os
import signal

from plait.profiler.naming import append_manifest, read_manifest
from plait.profiler.session import OpenWindow


def record(path, complete, pid):
    return {"steps": [3, 3], "role": "actor", "stage": None, "rank": 0, "pid": pid, "tool": "torch", "path": path,
            "start_time": 0.0, "end_time": 1.0, "policy_version": 2, "complete": complete}


def test_a_kill_mid_write_leaves_no_file_under_the_artifacts_name(tmp_path):
    window = OpenWindow(str(tmp_path), 3, 3, 2, "actor", 0, on_error=lambda what, err: None)

    def half_then_killed(path):
        with open(path, "wb") as f:
            f.write(b"\x1f\x8b half a gzip")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    pid = os.fork()
    if pid == 0:
        window.save("actor", "pt.trace.json.gz", half_then_killed)
        os._exit(0)
    os.waitpid(pid, 0)
    assert not (tmp_path / "step3" / "actor_rank0.pt.trace.json.gz").exists()
    window.save("actor", "pt.trace.json.gz", lambda path: open(path, "wb").write(b"whole"))
    assert (tmp_path / "step3" / "actor_rank0.pt.trace.json.gz").read_bytes() == b"whole"


def test_a_resumed_window_supersedes_the_interrupted_record_of_its_path(tmp_path):
    path = "step3/actor_rank0.pt.trace.json.gz"
    append_manifest(str(tmp_path), [record(path, False, 1), record("step1/actor_rank0.pt.trace.json.gz", True, 1)])
    append_manifest(str(tmp_path), [record(path, True, 2)])
    records = read_manifest(str(tmp_path))
    assert [(r["path"], r["pid"], r["complete"], r.get("resumed")) for r in records] == [
        ("step1/actor_rank0.pt.trace.json.gz", 1, True, None), (path, 2, True, True)]
