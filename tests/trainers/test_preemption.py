"""Save on SIGTERM (preemption) in every mode and backend: a SIGTERM during step 2 lets the step finish,
writes and verifies its checkpoint (no periodic checkpoints are asked for), and the run ends as a
finished one does; resuming from it reproduces steps 3 and 4 of an uninterrupted run.

The signal is sent by the driver to itself from inside step 2's learn, so it lands mid-step at the
same place in every run (the lifecycle's handler runs on the main thread, where learn runs)."""

import os
import signal

import pytest
import torch

from plait import driver
from plait.trainers.checkpoint import checkpoint_steps, verify_checkpoint
from plait.trainers.lifecycle import read_metrics

torch.set_num_threads(1)

MODES = {"sync": ["trainer.mode=sync"], "one_step_off": ["trainer.mode=one_step_off"],
         "fully_async": ["trainer.mode=fully_async", "async_training.trigger_parameter_sync_step=2"]}
COMMON = ["trainer.placement=separated", "trainer.total_training_steps=4", "trainer.save_freq=-1",
          "trainer.test_freq=-1", "trainer.val_before_train=false"]
RAY = ["trainer.backend=ray", "trainer.ray.num_cpu_workers=1", "trainer.ray.cpus_per_worker=0.5"]
NOT_COMPARED = ("timing", "perf/", "memory/", "trainer/", "rollouter/")


def numbers(out, steps):
    return [{k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)}
            for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["step"] in steps]


def sigterm_in_step_2(lifecycle):
    trainer, sent = lifecycle.trainer, []
    learn = trainer.learn

    def learning(batch, timer, *rest):
        if trainer.version == 1 and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)
        return learn(batch, timer, *rest)
    trainer.learn = learning
    return sent


def preempted_and_resumed(tiny_config, tmp_path, overrides, capfd):
    full, part = tmp_path / "full", tmp_path / "part"
    driver.build(tiny_config(full, *overrides), progress=False).run()
    lifecycle = driver.build(tiny_config(part, *overrides), progress=False)
    sent = sigterm_in_step_2(lifecycle)
    lifecycle.run()  # returns: a preempted run ends as a finished one does
    assert sent and [r["step"] for r in read_metrics(part / "metrics.jsonl")] == [1, 2]
    assert checkpoint_steps(part / "checkpoints") == [2]
    assert verify_checkpoint(str(part / "checkpoints" / "global_step_2")) is None
    assert "plait: stopped on SIGTERM after step 2: " in capfd.readouterr().err
    driver.build(tiny_config(part, *overrides), progress=False).run()  # the same command: resumes
    assert [r["step"] for r in read_metrics(part / "metrics.jsonl")] == [1, 2, 3, 4]
    for a, b in zip(numbers(full, (3, 4)), numbers(part, (3, 4)), strict=True):
        assert b == pytest.approx(a, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_sigterm_mid_step_saves_that_step_and_resumes_to_the_same_numbers(tiny_config, tmp_path, capfd, mode):
    preempted_and_resumed(tiny_config, tmp_path, [*COMMON, *MODES[mode]], capfd)


@pytest.fixture(scope="module")
def ray_up(tmp_path_factory):
    """One Ray instance for the module's runs (each run would start and stop its own: ~10 s each)."""
    ray = pytest.importorskip("ray")
    from plait.backends import LEAN_RAY_ENV
    os.environ.update(LEAN_RAY_ENV)
    from plait.backends.ray import start_local_ray, stop_local_ray
    if ray.is_initialized():
        yield
        return
    link_dir = start_local_ray(str(tmp_path_factory.mktemp("ray")), num_cpus=4, object_store_memory_mb=128)
    yield
    stop_local_ray(link_dir)


@pytest.mark.ray
@pytest.mark.parametrize("mode", MODES)
def test_sigterm_mid_step_on_ray_saves_that_step_and_resumes_to_the_same_numbers(ray_up, tiny_config, tmp_path, capfd,
                                                                                 mode):
    preempted_and_resumed(tiny_config, tmp_path, [*COMMON, *RAY, *MODES[mode]], capfd)
