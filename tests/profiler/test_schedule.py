"""Properties of the window plan and of StepProfiler driving it over whole runs (no torch work).

A fake target records start/stop calls, the finish hook is replaced by a recorder, and a run is
simulated the way the lifecycle drives it: begin_step, the step (which may raise), end_step, and
close(error) in a finally block, optionally resumed at a later step.
"""

from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from plait.profiler import GlobalProfilerConfig, StepProfiler, plan
from plait.profiler import driver


class Recorder:
    """A ProfileTarget that logs calls into a shared event list."""

    def __init__(self, events):
        self.events, self.open = events, False

    def start_profile(self, first, last, version):
        self.events.append(("start", first, last, version))
        self.open = True

    def stop_profile(self, complete):
        self.events.append(("stop", complete))
        self.open = False
        return []


class Boom(Exception):
    pass


def simulate(steps, last, continuous, fail_at=None, resume_at=1):
    events = []
    cfg = GlobalProfilerConfig(tool="torch", steps=steps, profile_continuous_steps=continuous,
                               finish_hook_cmd="true")
    target = Recorder(events)
    with mock.patch.object(driver, "run_finish_hook", lambda *a: events.append(("hook",))):
        profiler = StepProfiler(cfg, last, [target])
        error = None
        try:
            for step in range(resume_at, last + 1):
                profiler.begin_step(step, version=step - 1)
                events.append(("step", step, target.open))
                if step == fail_at:
                    raise Boom(step)
                profiler.end_step(step)
        except Boom as err:
            error = err
        finally:
            profiler.close(error)
            profiler.close(error)  # idempotent
    return events


runs = st.fixed_dictionaries({
    "steps": st.lists(st.integers(1, 30), max_size=12),
    "last": st.integers(0, 25),
    "continuous": st.booleans(),
})


@settings(max_examples=300, deadline=None)
@given(runs)
def test_plan_windows_cover_exactly_the_reachable_listed_steps(run):
    p = plan(run["steps"], run["last"], run["continuous"])
    listed = set(run["steps"])
    covered = [s for w in p.windows for s in range(w.first, w.last + 1)]
    assert sorted(covered) == sorted(s for s in listed if s <= run["last"])  # each exactly once
    assert all(1 <= w.first <= w.last <= run["last"] for w in p.windows)
    assert list(p.windows) == sorted(p.windows, key=lambda w: w.first)
    if run["continuous"]:  # consecutive listed steps share one window
        assert all(b.first > a.last + 1 for a, b in zip(p.windows, p.windows[1:]))
    else:
        assert all(w.first == w.last for w in p.windows)
    for step in range(1, run["last"] + 1):
        w = p.window_of(step)
        assert (p.opens(step) is not None) == (w is not None and w.first == step)
        assert (p.closes(step) is not None) == (w is not None and w.last == step)
    beyond = sorted(s for s in listed if s > run["last"])
    assert (p.warning is None) == (not beyond)
    if beyond:
        assert "\n" not in p.warning and all(str(s) in p.warning for s in beyond)
    assert p.hook_step == (p.windows[-1].last if p.windows else None)


@settings(max_examples=300, deadline=None)
@given(runs, st.data())
def test_driven_run_balances_windows_and_runs_the_hook_once(run, data):
    last = run["last"]
    resume_at = data.draw(st.integers(1, max(last, 1)), label="resume_at")
    fail_at = data.draw(st.none() | st.integers(resume_at, max(last, resume_at)), label="fail_at")
    events = simulate(run["steps"], last, run["continuous"], fail_at, resume_at)

    calls = [e for e in events if e[0] in ("start", "stop")]
    assert [e[0] for e in calls] == ["start", "stop"] * (len(calls) // 2)  # alternate and balance

    listed = {s for s in run["steps"] if s <= last}
    for _, step, inside in (e for e in events if e[0] == "step"):
        assert inside == (step in listed)

    p = plan(run["steps"], last, run["continuous"])
    for (_, first, w_last, version) in (e for e in calls if e[0] == "start"):
        w = p.window_of(first)
        assert w is not None and w_last == w.last and (first == w.first or first == resume_at)
        assert version == first - 1

    hooks = [i for i, e in enumerate(events) if e[0] == "hook"]
    assert len(hooks) == (1 if calls else 0)
    if hooks:
        assert hooks[0] > max(i for i, e in enumerate(events) if e[0] == "stop")  # after the last close
    failed = fail_at is not None and fail_at <= last
    stops = [e[1] for e in calls if e[0] == "stop"]
    if failed and fail_at in listed:  # the window open at the failure closes there, incomplete
        assert stops[-1] is False and all(stops[:-1])
    else:
        assert all(stops)
    if not failed and hooks:  # the hook runs as the last window closes, not at run end
        hook_step = p.hook_step
        assert events[hooks[0] - 2] == ("step", hook_step, True)


def test_beyond_run_continuous_window_closes_at_last_step():
    events = simulate([9, 10, 11], last=10, continuous=True)
    assert [e for e in events if e[0] != "step"] == [("start", 9, 10, 8), ("stop", True), ("hook",)]


def test_no_listed_step_reachable_means_no_window_and_no_hook():
    events = simulate([12], last=10, continuous=False)
    assert [e for e in events if e[0] != "step"] == []


def test_failure_before_any_window_runs_no_hook_and_between_windows_runs_it():
    assert [e for e in simulate([5], 10, False, fail_at=3) if e[0] != "step"] == []
    assert [e for e in simulate([2, 5], 10, False, fail_at=3) if e[0] != "step"] == [
        ("start", 2, 2, 1), ("stop", True), ("hook",)]
