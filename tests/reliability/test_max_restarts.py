"""trainer.max_restarts: a crash that is not the user's (the rollout engine dying twice in a step here, a
Ray worker process killed on Ray) resumes from the newest checkpoint, each restart one line, and the run
ends with the numbers of an uninterrupted one; a user's failure (a reward that raises) is never retried;
off by default."""

import os
import signal

import pytest
import torch

from plait import driver
from plait.errors import EngineFailed, RunError
from plait.trainers.lifecycle import read_metrics
from tests.workers.test_engine_restart import Deaths, planted

torch.set_num_threads(1)
COMMON = ("trainer.total_training_steps=4", "trainer.save_freq=1", "trainer.test_freq=-1", "trainer.val_before_train=false")
NOT_COMPARED = ("timing", "perf/", "memory/", "trainer/", "rollouter/", "rollout/engine_restarts", "training/weight_sync")


def numbers(out):
    return [{k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in read_metrics(out / "metrics.jsonl")]


@pytest.fixture
def length_reward(tmp_path):
    """A reward that varies within each group, so the steps change the weights (and a resume must restore them)."""
    (tmp_path / "length.py").write_text("def length(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return float(len(solution_str))\n")
    return (f"custom_reward_function.path={tmp_path / 'length.py'}", "custom_reward_function.name=length",
            "reward.num_workers=0")


def test_a_crash_that_is_not_the_users_resumes_from_the_newest_checkpoint(tmp_path, tiny_config, monkeypatch, capfd,
                                                                          length_reward):
    driver.run(tiny_config(tmp_path / "full", *COMMON, *length_reward), progress=False)
    planted(monkeypatch, Deaths({3, 4}))  # step 3's generate dies, and its re-issue: EngineFailed
    cfg = tiny_config(tmp_path / "run", *COMMON, *length_reward, "actor_rollout_ref.rollout.name=dying",
                      "trainer.max_restarts=2", "trainer.resume_mode=disable")
    driver.run(cfg, progress=False)
    err = capfd.readouterr().err
    assert err.count("plait: restart ") == 1
    assert ("plait: restart 1 of 2 (trainer.max_restarts) after: the rollout engine failed again in step 3, after a "
            "restart in the same step: the engine process was killed (planted); resuming from the newest checkpoint "
            "(step 2)") in err
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]
    for a, b in zip(numbers(tmp_path / "full"), numbers(tmp_path / "run"), strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)


def test_off_by_default_and_a_users_failure_is_never_retried(tmp_path, tiny_config, monkeypatch, capfd):
    planted(monkeypatch, Deaths({3, 4}))
    with pytest.raises(EngineFailed):
        driver.run(tiny_config(tmp_path / "off", *COMMON, "actor_rollout_ref.rollout.name=dying"), progress=False)
    (tmp_path / "reward.py").write_text("calls = 0\n"
                                        "def boom(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    global calls\n    calls += 1\n"
                                        "    if calls > 16:\n        raise KeyError('reward failed')\n"
                                        "    return 0.0\n")
    with pytest.raises(RunError, match="raised KeyError"):
        driver.run(tiny_config(tmp_path / "user", *COMMON, f"custom_reward_function.path={tmp_path / 'reward.py'}",
                               "custom_reward_function.name=boom", "reward.num_workers=0", "trainer.max_restarts=3"),
                   progress=False)
    assert "plait: restart " not in capfd.readouterr().err


@pytest.mark.ray
def test_a_killed_ray_worker_is_a_crash_max_restarts_resumes_after(tmp_path, tiny_config, capfd, length_reward):
    """The actor's Ray worker process killed mid-run (an OOM kill, a lost node): the backend stops, the run resumes."""
    pytest.importorskip("ray")
    from plait.backends import LEAN_RAY_ENV
    os.environ.update(LEAN_RAY_ENV)
    ray_keys = ("trainer.backend=ray", "trainer.ray.num_cpu_workers=1", "trainer.ray.cpus_per_worker=0.5")
    cfg = tiny_config(tmp_path, *COMMON, *length_reward, *ray_keys, "trainer.max_restarts=1")
    original, killed = driver.build, []

    def build_then_kill_in_step_3(cfg, **kwargs):
        lifecycle = original(cfg, **kwargs)
        trainer, learn = lifecycle.trainer, lifecycle.trainer.learn

        def learning(batch, timer, *rest):
            if trainer.version == 2 and not killed:
                killed.append(trainer.roles.actor.pids[0])
                os.kill(killed[0], signal.SIGKILL)
            return learn(batch, timer, *rest)
        trainer.learn = learning
        return lifecycle
    driver.build = build_then_kill_in_step_3
    try:
        driver.run(cfg, progress=False)
    finally:
        driver.build = original
    err = capfd.readouterr().err
    assert killed and "plait: restart 1 of 1 (trainer.max_restarts) after: actor worker rank 0 died" in err
    assert "resuming from the newest checkpoint (step 2)" in err
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
