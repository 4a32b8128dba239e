"""A rollout engine that really dies mid-run is restarted and the run completes: the separated rollout's Ray
worker process killed (hf engine), and vLLM's engine core process killed or hung mid weight reload and
killed mid-rollout (run with the vLLM environment's python). The planted deaths of
tests/workers/test_engine_restart.py cover every mode."""

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


def restarted_once(out, capfd, step: int) -> list[dict]:
    records = read_metrics(os.path.join(out, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["rollout/engine_restarts"] for r in records] == [int(s == step) for s in (1, 2, 3)]
    assert capfd.readouterr().err.count(f"plait: warning: the rollout engine died in step {step} ") == 1
    return records


RAY_MODES = {"sync": (), "fully_async": ("trainer.mode=fully_async",),
             "separate_async": ("trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2")}


@pytest.mark.ray
@pytest.mark.parametrize("mode", RAY_MODES)
def test_the_separated_rollouts_ray_worker_killed_is_respawned_and_the_run_completes(tmp_path, tiny_config, capfd, mode):
    """In every mode whose rollout has a Ray worker of its own: the kill is met by whichever call comes next (the
    weight sync, the rollouter's generate, V1's abort before a sync) and the engine comes back once."""
    pytest.importorskip("ray")
    from plait.backends import LEAN_RAY_ENV
    os.environ.update(LEAN_RAY_ENV)
    lifecycle = driver.build(tiny_config(tmp_path, *COMMON, "trainer.backend=ray", "trainer.placement=separated",
                                         "trainer.ray.num_cpu_workers=1", "trainer.ray.cpus_per_worker=0.5",
                                         *RAY_MODES[mode]), progress=False)
    rollout = lifecycle.trainer.roles.rollout
    killed = killing_in_step_2(lifecycle, lambda: rollout.pids[0])
    lifecycle.run()
    assert killed and rollout.pids[0] != killed[0]  # a new worker process took over
    records = restarted_once(tmp_path, capfd, 2)  # met at step 2's weight sync, which is re-issued
    assert "training/weight_sync_probe_diff" in records[-1]  # the new engine took the weights (over a new channel)


def core_pid(trainer) -> int:
    return trainer.roles.rollout.worker.engine.llm.llm_engine.engine_core.resources.engine_manager.processes[0].pid


@pytest.mark.vllm
def test_vllms_engine_core_dead_or_hung_in_each_step_is_restarted_and_the_run_completes(tmp_path, tiny_config,
                                                                                      vllm_model_path, capfd,
                                                                                      monkeypatch):
    """Each step the engine core dies a different way, while a call surely waits on it (the core is stopped,
    SIGSTOP, as the call begins): killed mid weight reload (step 1), hung mid reload (step 2: the health
    watch's limit, STEP_TIMEOUT_S, is 2 s for that one call, and the watch kills the core), killed mid-rollout
    (step 3). A reload waits on a utility call's future, which vLLM's client never fails when the core dies
    (it hung CI for an hour); the watch fails it, as it wakes a step waiting on the core's outputs."""
    pytest.importorskip("vllm")
    from plait.workers import vllm_engine
    lifecycle = driver.build(tiny_config(tmp_path, *COMMON, f"actor_rollout_ref.model.path={vllm_model_path}",
                                         "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=float32",
                                         "actor_rollout_ref.rollout.max_model_len=512", "data.max_response_length=24"),
                             progress=False)
    trainer, killed = lifecycle.trainer, {}
    plan = {1: ("load_weights", False), 2: ("load_weights", True), 3: ("generate", False)}  # step: (call, hang)

    def planting(method):
        call = getattr(vllm_engine.VLLMEngine, method)

        def calling(engine, *args, **kwargs):
            if plan.get(trainer.step, (None,))[0] != method or trainer.step in killed:
                return call(engine, *args, **kwargs)
            hang = plan[trainer.step][1]
            pid = killed[trainer.step] = core_pid(trainer)
            os.kill(pid, signal.SIGSTOP)
            if not hang:
                threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
            limit = vllm_engine.STEP_TIMEOUT_S
            vllm_engine.STEP_TIMEOUT_S = 2.0 if hang else limit
            try:
                return call(engine, *args, **kwargs)
            finally:
                vllm_engine.STEP_TIMEOUT_S = limit
        monkeypatch.setattr(vllm_engine.VLLMEngine, method, calling)
    planting("load_weights")
    planting("generate")
    lifecycle.run()
    assert sorted(killed) == [1, 2, 3] and core_pid(trainer) not in killed.values()
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [(r["step"], r["rollout/engine_restarts"]) for r in records] == [(1, 1), (2, 1), (3, 1)]
    warnings = [line for line in capfd.readouterr().err.splitlines() if "plait: warning: the rollout engine died" in line]
    assert len(warnings) == 3 and all(f"died in step {s} (vLLM's engine core " in w for s, w in zip((1, 2, 3), warnings))
    assert "did not answer within 2.0 s; it was killed" in warnings[1]
