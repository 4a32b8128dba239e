"""`plait profile report` on timelines no run writes: a span of ±1e308 (past what the µs clock holds) is
skipped and counted in one line, never a traceback; a million-span timeline with a thousand stage names
gives a page under report.PAGE_BOUND, saying what it left out."""

import json
import re

from plait import cli
from plait.profiler.analysis import report


def span(step, stage, start, end, thread="MainThread", version=0):
    return {"step": step, "role": "trainer", "stage": stage, "pid": 1, "thread": thread, "start": start,
            "end": end, "version": version}


def write_run(folder, extra=(), stages=("gen", "update_actor"), per_step=2, threads=1, steps=3):
    """A synthetic run folder: `steps` steps of 1 s, each `per_step` spans cycling through `stages`."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "timeline.jsonl", "w") as f:
        for step in range(1, steps + 1):
            t = 1000.0 + step
            f.write(json.dumps(span(step, "step", t, t + 1, version=None if step == 2 else step)) + "\n")
            for i in range(per_step):
                s = t + i / per_step
                f.write(json.dumps(span(step, stages[i % len(stages)], s, s + 0.5 / per_step, f"T{i % threads}")) + "\n")
        for r in extra:
            f.write(json.dumps(r) + "\n")
    with open(folder / "metrics.jsonl", "w") as f:
        for step in range(1, steps + 1):
            f.write(json.dumps({"step": step, "perf/time_per_step": 1.0,
                                **{f"timing_s/{s}": 0.5 / len(stages) for s in stages}}) + "\n")


def report_of(folder, capsys) -> tuple[str, str]:
    assert cli.main(["profile", "report", str(folder)]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    return (folder / "report" / "index.html").read_text(), out.out


def test_a_span_past_the_clock_is_skipped_and_counted(tmp_path, capsys):
    huge = [span(2, "gen", -1e308, 1e308), span(2, "gen", 1001.0, 1e308), span(10**30, "gen", 1001.0, 1001.1)]
    write_run(tmp_path / "run", extra=huge)
    (tmp_path / "run" / "samples.jsonl").write_text(
        json.dumps({"sample": "a", "span": "gen", "start": -1e308, "end": 1e308, "step": 1}) + "\n"
        + json.dumps({"sample": "b", "span": "gen", "start": 1001.0, "end": 1001.1, "step": 1,
                      "attrs": {"staleness": 10**400}}) + "\n")  # an integer no float holds
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:  # charts sum these: 1e308 + 1e308 is inf
        f.write(json.dumps({"step": 3, "timing_s/gen": 1e308, "perf/time_per_step": -1.7e308,
                            "perf/throughput": 10**400}) + "\n")
    page, console = report_of(tmp_path / "run", capsys)
    assert "not shown: timeline.jsonl: 3 record(s) not of the shape plait writes skipped" in console
    assert "samples.jsonl: 1 record(s) not of the shape plait writes skipped" in console
    assert "e+308" not in page and "inf" not in page.lower().replace("info", "")


def test_hover_and_headings_say_no_version_rather_than_none(tmp_path, capsys):
    write_run(tmp_path / "run", extra=[span(2, "reward", 1002.6, 1002.7, version=None)])
    page, _ = report_of(tmp_path / "run", capsys)
    assert "reward · step 2 · 0.1" in page.replace("100.0 ms", "0.1")
    assert "vNone" not in page and "version None" not in page


def test_a_huge_timeline_gives_a_bounded_page(tmp_path, capsys):
    """50,000 spans in 1,000 stage names (300 characters, mostly "&": 5 bytes each escaped) on 64 threads: the
    page was tens of MB; the bounded one stays under PAGE_BOUND and says what it left out. A million spans in
    1,000 plain names gave 121 MB before, 1 MB after (by hand)."""
    stages = [f"stage_{i:04d}_" + "&" * 290 for i in range(1000)]
    write_run(tmp_path / "run", stages=stages, per_step=12_500, threads=64, steps=4)
    page, _ = report_of(tmp_path / "run", capsys)
    assert len(page.encode()) < 8 << 20 == report.PAGE_BOUND  # the bound docs/profiling.md names
    assert re.search(f"{report.MAX_GANTT_BARS:,} of [0-9,]+ spans drawn, the longest", page)
    assert "33 of 65 rows not drawn" in page  # 64 threads and the step's own row
    assert "more: hover a bar for its name" in page
    assert f"{1000 - report.MAX_STAGES} other stages" in page
