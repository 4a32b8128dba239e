"""Profiler artifacts belong to their run: a per-run default save_path, an earlier run's artifacts set
aside on a fresh start, the run dir recording where they went (so the report finds them), and the
end-of-run summary (summary.json) matching metrics.jsonl."""

import json

from plait import driver
from plait.profiler.analysis import build_report
from plait.profiler.naming import LOCATION, read_manifest
from plait.trainers.tracking import read_records

TORCH = ["global_profiler.tool=torch", "global_profiler.steps=[1]", "actor_rollout_ref.actor.profiler.enable=true",
         "trainer.total_training_steps=2", "trainer.test_freq=1", "trainer.save_freq=2"]


def run(cfg):
    driver.build(cfg, progress=False).run()


def test_default_save_path_is_the_runs_own(tmp_path, tiny_config):
    a, b = tiny_config(tmp_path / "a"), tiny_config(tmp_path / "b")
    assert a.global_profiler.save_path == str(tmp_path / "a" / "profile")
    assert b.global_profiler.save_path == str(tmp_path / "b" / "profile")


def test_two_profiled_runs_in_one_output_dir_keep_both_sets(tmp_path, tiny_config, capsys):
    out = tmp_path / "run"
    run(tiny_config(out, *TORCH))
    first = read_manifest(str(out / "profile"))
    assert [r["path"] for r in first] == ["step1/actor_rank0.pt.trace.json.gz"]
    # a fresh start (not a resume) of a torch_memory run in the same output dir
    run(tiny_config(out, *TORCH, "global_profiler.tool=torch_memory", "trainer.resume_mode=disable"))
    second = read_manifest(str(out / "profile"))
    assert [r["tool"] for r in second] == ["torch_memory"] and not any(r.get("resumed") for r in second)
    (aside,) = (out / "previous_runs").iterdir()
    kept = read_manifest(str(aside / "profile"))
    assert [(r["tool"], r["path"]) for r in kept] == [("torch", "step1/actor_rank0.pt.trace.json.gz")]
    assert (aside / "profile" / kept[0]["path"]).is_file()
    assert (aside / "checkpoints" / "global_step_2").is_dir()  # set aside together with its checkpoints
    assert "moved an earlier run's profiler artifacts" in capsys.readouterr().err


def test_report_names_a_custom_save_path_outside_the_run_and_reads_it_when_given(tmp_path, tiny_config):
    """A report reads only below the folders it is given: the recorded save_path outside the run's
    folder is named (with the flag that reads it), and read once given."""
    out, elsewhere = tmp_path / "run", tmp_path / "somewhere" / "else"
    run(tiny_config(out, *TORCH, f"global_profiler.save_path={elsewhere}"))
    assert json.loads((out / LOCATION).read_text())["save_path"] == str(elsewhere)
    text = build_report(str(out))
    assert f"profiled artifacts: 0 (0 torch traces; no manifest.jsonl in {out}, {out / 'profile'}, {elsewhere} " \
           f"(the run's recorded save_path: outside {out}, not read; give --profile))" in text
    text = build_report(str(out), profile=str(elsewhere))
    assert "profiled artifacts: 1 (1 torch traces; " + str(elsewhere) in text


def test_a_report_that_finds_nothing_says_where_it_looked(tmp_path, tiny_config):
    out = tmp_path / "run"
    run(tiny_config(out, "trainer.total_training_steps=1"))
    text = build_report(str(out))
    assert "profiled artifacts: 0" in text and f"no manifest.jsonl in {out / 'profile'}" in text


def test_summary_matches_metrics_jsonl(tmp_path, tiny_config, capsys):
    out = tmp_path / "run"
    run(tiny_config(out, *TORCH))
    s = json.loads((out / "summary.json").read_text())
    records = read_records(str(out / "metrics.jsonl"))
    steps = [r for r in records if r["step"] >= 1]
    assert s["status"] == "done" and s["steps"] == {"first": 1, "last": 2, "done": 2, "run_last_step": 2}
    w = s["wall_s"]
    assert set(w) == {"total", "startup", "steps", "validation", "checkpoints", "profiler", "other"}
    assert abs(w["checkpoints"] - sum(r.get("timing_s/save_checkpoint", 0) for r in steps)) < 1e-9
    assert w["validation"] >= sum(r["timing_s/testing"] for r in steps) > 0
    assert w["profiler"] > 0 and w["startup"] > 0  # a window was written; the model was built
    assert abs(sum(v for k, v in w.items() if k != "total") - w["total"]) < 1e-6
    key = s["validation"]["key"]
    vals = [(r["step"], r[key]) for r in records if key in r]
    assert vals[0][0] == 0  # val_before_train
    assert s["validation"]["first"] == {"step": vals[0][0], "value": vals[0][1]}
    assert s["validation"]["last"] == {"step": vals[-1][0], "value": vals[-1][1]}
    assert s["validation"]["best"]["value"] == max(v for _, v in vals)
    # one step time everywhere: the trainer's cycle outside profiler windows (the verdict's, the page's)
    from plait.profiler.analysis.verdict import of_run
    from plait.profiler.timeline import read_timeline
    f = of_run(read_timeline(str(out / "timeline.jsonl")), steps, s)
    assert s["step_s"]["median"] == f.step_s and s["step_s"]["basis"] == f.basis == "median over the 1 step outside profiler windows"
    assert s["memory_peak"]["gb"] == max(v for r in steps if r["step"] != 1 for k, v in r.items()  # 1: profiled
                                         if k.startswith("memory/") and "/step/" not in k and "reserved" not in k)
    build_report(str(out))  # the report's memory peak is the summary's, ties included (RSS is flat once memory is kept)
    peak = s["memory_peak"]
    page = (out / "report" / "index.html").read_text()
    assert f"in stage {peak['stage']} at step {peak['step']} ({peak['metric']})" in page
    assert f"p50 {s['step_s']['median']:.3f} s" in page and page.count(" s · p90 ") == 1  # one step length on the page
    assert s["paths"]["checkpoint"] == str(out / "checkpoints" / "global_step_2")
    assert s["paths"]["profile"] == str(out / "profile") and s["paths"]["metrics"] == str(out / "metrics.jsonl")
    assert s["next"] == f"plait profile report {out}"
    err = capsys.readouterr().err
    assert f"next: plait profile report {out}" in err and "done: steps 1-2 of 2" in err


def test_a_run_with_nothing_to_do_says_so(tmp_path, tiny_config, capsys, caplog):
    out = tmp_path / "run"
    run(tiny_config(out, "trainer.total_training_steps=1", "trainer.save_freq=1"))
    capsys.readouterr()
    run(tiny_config(out, "trainer.total_training_steps=1", "global_profiler.tool=torch",
                    "global_profiler.steps=[1]", "actor_rollout_ref.actor.profiler.enable=true"))
    err = capsys.readouterr().err
    assert "nothing to do: resumed after step 1 and the run's last step is 1" in err
    assert "steps [1] come before this run's first step 2" in caplog.text
