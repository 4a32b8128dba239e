"""A rollout engine that really dies mid-run is restarted and the run completes: the separated rollout's Ray
worker process killed (hf engine), and vLLM's engine core process killed mid-rollout (run with the vLLM
environment's python). The planted deaths of tests/workers/test_engine_restart.py cover every mode."""

import os
import signal
import threading

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


def restarted_once(out, capfd, step: int, why: str = "") -> list[dict]:
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["rollout/engine_restarts"] for r in records] == [int(s == step) for s in (1, 2, 3)]
    err = capfd.readouterr().err
    assert err.count(f"plait: warning: the rollout engine died in step {step} ") == 1
    assert f"plait: warning: the rollout engine died in step {step} ({why}" in err
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


def vllm_lifecycle(tmp_path, tiny_config, vllm_model_path):
    return driver.build(tiny_config(tmp_path, *COMMON, f"actor_rollout_ref.model.path={vllm_model_path}",
                                    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=float32",
                                    "actor_rollout_ref.rollout.max_model_len=512", "data.max_response_length=24"),
                        progress=False)


def core_pid(trainer) -> int:
    return trainer.roles.rollout.worker.engine.llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid


def killing_the_core_in(trainer, method: str, step: int, hang: bool) -> list[int]:
    """Stop vLLM's engine core (SIGSTOP) as the engine's `method` begins in `step`, so the call surely waits on
    it; then kill it (SIGKILL) 0.5 s later, or, `hang`, leave it hung for the health watch to find (its limit,
    STEP_TIMEOUT_S, is 2 s for this one call)."""
    from plait.workers import vllm_engine
    engine, killed = trainer.roles.rollout.worker.engine, []
    call = getattr(engine, method)

    def calling(*args, **kwargs):
        if trainer.step != step or killed:
            return call(*args, **kwargs)
        killed.append(core_pid(trainer))
        os.kill(killed[0], signal.SIGSTOP)
        if not hang:
            threading.Timer(0.5, os.kill, (killed[0], signal.SIGKILL)).start()
        limit, vllm_engine.STEP_TIMEOUT_S = vllm_engine.STEP_TIMEOUT_S, 2.0 if hang else vllm_engine.STEP_TIMEOUT_S
        try:
            return call(*args, **kwargs)
        finally:
            vllm_engine.STEP_TIMEOUT_S = limit
    setattr(engine, method, calling)
    return killed


@pytest.mark.vllm
@pytest.mark.parametrize("method, step, hang", [("generate", 3, False), ("load_weights", 2, False), ("load_weights", 2, True)],
                         ids=["killed_mid_rollout", "killed_mid_weight_reload", "hung_mid_weight_reload"])
def test_vllms_engine_core_dead_or_hung_is_restarted_and_the_run_completes(tmp_path, tiny_config, vllm_model_path, capfd,
                                                                          method, step, hang):
    """A weight reload waits on a utility call's future, which vLLM's client never fails when the core dies
    (it hung CI for an hour); the health watch fails it, as it wakes a step waiting on the core's outputs."""
    pytest.importorskip("vllm")
    lifecycle = vllm_lifecycle(tmp_path, tiny_config, vllm_model_path)
    killed = killing_the_core_in(lifecycle.trainer, method, step, hang)
    lifecycle.run()
    assert killed and core_pid(lifecycle.trainer) != killed[0]
    restarted_once(tmp_path, capfd, step, "vLLM's engine core " + ("did not answer within 2.0 s" if hang else ""))
