"""A rollout engine that really dies mid-run is restarted and the run completes: the separated rollout's Ray
worker process killed (hf engine), and vLLM's engine core process killed mid-rollout (run with the vLLM
environment's python). The planted deaths of tests/workers/test_engine_restart.py cover every mode."""

import os
import signal
import threading
import time

import pytest
import torch

from plait import driver
from plait.trainers.lifecycle import read_metrics

torch.set_num_threads(1)
COMMON = ("trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.val_before_train=false")


def killing_in_step_2(lifecycle, pid_of):
    """Kill -9 the process pid_of() names while step 2 learns (the step's weight sync meets a dead engine)."""
    trainer, killed = lifecycle.trainer, []
    learn = trainer.learn

    def learning(batch, timer, *rest):
        if trainer.version == 1 and not killed:
            killed.append(pid_of())
            os.kill(killed[-1], signal.SIGKILL)
        return learn(batch, timer, *rest)
    trainer.learn = learning
    return killed


def restarted_once(out, capfd, step: int) -> list[dict]:
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["rollout/engine_restarts"] for r in records] == [int(s == step) for s in (1, 2, 3)]
    assert capfd.readouterr().err.count(f"plait: warning: the rollout engine died in step {step} ") == 1
    return records


@pytest.mark.ray
def test_the_separated_rollouts_ray_worker_killed_is_respawned_and_the_run_completes(tmp_path, tiny_config, capfd):
    pytest.importorskip("ray")
    from plait.backends import LEAN_RAY_ENV
    os.environ.update(LEAN_RAY_ENV)
    lifecycle = driver.build(tiny_config(tmp_path, *COMMON, "trainer.backend=ray", "trainer.placement=separated",
                                         "trainer.ray.num_cpu_workers=1", "trainer.ray.cpus_per_worker=0.5"),
                             progress=False)
    rollout = lifecycle.trainer.roles.rollout
    killed = killing_in_step_2(lifecycle, lambda: rollout.pids[0])
    lifecycle.run()
    assert killed and rollout.pids[0] != killed[0]  # a new worker process took over
    records = restarted_once(tmp_path, capfd, 2)  # met at step 2's weight sync, which is re-issued
    assert "training/weight_sync_probe_diff" in records[-1]  # the new engine took the weights (over a new channel)


@pytest.mark.vllm
def test_vllms_engine_core_killed_mid_rollout_is_restarted_and_the_run_completes(tmp_path, tiny_config, vllm_model_path,
                                                                                capfd):
    pytest.importorskip("vllm")
    lifecycle = driver.build(tiny_config(tmp_path, *COMMON, f"actor_rollout_ref.model.path={vllm_model_path}",
                                         "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=float32",
                                         "actor_rollout_ref.rollout.max_model_len=512", "data.max_response_length=24"),
                             progress=False)
    trainer = lifecycle.trainer
    engine = lambda: trainer.roles.rollout.worker.engine  # noqa: E731
    core = lambda: engine().llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid  # noqa: E731
    generate, killed = engine().generate, []

    def generating(*args, **kwargs):  # kill the core while step 3's batch is being decoded
        if trainer.version == 2 and not killed:
            killed.append(core())
            threading.Timer(0.2, os.kill, (killed[0], signal.SIGKILL)).start()
            time.sleep(0.0)
        return generate(*args, **kwargs)
    engine().generate = generating
    lifecycle.run()
    assert killed and core() != killed[0]
    restarted_once(tmp_path, capfd, 3)
