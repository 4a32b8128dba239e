"""StepProfiler driving a real ProfilerSession over a fake 6-step run: manifest records, failure
path and the finish hook (a real shell command writing a marker file)."""

import gzip
import json
import logging
import os

import pytest
import torch

from plait.profiler import (GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig, StepProfiler,
                            read_manifest)

torch.set_num_threads(1)
LAST = 6
HOOK = 'echo "$PLAIT_PROFILE_TOOL $PLAIT_PROFILE_RANK $PLAIT_PROFILE_ROLE $PLAIT_PROFILE_SAVE_PATH" >> "$PLAIT_PROFILE_SAVE_PATH/hook_ran"'


def run(tmp_path, steps, continuous, fail_at=None, hook=HOOK, tool="torch"):
    """A lifecycle-shaped loop: begin_step, annotated stages, end_step, close(error) in finally."""
    save = tmp_path / "profile"
    cfg = GlobalProfilerConfig(tool=tool, steps=steps, profile_continuous_steps=continuous,
                               save_path=str(save), finish_hook_cmd=hook)
    session = ProfilerSession(cfg, {"actor": RoleProfilerConfig(enable=True)}, rank=0)
    actor = session.for_role("actor")
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    profiler = StepProfiler(cfg, LAST, [session])
    error = None
    try:
        for step in range(1, LAST + 1):
            profiler.begin_step(step, version=step - 1)
            with actor.annotate("update_actor"):
                model(torch.randn(4, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
            if step == fail_at:
                raise RuntimeError(f"custom reward function failed at step {step}")
            profiler.end_step(step)
    except BaseException as err:
        error = err
        raise
    finally:
        profiler.close(error)
    return save


def summary(save):
    return [(r["steps"], r["role"], r["path"], r["policy_version"], r["complete"]) for r in read_manifest(str(save))]


def hook_lines(save):
    path = save / "hook_ran"
    return path.read_text().splitlines() if path.exists() else []


def stage_names(path):
    with gzip.open(path, "rt") as f:
        return {e.get("name") for e in json.load(f)["traceEvents"]}


def test_continuous_steps_share_one_window(tmp_path):
    save = run(tmp_path, [2, 3], continuous=True)
    assert summary(save) == [([2, 3], "actor", "step2-3/actor_rank0.pt.trace.json.gz", 1, True)]
    assert "actor/update_actor" in stage_names(save / "step2-3/actor_rank0.pt.trace.json.gz")
    assert hook_lines(save) == [f"torch 0 driver {save}"]


def test_separate_steps_get_separate_windows(tmp_path):
    save = run(tmp_path, [2, 3], continuous=False)
    assert summary(save) == [([2, 2], "actor", "step2/actor_rank0.pt.trace.json.gz", 1, True),
                             ([3, 3], "actor", "step3/actor_rank0.pt.trace.json.gz", 2, True)]
    assert sorted(os.listdir(save)) == ["hook_ran", "manifest.jsonl", "step2", "step3"]
    assert len(hook_lines(save)) == 1


@pytest.mark.parametrize("continuous, expected", [
    (True, [([5, 6], "actor", "step5-6/actor_rank0.pt.trace.json.gz", 4, True)]),
    (False, [([5, 5], "actor", "step5/actor_rank0.pt.trace.json.gz", 4, True),
             ([6, 6], "actor", "step6/actor_rank0.pt.trace.json.gz", 5, True)]),
])
def test_steps_past_the_run_warn_once_and_close_at_the_last_step(tmp_path, caplog, continuous, expected):
    with caplog.at_level(logging.WARNING, logger="plait.profiler"):
        save = run(tmp_path, [LAST - 1, LAST, LAST + 1], continuous)
    assert summary(save) == expected
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "steps 7 is beyond the run's last step 6" in warnings[0]
    assert len(hook_lines(save)) == 1


def test_step_that_raises_flushes_an_incomplete_artifact_and_runs_the_hook(tmp_path):
    with pytest.raises(RuntimeError, match="custom reward function failed at step 2"):
        run(tmp_path, [2], continuous=False, fail_at=2)
    save = tmp_path / "profile"
    assert summary(save) == [([2, 2], "actor", "step2/actor_rank0.pt.trace.json.gz", 1, False)]
    assert "actor/update_actor" in stage_names(save / "step2/actor_rank0.pt.trace.json.gz")
    assert hook_lines(save) == [f"torch 0 driver {save}"]


def test_failure_mid_continuous_window(tmp_path):
    with pytest.raises(RuntimeError):
        run(tmp_path, [2, 3, 4], continuous=True, fail_at=3)
    assert summary(tmp_path / "profile") == [([2, 4], "actor", "step2-4/actor_rank0.pt.trace.json.gz", 1, False)]
    assert len(hook_lines(tmp_path / "profile")) == 1


def test_failing_hook_is_reported_not_raised(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="plait.profiler"):
        save = run(tmp_path, [1], continuous=False, hook="echo broken >&2; exit 3")
    assert summary(save)[0][-1] is True
    assert [r.getMessage() for r in caplog.records] == ["profiler finish_hook_cmd exited with status 3"]


def test_hook_gets_no_config_spliced_into_its_command(tmp_path):
    # A save_path with shell metacharacters reaches the hook only through its environment.
    save = tmp_path / "a dir; touch pwned"
    cfg = GlobalProfilerConfig(tool="torch", steps=[1], save_path=str(save), finish_hook_cmd=HOOK)
    profiler = StepProfiler(cfg, 1, [])
    os.makedirs(save)
    profiler.begin_step(1, version=0)
    profiler.end_step(1)
    profiler.close()
    assert hook_lines(save) == [f"torch 0 driver {save}"]
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")


def test_profiler_off_writes_nothing(tmp_path):
    save = run(tmp_path, [2, 3], continuous=True, tool=None)
    assert not save.exists()


def test_a_window_says_one_line_while_its_traces_are_written(tmp_path, capsys):
    """Writing a window's traces took 16.9 s on SmolLM2 with nothing on the console: one line each window."""
    run(tmp_path, [2, 3, 5], continuous=True, hook=None)
    lines = [line for line in capsys.readouterr().err.splitlines() if "writing the torch traces" in line]
    assert lines == [f"plait: profiler: writing the torch traces of steps 2-3 to {tmp_path / 'profile'} ...",
                     f"plait: profiler: writing the torch traces of step 5 to {tmp_path / 'profile'} ..."]
