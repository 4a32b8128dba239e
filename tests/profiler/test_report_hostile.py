"""`plait profile report` on someone else's folder reads only below the folder it was given: a
manifest path with `..`, an absolute one, a symbolic link out, and a copied run's recorded save_path
(which points at the original) are not followed, and their contents never reach the output."""

import gzip
import json
import os
import shutil

from plait import cli


def trace(op: str) -> str:
    """A torch-style Chrome trace whose one operator is named `op` (the content a leak would copy)."""
    return json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": op, "ts": 10.0, "dur": 5.0,
                                        "pid": 7, "tid": 7}], "baseTimeNanoseconds": 1_000_000_000})


def record(path: str) -> dict:
    return {"steps": [1, 1], "role": "actor", "stage": None, "rank": 0, "pid": 7, "tool": "torch",
            "path": path, "start_time": 0.0, "end_time": 1.0, "policy_version": 0, "complete": True}


def output(folder) -> str:
    with gzip.open(folder / "report" / "timeline.json.gz") as f:
        return (folder / "report" / "index.html").read_text() + f.read().decode()


def test_manifest_paths_leading_out_of_the_folder_are_not_read(tmp_path, capsys):
    (tmp_path / "secret_rel.json").write_text(trace("SECRET_RELATIVE"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "secret_abs.json").write_text(trace("SECRET_ABSOLUTE"))
    (tmp_path / "elsewhere" / "secret_link.json").write_text(trace("SECRET_LINK"))
    folder = tmp_path / "profile_folder"
    (folder / "step1").mkdir(parents=True)
    (folder / "step1" / "own.json").write_text(trace("OWN_OP"))
    os.symlink(tmp_path / "elsewhere" / "secret_link.json", folder / "step1" / "link.json")
    os.symlink(tmp_path / "elsewhere", folder / "dirlink")
    paths = ["step1/own.json", "../secret_rel.json", str(tmp_path / "elsewhere" / "secret_abs.json"),
             "step1/link.json", "dirlink/secret_abs.json"]
    (folder / "manifest.jsonl").write_text("".join(json.dumps(record(p)) + "\n" for p in paths)
                                           + json.dumps({"path": ["not", "a", "record"]}) + "\n")
    assert cli.main(["profile", "report", str(folder)]) == 0
    text = output(folder)
    assert "OWN_OP" in text
    assert "SECRET" not in text and "SECRET" not in capsys.readouterr().out
    for p in paths[1:]:
        assert f"{p}: outside the profile folder {folder}; not read" in text


def test_a_copied_run_reads_its_own_folder_not_the_recorded_original(tmp_path, capsys):
    original = tmp_path / "original"
    (original / "profile" / "step1").mkdir(parents=True)
    (original / "profile" / "step1" / "actor.json").write_text(trace("ORIGINAL_OP"))
    (original / "profile" / "manifest.jsonl").write_text(json.dumps(record("step1/actor.json")) + "\n")
    (original / "metrics.jsonl").write_text(json.dumps({"step": 1, "perf/time_per_step": 1.0}) + "\n")
    (original / "profile_location.json").write_text(json.dumps({"save_path": str(original / "profile"),
                                                                "tool": "torch"}))
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    (copy / "profile" / "step1" / "actor.json").write_text(trace("COPY_OP"))
    assert cli.main(["profile", "report", str(copy)]) == 0
    text = output(copy)
    assert "COPY_OP" in text and "ORIGINAL_OP" not in text
    summary = capsys.readouterr().out
    assert f"{copy / 'profile'})" in summary
    assert not (original / "report").exists()


def test_a_crafted_run_folder_is_read_as_data_and_written_only_inside(tmp_path, capsys):
    """Links planted where the report is written are replaced, not written through; timeline and
    metrics lines of another shape (a markup payload, a string step, a torn line) are skipped or
    escaped, never a traceback or markup in the page."""
    victim = tmp_path / "victim.html"
    victim.write_text("precious")
    folder = tmp_path / "run"
    (folder / "report").mkdir(parents=True)
    os.symlink(victim, folder / "report" / "index.html")
    span = {"step": 1, "role": "trainer", "stage": "gen", "pid": 1, "thread": "MainThread", "start": 1.0,
            "end": 2.0, "version": 0}
    (folder / "timeline.jsonl").write_text("\n".join(json.dumps(s) for s in [
        {**span, "stage": "step"}, span, {**span, "step": "<script>alert(1)</script>"}, {"role": 3}]) + "\n{torn")
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in [
        {"step": 1, "perf/time_per_step": 1.0, "note": "<script>x</script>"}, {"step": "2"}, [1, 2]]) + "\n")
    assert cli.main(["profile", "report", str(folder)]) == 0
    assert victim.read_text() == "precious" and not (folder / "report" / "index.html").is_symlink()
    page = (folder / "report" / "index.html").read_text()
    assert "<script" not in page and "step time p50 1.000 s" in capsys.readouterr().out


def test_a_gzip_bomb_trace_is_not_read_past_the_bound(tmp_path, monkeypatch):
    """The bound is checked on what is read, so a small cap here stands for the real 1 GiB one."""
    from plait.profiler.analysis import traces
    monkeypatch.setattr(traces, "MAX_TRACE_BYTES", 1 << 20)
    folder = tmp_path / "profile"
    (folder / "step1").mkdir(parents=True)
    with gzip.open(folder / "step1" / "bomb.json.gz", "wb") as f:
        f.write(b'{"traceEvents": [')  # a trace's start, then 64 MiB of blanks (64 KiB on disk): only the bound stops it
        for _ in range(64):
            f.write(b" " * (1 << 20))
    (folder / "manifest.jsonl").write_text(json.dumps(record("step1/bomb.json.gz")) + "\n")
    assert cli.main(["profile", "report", str(folder)]) == 0
    assert "step1/bomb.json.gz: could not be read (ValueError: larger than 1 MiB (decompressed)" in output(folder)


def test_a_trace_with_malformed_events_keeps_its_good_ones(tmp_path):
    folder = tmp_path / "profile"
    (folder / "step1").mkdir(parents=True)
    good = json.loads(trace("GOOD_OP"))["traceEvents"][0]
    events = [good, {"ph": "X", "cat": "cpu_op", "name": "NO_DUR", "ts": 1.0, "pid": 7, "tid": 7},
              {"ph": "M", "name": "thread_name", "pid": 7}, {"ph": "X", "pid": [1], "tid": 1, "ts": 1, "dur": 1,
                                                              "name": "LIST_PID"}, "not an event", {"ts": "soon"}]
    (folder / "step1" / "t.json").write_text(json.dumps({"traceEvents": events, "baseTimeNanoseconds": 0}))
    (folder / "manifest.jsonl").write_text(json.dumps(record("step1/t.json")) + "\n")
    assert cli.main(["profile", "report", str(folder)]) == 0
    text = output(folder)
    assert "GOOD_OP" in text and "NO_DUR" not in text and "LIST_PID" not in text
