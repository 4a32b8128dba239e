"""`plait profile diff A B` in the "profile, fix, rerun" flow: A profiled on two steps (so its profiler line
predicts the cost of one window), B a rerun without the profiler. It printed a TypeError (B measured 0 s
of profiling: no ratio was computed, then formatted) and listed every operator of A as "removed"."""

import json

from plait import cli, driver
from plait.config import load_config
from tests.conftest import TINY

QUIET = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
         "trainer.total_training_steps=3"]
PROFILED = ["global_profiler.tool=torch", "global_profiler.steps=[1,2]", "actor_rollout_ref.actor.profiler.enable=true"]


def test_a_profiled_run_against_an_unprofiled_rerun(tmp_path, capsys):
    for name, extra in (("a", PROFILED), ("b", [])):
        cfg = load_config(None, [*TINY, *QUIET, f"trainer.default_local_dir={tmp_path / name}", *extra])
        driver.build(cfg, progress=False).run()
    capsys.readouterr()
    assert cli.main(["profile", "diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "operators: B has no torch traces (global_profiler.tool=torch): operators not compared" in out
    assert "removed" not in out
    row = next(line for line in out.splitlines() if line.startswith("A's verdict (profiler_share): spent_s"))
    assert "B measured 0 s" in row
    assert cli.main(["profile", "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["operators"] == {} and len(got["operators_not_compared"]) == 1
    assert set(got["load"]["a"]) == {"1m", "5m", "15m", "cpus"} and got["load"]["b"]["cpus"] >= 1


def test_runs_timed_under_loads_far_apart_are_warned_of(tmp_path, capsys):
    """issue 52: two identical runs diffed 1.6x apart without a word; each summary.json now records /proc/loadavg."""
    cfg = load_config(None, [*TINY, *QUIET, f"trainer.default_local_dir={tmp_path / 'a'}"])
    driver.build(cfg, progress=False).run()
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    for name, one in (("quiet", 0.3), ("same", 0.5), ("busy", 3.1)):
        (tmp_path / name).mkdir()
        for f in ("timeline.jsonl", "metrics.jsonl"):
            (tmp_path / name / f).write_bytes((tmp_path / "a" / f).read_bytes())
        (tmp_path / name / "summary.json").write_text(json.dumps({**summary, "load": {"1m": one, "5m": one, "15m": one,
                                                                                       "cpus": 2}}))
    capsys.readouterr()
    assert cli.main(["profile", "diff", str(tmp_path / "quiet"), str(tmp_path / "busy")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == ("warning: the machine's load differed: A 0.3 on 2 CPUs, B 3.1 on 2 (1-minute load average at "
                        "each run's end): the times below compare the machine too; rerun both on a quiet one")
    assert cli.main(["profile", "diff", str(tmp_path / "quiet"), str(tmp_path / "same")]) == 0
    assert "load differed" not in capsys.readouterr().out


def test_a_verdict_with_no_key_is_not_checked_against_a_rerun():
    """A keyless verdict (a straggler rank: no key fixes it) predicts a step no rerun measures: a profiled run
    against its unprofiled rerun read "2.70x the prediction" for a change nobody made."""
    from plait.profiler.analysis import diff
    from tests.profiler.test_verdict import BALANCED, facts
    slow = facts(BALANCED)
    slow.ranks = {"actor/update_actor": {0: {"s": 1.0, "wait_s": 0.0}, 1: {"s": 1.0, "wait_s": 0.0},
                                         2: {"s": 3.0, "wait_s": 0.0}}}
    rows = [r for r in diff.predictions(slow, facts(BALANCED)) if r["rule"] == "straggler"]
    assert rows and rows[0]["key"] == "" and rows[0]["measured_over_predicted"] is None
    line = diff.text({"a": "A", "b": "B", "steps": {"a": {"median_s": 1, "basis": "b"}, "b": {"median_s": 1, "basis": "b"}},
                      "load": {"warning": None}, "stages": [], "operators": {}, "operators_not_compared": [],
                      "memory": {"a": None, "b": None}, "predictions": rows}).splitlines()[-1]
    assert "x the prediction" not in line and "names no key to set, so B is not its rerun" in line
