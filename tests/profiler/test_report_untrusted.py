"""Every value `plait profile report` and the verdict read from a run folder is untrusted data.

One real tiny run is copied and each copy gets one class of damage, in every file the report reads
(summary.json, metrics.jsonl, timeline.jsonl, manifest.jsonl, a trace): numbers that are not finite,
values of the wrong type, missing keys, nesting deeper than a parser's stack, files and lines past the
bounds. Each must end in a written page and verdict.json, exit 0, with the damaged item skipped (and
said so where it is a whole file), never a traceback; nothing in a folder is ever run.
"""

import gzip
import json
import os
import shutil

import pytest

from plait import cli, driver

RUN_ARGS = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
            "trainer.total_training_steps=3", "global_profiler.tool=torch", "global_profiler.steps=[2]",
            "actor_rollout_ref.actor.profiler.enable=true"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A real 3-step run with a torch window at step 2 (built once, copied per test)."""
    from plait.config import load_config
    from tests.conftest import TINY
    out = tmp_path_factory.mktemp("untrusted") / "run"
    driver.build(load_config(None, [*TINY, f"trainer.default_local_dir={out}", *RUN_ARGS]), progress=False).run()
    return out


def copy_of(run, tmp_path):
    dest = tmp_path / "run"
    shutil.copytree(run, dest)
    return dest


def lines(path) -> list:
    return [json.loads(line) for line in open(path) if line.strip()]


def write_lines(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def report_ok(folder, capsys) -> str:
    """The report exits 0, writes its page and verdict.json; returns page + console."""
    assert cli.main(["profile", "report", str(folder)]) == 0
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    assert json.load(open(folder / "report" / "verdict.json"))["verdicts"] is not None
    return (folder / "report" / "index.html").read_text() + out.out


def test_numbers_that_are_not_finite(run, tmp_path, capsys):
    folder = copy_of(run, tmp_path)
    rows = lines(folder / "metrics.jsonl")
    rows[0]["perf/time_per_step"] = float("inf")
    rows[1]["timing_s/update_actor"] = float("-inf")
    rows[1]["perf/throughput"] = float("nan")
    rows[2]["memory/update_actor/peak_rss_gb"] = float("inf")
    rows.append({"step": float("inf"), "perf/time_per_step": 1.0})
    write_lines(folder / "metrics.jsonl", rows)
    spans = lines(folder / "timeline.jsonl")
    spans[0]["end"] = float("inf")
    spans[1]["start"] = float("nan")
    write_lines(folder / "timeline.jsonl", spans)
    summary = json.load(open(folder / "summary.json"))
    summary["wall_s"]["total"] = float("inf")
    summary["wall_s"]["profiler"] = float("nan")
    summary["memory_peak"]["gb"] = float("inf")
    summary["settings"]["data.train_batch_size"] = float("inf")
    (folder / "summary.json").write_text(json.dumps(summary))
    manifest = lines(folder / "profile" / "manifest.jsonl")
    manifest[0]["start_time"] = float("-inf")
    write_lines(folder / "profile" / "manifest.jsonl", manifest)
    page = report_ok(folder, capsys)
    assert "Infinity" not in page and "inf s" not in page and "nan" not in page.lower().replace("nanoseconds", "")


def test_values_of_the_wrong_type(run, tmp_path, capsys):
    folder = copy_of(run, tmp_path)
    for summary in ([1, 2], "a string", 3, None, {"wall_s": [1, 2], "settings": "x", "memory_peak": [1]},
                    {"wall_s": {"total": "10", "startup": True}, "memory_peak": {"gb": "1", "stage": 3, "step": "2"},
                     "settings": {"data.train_batch_size": "4", "actor_rollout_ref.rollout.n": [4],
                                  "trainer.mode": 7, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": True,
                                  "memory_capacity_gb": "big", "global_profiler.steps": "all"},
                     "verdict": "none", "step_s": {"median": "fast"}}):
        (folder / "summary.json").write_text(json.dumps(summary))
        report_ok(folder, capsys)
    rows = lines(folder / "metrics.jsonl")
    write_lines(folder / "metrics.jsonl", [{**rows[0], "perf/time_per_step": "1"}, {**rows[1], "step": True},
                                           {**rows[2], "timing_s/update_actor": {"a": 1}}, {"step": -3}, [rows[0]]])
    spans = lines(folder / "timeline.jsonl")
    write_lines(folder / "timeline.jsonl", [{**spans[0], "version": True}, {**spans[1], "pid": "1"},
                                            {**spans[2], "stage": ["gen"]}, *spans[3:]])
    manifest = lines(folder / "profile" / "manifest.jsonl")
    write_lines(folder / "profile" / "manifest.jsonl", [{**manifest[0], "steps": ["a", "b"]},
                                                        {**manifest[0], "steps": [3, 1]},
                                                        {**manifest[0], "steps": [2]}, {**manifest[0], "rank": 1.5},
                                                        manifest[0]])
    assert "update_actor" in report_ok(folder, capsys)


def test_missing_keys(run, tmp_path, capsys):
    folder = copy_of(run, tmp_path)
    for summary in ({}, {"settings": {}}, {"wall_s": {}}, {"memory_peak": {"gb": 1.0}}):
        (folder / "summary.json").write_text(json.dumps(summary))
        report_ok(folder, capsys)
    spans = lines(folder / "timeline.jsonl")
    write_lines(folder / "timeline.jsonl", [{k: v for k, v in s.items() if k != "end"} if i % 3 == 0 else s
                                            for i, s in enumerate(spans)])
    write_lines(folder / "metrics.jsonl", [{"step": 1}, {"step": 2, "timing_s/step": 0.1}])
    manifest = lines(folder / "profile" / "manifest.jsonl")
    write_lines(folder / "profile" / "manifest.jsonl", [{k: v for k, v in manifest[0].items() if k != "rank"}])
    report_ok(folder, capsys)


def test_nesting_deeper_than_the_parser_and_numbers_too_long(run, tmp_path, capsys):
    folder = copy_of(run, tmp_path)
    deep = "[" * 200_000 + "]" * 200_000
    long_int = '{"step": 1, "perf/time_per_step": ' + "9" * 10_000 + "}"
    (folder / "summary.json").write_text(deep)
    with open(folder / "metrics.jsonl", "a") as f:
        f.write(deep + "\n" + long_int + "\n")
    with open(folder / "timeline.jsonl", "a") as f:
        f.write(deep + "\n")
    with open(folder / "profile" / "manifest.jsonl", "a") as f:
        f.write(deep + "\n")
    trace = next((folder / "profile" / "step2").glob("*.json.gz"))
    with gzip.open(trace, "wt") as f:
        f.write('{"traceEvents": ' + deep + "}")
    text = report_ok(folder, capsys)
    assert "could not be read" in text  # the trace: one line, the others still reported


def test_files_and_lines_past_the_bounds(run, tmp_path, capsys, monkeypatch):
    """Small bounds stand for the real ones (inputs.MAX_*): checked on what is read, so the same code runs."""
    from plait.profiler.analysis import inputs
    monkeypatch.setattr(inputs, "MAX_LINE_BYTES", 1 << 14)  # a step record is ~4 KiB
    monkeypatch.setattr(inputs, "MAX_RECORDS", 50)
    monkeypatch.setattr(inputs, "MAX_JSON_BYTES", 1 << 16)
    folder = copy_of(run, tmp_path)
    with open(folder / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "huge": "x" * 100_000}) + "\n")
    spans = lines(folder / "timeline.jsonl")
    write_lines(folder / "timeline.jsonl", spans + [spans[-1]] * 200)
    summary = json.load(open(folder / "summary.json"))
    summary["padding"] = "x" * (1 << 17)
    (folder / "summary.json").write_text(json.dumps(summary))
    text = report_ok(folder, capsys)
    assert "timeline.jsonl: records past the first 50 not read" in text
    assert "summary.json: larger than 64 KiB; not read" in text
    assert "metrics.jsonl: 1 line(s) longer than 16 KiB skipped" in text
    monkeypatch.setattr(inputs, "MAX_FILE_BYTES", 8192)
    text = report_ok(folder, capsys)
    assert "timeline.jsonl: past the first 8 KiB not read" in text


def test_the_verdict_of_a_hostile_summary_is_the_verdict_without_it(run, tmp_path, capsys):
    """Settings of the wrong type are dropped one by one (named in the page), so the rules that need
    them stay silent rather than guess, and the others still speak."""
    folder = copy_of(run, tmp_path)
    clean = report_ok(folder, capsys)
    summary = json.load(open(folder / "summary.json"))
    summary["settings"]["actor_rollout_ref.rollout.n"] = "4"
    (folder / "summary.json").write_text(json.dumps(summary))
    hostile = report_ok(folder, capsys)
    assert "actor_rollout_ref.rollout.n" in hostile and "not of its type" in hostile
    assert clean.count("<svg") == hostile.count("<svg")


def test_a_fifo_where_a_file_should_be_is_not_waited_on(run, tmp_path, capsys):
    """A named pipe in place of metrics.jsonl or a trace would block a reader forever: not read."""
    folder = copy_of(run, tmp_path)
    os.remove(folder / "metrics.jsonl")
    os.mkfifo(folder / "metrics.jsonl")
    trace = next((folder / "profile" / "step2").glob("*.json.gz"))
    os.remove(trace)
    os.mkfifo(trace)
    text = report_ok(folder, capsys)
    assert "no file" in text  # the trace: listed, not opened


def test_a_report_path_that_is_a_file_or_unwritable_is_one_line(run, tmp_path, capsys):
    folder = copy_of(run, tmp_path)
    shutil.rmtree(folder / "report", ignore_errors=True)
    (folder / "report").write_text("not a folder")
    assert cli.main(["profile", "report", str(folder)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists and is not a folder" in err
    os.remove(folder / "report")
    os.chmod(folder, 0o500)
    try:
        if os.access(folder, os.W_OK):  # root writes anyway: nothing to refuse
            return
        assert cli.main(["profile", "report", str(folder)]) == 1
        assert capsys.readouterr().err.count("\n") == 1
    finally:
        os.chmod(folder, 0o700)
