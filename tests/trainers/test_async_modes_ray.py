"""The async modes on the Ray backend: the rollout in its own process, the driver's threads waiting
on it. Same checks as the local tests (staleness bound, every sample once, clean stop), plus a
rollout process killed mid-run: one clear error on the driver within seconds, nothing left running.
"""

import os
import threading
import time
from collections import Counter

import pytest
import torch

pytest.importorskip("ray")

from plait import driver  # noqa: E402
from plait.backends import LEAN_RAY_ENV  # noqa: E402
from plait.trainers.lifecycle import read_metrics  # noqa: E402

pytestmark = pytest.mark.ray
torch.set_num_threads(1)
os.environ.update(LEAN_RAY_ENV)  # before ray is imported by a test

RAY = ["trainer.backend=ray", "trainer.placement=separated", "trainer.ray.num_cpu_workers=1",
       "trainer.ray.cpus_per_worker=0.5", "trainer.test_freq=-1", "trainer.val_before_train=false"]
MODES = {"one_step_off": ["trainer.mode=one_step_off"],
         "fully_async": ["trainer.mode=fully_async", "async_training.trigger_parameter_sync_step=2",
                         "async_training.staleness_threshold=1"]}


@pytest.fixture(scope="module")
def ray_up(tmp_path_factory):
    """Reuse a Ray instance another test module started, else start one for this module."""
    import ray
    from plait.backends.ray import start_local_ray, stop_local_ray
    if ray.is_initialized():
        yield
        return
    link_dir = start_local_ray(str(tmp_path_factory.mktemp("ray")), num_cpus=4, object_store_memory_mb=128)
    yield
    stop_local_ray(link_dir)


def build(tiny_config, out, *overrides):
    lifecycle = driver.build(tiny_config(out, *RAY, *overrides), progress=False)
    trainer, seen = lifecycle.trainer, []
    learn = trainer.learn

    def recording(batch, timer, *rest):
        seen.append((trainer.version, batch.versions.tolist(), batch.group_ids.tolist()))
        return learn(batch, timer, *rest)
    trainer.learn = recording
    return lifecycle, seen


def gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("mode", MODES)
def test_async_mode_on_ray(ray_up, tmp_path, tiny_config, mode):
    lifecycle, seen = build(tiny_config, tmp_path, *MODES[mode])
    roles = lifecycle.trainer.roles
    pids = roles.actor.pids + roles.rollout.pids
    assert len({*pids, os.getpid()}) == 3  # trainer, rollout and driver: three processes
    lifecycle.run()
    behind = [v_trainer - v for v_trainer, versions, _ in seen for v in versions]
    if mode == "one_step_off":
        assert behind[:16] == [0] * 16 and set(behind[16:]) == {1}
    else:
        assert set(behind) <= {0, 1} and 1 in behind
    counts = Counter(g for _, _, groups in seen for g in groups)
    assert set(counts.values()) == {4} and sum(counts.values()) == 3 * 4 * 4
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3] and all("rollouter/idle_ratio" in r for r in records)
    assert not [t for t in threading.enumerate() if t.name.startswith("plait-")]
    assert all(gone(pid) for pid in pids)  # the lifecycle shut the backend down


# The rollout's Ray worker killed mid-run: since the restart across threads (plait/trainers/rollout_client.py)
# it is restarted and the run completes, in fully_async too: tests/trainers/test_engine_restart_e2e.py kills it in
# sync, fully_async and separate_async; a second death in one step is one line (tests/workers/test_engine_restart.py).


def test_fully_async_generation_overlaps_update_actor_on_ray(ray_up, tmp_path, tiny_config):
    """With staleness_threshold=1 the rollouter may run one sync period ahead, so while the trainer
    updates on batch n the rollouter generates batch n+1. That is the schedule, not a race: right after
    each sync the rollouter starts the batch of the step after next, and responses of 48 sampled tokens
    from an untrained model (48 decode calls) take longer than the stages before update_actor (one
    forward each), so it is still generating when the update starts. Step 1 is left out: the actor's
    first calls in a fresh process warm up, and step 4 has nothing left to generate."""
    from plait.profiler.timeline import ROLLOUT_WORK, overlap_s, read_timeline
    lifecycle, _ = build(tiny_config, tmp_path, "trainer.mode=fully_async", "async_training.staleness_threshold=1",
                         "trainer.total_training_steps=4", "data.max_response_length=48")
    lifecycle.run()
    spans = read_timeline(os.path.join(tmp_path, "timeline.jsonl"))
    overlap = overlap_s(spans, "update_actor", ROLLOUT_WORK)
    assert sorted(overlap) == [1, 2, 3, 4]
    assert overlap[2] > 0 and overlap[3] > 0, overlap


V1 = {"colocate_async": ["trainer.v1.trainer_mode=colocate_async", "trainer.placement=colocated"],
      "separate_async": ["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2",
                         "trainer.v1.sampler.max_off_policy_threshold=2"]}


@pytest.mark.parametrize("mode", V1)
def test_v1_async_mode_on_ray(ray_up, tmp_path, tiny_config, mode):
    """verl 0.9.1's V1 modes: colocate_async with the rollout on the trainer's rank 0, separate_async in a process of
    its own; every group trained once, within the sampler's threshold, verl's metrics logged, nothing left running."""
    lifecycle, seen = build(tiny_config, tmp_path, *V1[mode], "trainer.total_training_steps=3")
    roles = lifecycle.trainer.roles
    pids = roles.actor.pids + roles.rollout.pids
    assert len({*pids, os.getpid()}) == (2 if mode == "colocate_async" else 3)
    lifecycle.run()
    counts = Counter(g for _, _, groups in seen for g in groups)
    assert set(counts.values()) == {4} and len(counts) == 3 * 4  # 4 responses per group, each group once
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["training/off_policy/trajectory_staleness/max"] <= 1 for r in records)
    assert all("timing_s/update_weights" in r and "training/off_policy/trajectory_spans/mean" in r for r in records)
    assert not [t for t in threading.enumerate() if t.name.startswith("plait-")]
    assert all(gone(pid) for pid in pids)
