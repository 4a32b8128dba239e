"""The end-of-run console lines (plait/trainers/summary.py): a run whose verdict found nothing still says so
in a verdict line (it said nothing, and silence read as "no verdict was made")."""

from plait.trainers.summary import summary_lines


def summary(verdict: list, basis) -> dict:
    return {"status": "done", "steps": {"first": 1, "last": 3, "done": 3, "run_last_step": 3},
            "wall_s": {k: 1.0 for k in ("total", "startup", "steps", "validation", "checkpoints", "profiler", "other")},
            "verdict": verdict, "step_s": {"median": 0.5, "p90": 0.6, "basis": basis},
            "top_stages": [{"stage": "update_actor", "share": 0.5}], "validation": None, "memory_peak": None,
            "paths": {"output_dir": "/o", "metrics": "/o/metrics.jsonl"}, "next": "plait profile report /o"}


def test_nothing_standing_out_is_a_verdict_line_of_its_own():
    lines = summary_lines(summary([], "median over the steps"), "/o/summary.json")
    assert lines[1].startswith("verdict: nothing stands out (no stage or setting could save 10 % of the step")
    told = summary_lines(summary([{"line": "gen is 60 % of the step"}], "median over the steps"), "/o/summary.json")
    assert [line for line in told if line.startswith("verdict:")] == ["verdict: gen is 60 % of the step"]
    # no verdict was computed (it failed, with its own warning): nothing is claimed
    assert not [line for line in summary_lines(summary([], None), "/o/summary.json") if line.startswith("verdict:")]
