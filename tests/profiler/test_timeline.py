"""The always-on recording: timeline spans from several threads, per-stage peak memory, and what a
real run writes (timeline.jsonl records, memory/<stage>/* metrics)."""

import mmap
import threading

import torch

from plait import driver
from plait.profiler.timeline import StagePeaks, Timeline, read_timeline
from plait.trainers.lifecycle import read_metrics

torch.set_num_threads(1)


def test_spans_of_two_threads_flush_as_one_steps_records(tmp_path):
    timeline = Timeline()
    path = str(tmp_path / "timeline.jsonl")
    with timeline.span("trainer", "dropped"):  # no file open yet: nothing kept
        pass
    timeline.open(path)
    with timeline.span("trainer", "update_actor", version=3):
        worker = threading.Thread(target=lambda: timeline.add("rollout", "generate", 1.0, 2.0, 2), name="gen-thread")
        worker.start()
        worker.join()
    timeline.flush(7)
    timeline.close(8)  # nothing left: no record for step 8
    records = read_timeline(path)
    assert [(r["step"], r["role"], r["stage"], r["thread"], r["version"]) for r in records] == [
        (7, "rollout", "generate", "gen-thread", 2), (7, "trainer", "update_actor", "MainThread", 3)]
    update = records[1]
    assert update["start"] <= update["end"] and update["start"] > 1e9  # wall clock seconds


def test_stage_peaks_nest_and_see_a_planted_allocation():
    peaks = StagePeaks()
    key = "peak_allocated" if peaks.cuda else "peak_rss"
    device = "cuda" if peaks.cuda else "cpu"
    size = 64 * 2**20
    peaks.enter()                       # outer
    peaks.enter()                       # inner: allocates 64 MiB, touches it, frees it
    if peaks.cuda:
        planted = torch.ones(size // 4, device=device)
        del planted
    else:  # fresh pages from the kernel: malloc keeps freed memory (plait/allocator.py) and may reuse it unseen
        with mmap.mmap(-1, size) as planted:
            for page in range(0, size, mmap.PAGESIZE):
                planted[page] = 1
    inner = peaks.exit()
    peaks.enter()                       # a later sibling allocating nothing
    quiet = peaks.exit()
    outer = peaks.exit()
    assert inner[key] - quiet[key] >= 0.9 * size  # the counter was reset at the sibling's entry
    assert outer[key] >= inner[key]               # the enclosing stage folds in the inner peak


def test_a_run_writes_its_timeline_and_stage_memory_metrics(tmp_path, tiny_config):
    cfg = tiny_config(tmp_path, "trainer.total_training_steps=2", "trainer.test_freq=-1")
    driver.build(cfg, progress=False).run()
    spans = read_timeline(str(tmp_path / "timeline.jsonl"))
    steps = {s["step"]: s for s in spans if s["stage"] == "step"}
    assert sorted(steps) == [1, 2] and [steps[1]["version"], steps[2]["version"]] == [0, 1]
    for s in spans:  # every stage of a step lies inside that step's span; its logging follows it
        if s["stage"] == "log":
            assert steps[s["step"]]["end"] <= s["start"] and (s["step"] == 2 or s["end"] <= steps[s["step"] + 1]["start"])
        else:
            assert steps[s["step"]]["start"] <= s["start"] <= s["end"] <= steps[s["step"]]["end"]
    assert {"gen", "old_log_prob", "update_actor"} <= {s["stage"] for s in spans}
    metrics = read_metrics(str(tmp_path / "metrics.jsonl"))[-1]
    unit = "peak_allocated_gb" if torch.cuda.is_available() else "peak_rss_gb"
    assert metrics[f"memory/step/{unit}"] >= metrics[f"memory/update_actor/{unit}"] > 0
