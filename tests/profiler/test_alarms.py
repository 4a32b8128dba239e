"""Health alarms (plait/profiler/analysis/alarms.py): planted on tiny runs and on hand-written run files,
each named first, with its key, on the console, in verdict.json and on the report page; none on a
healthy run (the demo model warm-started, as `plait train` runs it).

The stall is planted in a hand-written timeline (a 12 s reward at step 3) rather than slept through."""

import json
import os
import shutil

import pytest
import torch

from plait import cli, driver
from plait.profiler.analysis import alarms as A
from plait.profiler.live import LiveReport

torch.set_num_threads(1)
QUIET = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1",
         "trainer.total_training_steps=4"]
# the demo preset's batch (32 prompts x 8) and length, its model warm-started long enough to answer some
HEALTHY = ["demo.warmstart_steps=600", "data.train_batch_size=32", "actor_rollout_ref.rollout.n=8",
           "actor_rollout_ref.actor.ppo_mini_batch_size=16", "data.max_response_length=8"]
ALWAYS_ONE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
'''


def run(tmp_path, tiny_config, *overrides) -> dict:
    lifecycle = driver.build(tiny_config(tmp_path, *QUIET, *overrides), progress=False)
    lifecycle.run()
    with open(os.path.join(tmp_path, "summary.json")) as f:
        return json.load(f)


def report(out, capsys) -> tuple[list[str], dict, str]:
    """`plait profile report OUT`: its console lines, verdict.json and the page."""
    capsys.readouterr()
    assert cli.main(["profile", "report", str(out), "--no-merge"]) == 0
    lines = capsys.readouterr().out.splitlines()
    return lines, json.load(open(out / "report" / "verdict.json")), (out / "report" / "index.html").read_text()


def test_a_healthy_run_raises_no_alarm(tmp_path, tiny_config, capsys):
    summary = run(tmp_path, tiny_config, *HEALTHY)
    assert summary["alarms"] == []
    assert not any(line.startswith("plait: alarm") for line in capsys.readouterr().err.splitlines())
    lines, judged, page = report(tmp_path, capsys)
    assert judged["schema"] == 1 and "SCHEMA" not in judged["thresholds"]
    assert judged["alarms"] == [] and not any("caveat" in v for v in judged["verdicts"])
    assert lines[0].startswith("verdict: ") and "<h2 id='alarms'>Alarms</h2><p class='note'>None" in page


def test_an_always_one_reward_cut_at_four_tokens(tmp_path, tiny_config, capsys):
    reward = tmp_path / "one.py"
    reward.write_text(ALWAYS_ONE)
    out = tmp_path / "run"
    summary = run(out, tiny_config, f"custom_reward_function.path={reward}", "reward.num_workers=0",
                  "data.max_response_length=4", "global_profiler.report_freq=2")
    found = {a["rule"]: a for a in summary["alarms"]}
    assert set(found) == {"no_signal", "truncation"}, summary["alarms"]
    assert found["no_signal"]["key"] == "algorithm.filter_groups.enable" and found["no_signal"]["step"] == 1
    assert found["truncation"]["key"] == "data.max_response_length"
    assert "cut at data.max_response_length=4" in found["truncation"]["line"]
    console = [line.removeprefix("plait: ") for line in capsys.readouterr().err.splitlines()]
    said = [line for line in console if line.startswith(("alarm: ", "verdict: "))]
    assert [line.split(" at step")[0] for line in said[:2]] == ["alarm: no_signal", "alarm: truncation"]
    assert "key algorithm.filter_groups.enable: " in said[0] and "key data.max_response_length: " in said[1]
    assert all(v["caveat"] == A.CAVEAT for v in summary["verdict"])
    # the live report (report_freq=2), as a run drives it: a step after a finished refresh says its alarms, once
    shutil.rmtree(out / "report")
    said = []
    live = LiveReport(str(out), 2, said.append)
    live.step(2)  # starts a refresh
    live.child.wait()
    live.step(4)  # says what it found, starts the next
    live.child.wait()
    live.step(6)
    live.close()
    assert [line.split(" at step")[0] for line in said] == ["plait: alarm (live report): no_signal",
                                                            "plait: alarm (live report): truncation"]

    lines, judged, page = report(out, capsys)
    assert [line.split(" at step")[0] for line in lines[:2]] == ["alarm: no_signal", "alarm: truncation"]
    assert [a["rule"] for a in judged["alarms"]] == ["no_signal", "truncation"]
    assert {a["key"] for a in judged["alarms"]} == {"algorithm.filter_groups.enable", "data.max_response_length"}
    assert page.index("id='alarms'") < page.index("id='verdict'")
    assert "key algorithm.filter_groups.enable: " in page and "key data.max_response_length: " in page



def spans_and_records(reward_s: list[float]) -> tuple[list[dict], list[dict]]:
    """A sync run's timeline and metrics, step by step: gen 0.2 s, reward as given, update 0.3 s."""
    spans, records, t = [], [], 1000.0
    for step, r in enumerate(reward_s, 1):
        begin = t
        for stage, took in (("gen", 0.2), ("reward", r), ("update_actor", 0.3)):
            spans.append({"step": step, "role": "trainer", "stage": stage, "pid": 1, "thread": "MainThread",
                          "start": t, "end": t + took, "version": step - 1})
            t += took
        spans.append({"step": step, "role": "trainer", "stage": "step", "pid": 1, "thread": "MainThread",
                      "start": begin, "end": t, "version": step - 1})
        records.append({"step": step, "timing_s/step": t - begin, "actor/grad_norm": 1.0, "actor/pg_loss": 0.1,
                        "response_length/clip_ratio": 0.0, "training/no_signal_group_ratio": 0.5})
    return spans, records


def test_a_stage_stuck_far_past_its_median_is_a_stall_naming_step_stage_and_rank():
    found = A.alarms(*spans_and_records([0.05, 0.05, 12.0, 0.05]))
    assert [(a.rule, a.step, a.stage, a.rank, a.key) for a in found] == [
        ("stall", 3, "reward", None, "reward.custom_reward_function.timeout")]
    assert "trainer reward was open 12 s, 240x its median 0.05 s" in found[0].line()
    assert A.alarms(*spans_and_records([0.05, 0.05, 9.0, 0.05])) == []   # under 10 s
    assert A.alarms(*spans_and_records([2.0, 2.0, 12.0, 2.0])) == []     # 6x its median
    assert A.alarms(*spans_and_records([12.0, 0.05, 0.05, 0.05])) == []  # the first call warms up
    spans, records = spans_and_records([0.05, 0.05, 0.05, 0.05])
    ranked = [{**s, "role": "actor", "rank": r, "start": s["start"] + 0.01, "stage": "update_actor"}
              for s in spans if s["stage"] == "update_actor" for r in (0, 1)]
    ranked[5]["end"] += 20.0  # rank 1 at step 3 ...
    waits = [{**s, "stage": "all_reduce", "rank": 0} for s in ranked if s["rank"] == 1]  # ... rank 0 waits for it
    (a,) = A.alarms(spans + ranked + waits, records)
    assert (a.step, a.stage, a.rank, a.key) == (3, "update_actor", 1, "") and "on rank 1" in a.line()


def write_run(out, spans: list[dict], records: list[dict]) -> None:
    out.mkdir()
    (out / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_the_report_names_a_stall_first(tmp_path, capsys):
    write_run(tmp_path / "run", *spans_and_records([0.05, 0.05, 12.0, 0.05]))
    lines, judged, page = report(tmp_path / "run", capsys)
    assert lines[0].startswith("alarm: stall at step 3: trainer reward was open 12 s")
    assert "key reward.custom_reward_function.timeout" in lines[0]
    (a,) = judged["alarms"]
    assert (a["rule"], a["step"], a["stage"], a["rank"]) == ("stall", 3, "reward", None) and a["evidence"]
    assert page.index("stall at step 3") < page.index("id='verdict'")


def test_a_nan_loss_and_an_exploding_grad_norm(tmp_path, capsys):
    spans, records = spans_and_records([0.05] * 6)
    records[1]["actor/pg_loss"] = "nan"  # as metrics.jsonl holds it (tracking.as_record)
    for r, norm in zip(records, (1.0, 1.2, 0.8, 1.1, 30.0, 1.0)):
        r["actor/grad_norm"] = norm
    found = {a.rule: a for a in A.alarms(spans, records)}
    assert set(found) == {"non_finite", "exploding"}
    assert (found["non_finite"].step, found["non_finite"].key) == (2, "actor_rollout_ref.actor.optim.lr")
    assert "actor/pg_loss was nan" in found["non_finite"].line()
    assert found["exploding"].step == 5 and "29x its median 1.05" in found["exploding"].line()
    write_run(tmp_path / "run", spans, records)  # through the report: a "nan" is not a finite metric, still read
    lines, judged, _ = report(tmp_path / "run", capsys)
    assert [a["rule"] for a in judged["alarms"]] == ["non_finite", "exploding"]
    assert lines[0].startswith("alarm: non_finite at step 2: actor/pg_loss was nan")


def test_engine_restarts_aborts_and_failed_sessions():
    spans, records = spans_and_records([0.05] * 4)
    records[1].update({"rollout/engine_restarts": 1, "response/aborted_ratio": 0.25})
    records[2].update({"agent/sessions": 32, "agent/failed_sessions": 8})
    records[3].update({"agent/sessions": 32, "agent/failed_sessions": 1})  # 3 %: not an alarm on its own
    found = {a.rule: a for a in A.alarms(spans, records)}
    assert {r: (a.step, a.key) for r, a in found.items()} == {
        "engine_restarts": (2, ""), "engine_aborts": (2, ""),
        "failed_sessions": (3, "actor_rollout_ref.rollout.agent.openai_agent.timeout")}
    assert found["failed_sessions"].evidence == ["agent/failed_sessions 8 of 32 at step 3"]


def test_every_key_an_alarm_names_is_a_config_key():
    from dataclasses import asdict

    from plait.config import load_config
    from plait.trainers.checkpoint import flatten
    keys = flatten(asdict(load_config(None, [])))
    named = {*A.STALL_KEYS.values(), "algorithm.filter_groups.enable", "data.max_response_length",
             "actor_rollout_ref.rollout.agent.openai_agent.timeout", "actor_rollout_ref.actor.optim.lr",
             "actor_rollout_ref.actor.grad_clip", "critic.optim.lr", "critic.grad_clip"}
    assert [k for k in named if k not in keys] == []


def test_the_no_signal_ratio_by_hand():
    from plait.trainers.metrics import no_signal_ratio
    adv = torch.tensor([[0.0, 0.0], [0.0, 0.0],      # group 7: every advantage zero
                        [0.5, 0.5], [-0.5, 0.0],     # group 3: signal
                        [0.0, 9.0], [0.0, 0.0]])     # group 5: signal only on a padding token
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0], [1, 0], [1, 1]]).bool()
    assert no_signal_ratio(adv, mask, torch.tensor([7, 7, 3, 3, 5, 5])) == pytest.approx(2 / 3)
