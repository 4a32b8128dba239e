"""The served-session verdict (profiler/analysis/served.py) on a hand-made Tinker timeline, its numbers computed by
hand; tests/serving/test_tinker.py runs it on loops written with the real SDK."""

import pytest

from plait.profiler.analysis import served

TRAIN, SAMPLER, OTHER = "s1:train:0", "s1:train:0:sample:0", "s1:train:0:sample:1"


def job(client: str, stage: str, queued: float, start: float, end: float) -> list[dict]:
    """A request as the server writes it: its queue span, then its own."""
    return [{"role": "tinker", "stage": "queue", "start": queued, "end": start, "session": client},
            {"role": "tinker", "stage": stage, "start": start, "end": end, "session": client}]


def timeline(calls: list[tuple[str, float, float, float]]) -> list[dict]:
    spans = [*job(TRAIN, "create", 0.0, 0.0, 0.1), *job(TRAIN, "forward_backward", 0.2, 0.2, 0.3),
             *job(TRAIN, "optim_step", 0.21, 0.3, 0.32)]
    for client, queued, start, end in calls:
        spans += job(client, "sample", queued, start, end)
        spans.append({"role": "tinker", "stage": "load_weights", "start": start, "end": start + 0.01, "session": client})
    spans.append({"role": "trainer", "stage": "gen", "start": 0.0, "end": 9.0})  # not a served span: not read
    return spans


def test_a_sessions_busy_time_idle_gaps_and_samples_awaited_one_by_one():
    # three engine calls of one sampler, each sent once the one before had ended
    s, = served.sessions(timeline([(SAMPLER, 0.4, 0.4, 0.5), (SAMPLER, 0.5, 0.5, 0.6), (SAMPLER, 0.65, 0.65, 0.75)]))
    assert (s.id, s.start, s.end, s.requests, s.optim_steps) == ("s1", 0.0, 0.75, 6, 1)
    assert s.busy_s == pytest.approx(0.1 + 0.12 + 0.3)
    assert [(pytest.approx(g), after) for g, after in s.idle_gaps] == [(0.1, "create"), (0.08, "optim_step"),
                                                                       (0.05, "sample")]
    assert s.serial == {SAMPLER: [pytest.approx(0.1)] * 3}
    v = served.samples_one_by_one(s)
    assert v.share == pytest.approx(0.3 / 0.75) and v.saving == pytest.approx(0.2 / 0.75)  # all but the longest
    assert v.predicted == {"sample_s_at_most": pytest.approx(0.3), "sample_s_at_least": pytest.approx(0.1)}
    idle = served.loop_between_requests(s)  # 0.23 s of 0.75 s idle: 31 %
    assert idle.share == pytest.approx(0.23 / 0.75) and "the longest 0.1 s (after a create)" in idle.driver
    assert [v.rule for v in served.verdicts(timeline([(SAMPLER, 0.4, 0.4, 0.5), (SAMPLER, 0.5, 0.5, 0.6),
                                                      (SAMPLER, 0.65, 0.65, 0.75)]))] == ["loop_between_requests",
                                                                                          "samples_one_by_one"]


def test_requests_sent_together_are_not_awaited_one_by_one_and_samplers_in_turn_reload():
    # the second call's request arrived while the first ran (sent together, sampled in two calls: a seeded one)
    s, = served.sessions(timeline([(SAMPLER, 0.4, 0.4, 0.5), (SAMPLER, 0.45, 0.5, 0.6), (SAMPLER, 0.46, 0.6, 0.7)]))
    assert s.serial == {} and served.samples_one_by_one(s) is None
    # two samplers sampled in turn: 4 loads for 2 samplers, 0.04 s of 0.9 s: under 10 %, not said ...
    calls = [(SAMPLER, 0.4, 0.4, 0.5), (OTHER, 0.5, 0.5, 0.6), (SAMPLER, 0.6, 0.6, 0.7), (OTHER, 0.7, 0.7, 0.9)]
    s, = served.sessions(timeline(calls))
    assert (s.loads, s.samplers, s.load_s) == (4, 2, pytest.approx(0.04)) and served.sampler_switches(s) is None
    # ... unless the loads are slow: 0.1 s each
    spans = [{**sp, "end": sp["start"] + 0.1} if sp["stage"] == "load_weights" else sp for sp in timeline(calls)]
    v = served.sampler_switches(served.sessions(spans)[0])
    assert v.share == pytest.approx(0.4 / 0.9) and v.saving == pytest.approx(0.2 / 0.9)  # two loads too many


def test_a_request_queued_behind_another_sessions_job_is_not_the_loops_time():
    """Waiting in the server's queue is time at the server: only the time none of a session's requests was there
    (queued or running) is the loop's."""
    spans = [*job(TRAIN, "create", 0.0, 0.0, 0.1), *job(TRAIN, "forward_backward", 0.1, 0.9, 1.0)]  # queued 0.8 s
    s, = served.sessions(spans)
    assert s.busy_s == pytest.approx(0.2) and s.idle_gaps == [] and served.loop_between_requests(s) is None


def test_a_session_without_a_job_is_not_read():
    """A timeline cut before any job ran (or crafted): its queue spans alone are no session."""
    assert served.sessions(job(TRAIN, "create", 0.0, 0.0, 0.1)[:1]) == [] and served.verdicts([]) == []
