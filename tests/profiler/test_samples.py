"""Per-sample lifecycle (samples.jsonl, plait/profiler/samples.py): every sample of one_step_off and
fully_async runs (partial rollout on), and of filter_groups, from submission to the update that consumed it
or the filter that dropped it, with its staleness; the report's histograms, slowest samples and the merged
trace's lanes; and the producer API another component (an agent loop, a session gateway) appends with."""

import json
from collections import defaultdict

import pytest

from plait import cli, driver
from plait.profiler.analysis.traces import nesting_violations, read_merged
from plait.profiler.samples import SampleLog, add_span, sample_ids

QUIET = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.total_training_steps=4"]
MODES = {
    "one_step_off": ["trainer.mode=one_step_off", "trainer.placement=separated"],
    "fully_async": ["trainer.mode=fully_async", "trainer.placement=separated", "async_training.staleness_threshold=1",
                    "async_training.partial_rollout=true", "data.max_response_length=24",
                    "actor_rollout_ref.rollout.ignore_eos=true"],
}


def records(folder) -> list[dict]:
    return [json.loads(line) for line in open(folder / "samples.jsonl")]


def lives(rows: list[dict]) -> dict[str, list[dict]]:
    out = defaultdict(list)
    for r in rows:
        out[r["sample"]].append(r)
    return out


@pytest.mark.parametrize("mode", list(MODES))
def test_every_sample_from_submission_to_its_update(mode, tmp_path, tiny_config, capsys):
    driver.build(tiny_config(tmp_path, *QUIET, *MODES[mode]), progress=False).run()
    rows = records(tmp_path)
    metrics = {m["step"]: m for m in map(json.loads, open(tmp_path / "metrics.jsonl")) if m["step"] >= 1}
    consumed = [r for r in rows if r["span"] == "consumed"]
    assert len(consumed) == len({r["sample"] for r in consumed}) == sum(
        16 if mode == "one_step_off" else 8 for _ in metrics)  # each trained sample once: 4 steps of its batch
    for step, m in metrics.items():  # the staleness each sample was trained at: the step's metrics
        stale = [r["attrs"]["staleness"] for r in consumed if r["step"] == step]
        assert min(stale) == m["training/staleness/min"] and max(stale) == m["training/staleness/max"]
    for sample, spans in lives(rows).items():
        names = [r["span"] for r in sorted(spans, key=lambda r: (r["start"], r["end"]))]
        assert "gen" in names and names[-1] in ("consumed", "discarded"), (sample, names)
        if names[-1] == "consumed":
            assert "reward" in names and names.index("gen") < names.index("reward")
        for a, b in zip(sorted(spans, key=lambda r: r["start"]), sorted(spans, key=lambda r: r["start"])[1:]):
            assert a["end"] <= b["start"] + 1e-6 or a["span"] == b["span"] == "gen"  # one after the other
    kinds = {r["span"] for r in rows}
    if mode == "one_step_off":
        assert "queue" in kinds and "queued" in kinds  # submitted before its generation thread took it
    else:
        assert "queued" in kinds and {r["sample"] for r in rows if r["span"] == "resume"} <= {r["sample"] for r in consumed}
    capsys.readouterr()
    assert cli.main(["profile", "report", str(tmp_path)]) == 0
    page = (tmp_path / "report" / "index.html").read_text()
    assert "id='samples'" in page and "The slowest samples" in page and 'class="histogram"' in page
    assert f"consumed: {len(consumed)}" in page
    events = read_merged(str(tmp_path / "report" / "timeline.json.gz"))["traceEvents"]
    lanes = [e for e in events if e.get("cat") == "plait.sample"]
    assert lanes and {e["args"]["sample"] for e in lanes} >= {r["sample"] for r in consumed}
    assert nesting_violations(events) == 0


EVERY_LM_MODE = {"sync": [], **MODES, "colocate_async": ["trainer.v1.trainer_mode=colocate_async"],
                 "separate_async": ["trainer.v1.trainer_mode=separate_async",
                                    "trainer.v1.separate_async.parameter_sync_step=2"]}


@pytest.mark.parametrize("mode", list(EVERY_LM_MODE))
def test_every_lm_mode_writes_each_trained_samples_generation_and_consumption(mode, tmp_path, tiny_config):
    """One rollout side for every mode: verl's V1 modes included (their rollouter wrote no samples.jsonl)."""
    overrides = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.total_training_steps=2"]
    driver.build(tiny_config(tmp_path, *overrides, *EVERY_LM_MODE[mode]), progress=False).run()
    rows = records(tmp_path)
    consumed = {r["sample"] for r in rows if r["span"] == "consumed"}
    per_step = 8 if mode == "fully_async" else 16  # fully_async: ppo_mini_batch_size prompts x n per step
    assert len(consumed) == len([r for r in rows if r["span"] == "consumed"]) == 2 * per_step
    generated = {r["sample"] for r in rows if r["span"] == "gen"}
    assert consumed <= generated, sorted(consumed - generated)[:3]


def test_filtered_groups_are_dropped_samples(tmp_path, tiny_config):
    from tests.trainers.test_filter_groups import reward
    driver.build(tiny_config(tmp_path, *reward(tmp_path, "parity"), "algorithm.filter_groups.enable=true",
                             "algorithm.adv_estimator=grpo", "trainer.total_training_steps=2", "trainer.test_freq=-1",
                             "trainer.val_before_train=false"), progress=False).run()
    rows = records(tmp_path)
    ends = {}
    for r in rows:
        if r["span"] in ("consumed", "dropped"):
            assert r["sample"] not in ends  # one end per sample
            ends[r["sample"]] = r["span"]
    metrics = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert list(ends.values()).count("consumed") == 2 * 16
    evicted = sum(m["training/filter_groups/evicted_samples"] for m in metrics if m["step"] >= 1)  # groups
    assert list(ends.values()).count("dropped") == 4 * evicted  # each dropped group's rollout.n samples
    assert all(any(r["span"] == "reward" and r["sample"] == s for r in rows) for s in ends)  # scored, then filtered


def test_the_producer_api_appends_spans_under_the_rows_sample_id(tmp_path):
    """What a component outside the driver does (an agent loop, a gateway session): add_span on the row's
    info dict; the driver writes those spans under the row's id when the batch arrives."""
    log = SampleLog()
    log.open(str(tmp_path / "samples.jsonl"))
    ids = sample_ids(2, [7, 7, 9])
    assert ids == ["2.7.0", "2.7.1", "2.9.0"]
    infos = [{}, {}, {}]
    add_span(infos[1], "request_queue", 10.0, 10.5, session="s-1")
    add_span(infos[1], "decode", 10.5, 12.0, tokens=40)
    log.versions(ids, [3, 3, 3])
    log.from_infos(ids, infos)
    log.take(ids, 13.0)                      # the trainer takes the batch: samples 2.7.1 waited since 12.0
    log.finish(ids[:1], "consumed", 14.0, staleness=[1])
    log.flush(5)
    log.close(6)                             # 2.7.1 and 2.9.0 were never trained on
    rows = records(tmp_path)
    assert [(r["sample"], r["span"], r["step"]) for r in rows] == [
        ("2.7.1", "request_queue", 5), ("2.7.1", "decode", 5), ("2.7.1", "queued", 5), ("2.7.0", "consumed", 5),
        ("2.7.1", "discarded", 6), ("2.9.0", "discarded", 6)]
    assert rows[0]["attrs"] == {"session": "s-1"} and rows[1]["version"] == 3 and rows[3]["attrs"] == {"staleness": 1}
    assert rows[2]["start"] == 12.0 and rows[2]["end"] == 13.0


def test_a_gateway_sessions_spans_count_as_generating_and_waiting():
    """The report's histograms read a session's calls (request_queue, prefill, decode) and its agent's own time."""
    from plait.profiler.analysis.report import GENERATING, WAITING, part_s, sample_lives
    spans = [("agent", 0.0, 0.5), ("request_queue", 0.5, 1.0), ("prefill", 1.0, 1.25), ("decode", 1.25, 3.0),
             ("agent", 3.0, 3.5), ("queued", 3.5, 5.0), ("reward", 5.0, 5.5), ("consumed", 5.5, 5.5)]
    life = sample_lives([{"sample": "0.1.0", "span": n, "start": a, "end": b, "step": 1, "attrs": {}}
                         for n, a, b in spans])["0.1.0"]
    assert part_s(life, GENERATING) == 3.0 and part_s(life, WAITING) == 2.0 and life["total"] == 5.5


def test_a_run_without_samples_writes_no_file(tmp_path):
    log = SampleLog()
    log.open(str(tmp_path / "samples.jsonl"))
    log.flush(1)
    log.close(1)
    assert not (tmp_path / "samples.jsonl").exists()


def test_samples_jsonl_has_an_off_switch(tmp_path, tiny_config):
    """It grows by some 500 bytes per sample per step: `global_profiler.samples=false` writes none, and the
    run and its summary are otherwise the same."""
    from plait import driver
    for name, extra in (("on", []), ("off", ["global_profiler.samples=false"])):
        driver.build(tiny_config(tmp_path / name, "trainer.total_training_steps=2", "trainer.test_freq=-1", *extra),
                     progress=False).run()
    assert (tmp_path / "on" / "samples.jsonl").stat().st_size > 0
    assert not (tmp_path / "off" / "samples.jsonl").exists() and (tmp_path / "off" / "summary.json").exists()
