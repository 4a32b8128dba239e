"""verl's Qwen2.5-VL geo3k GRPO command line on the Ray backend (sync and fully_async): the rollout and the
actor in their own processes, images and their processor outputs crossing between them."""

import os

import pytest
import torch

pytest.importorskip("ray")

from plait import driver  # noqa: E402
from plait.backends import LEAN_RAY_ENV  # noqa: E402
from plait.trainers.lifecycle import read_metrics  # noqa: E402

from test_vlm_e2e import FULLY_ASYNC, geo3k_config, vl_setup  # noqa: E402,F401  (the fixture, shared)

pytestmark = [pytest.mark.ray, pytest.mark.slow]
torch.set_num_threads(1)
os.environ.update(LEAN_RAY_ENV)  # before ray is imported by a test

RAY = ["trainer.backend=ray", "trainer.ray.num_cpu_workers=1", "trainer.ray.cpus_per_worker=0.5"]


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


@pytest.mark.parametrize("mode", ["sync", "fully_async"])
def test_geo3k_grpo_on_ray(ray_up, vl_setup, tmp_path, mode):
    root, model = vl_setup
    extra = FULLY_ASYNC if mode == "fully_async" else ["trainer.placement=separated"]
    lifecycle = driver.build(geo3k_config(root, model, tmp_path, *RAY, *extra), progress=False)
    roles = lifecycle.trainer.roles
    assert len({*roles.actor.pids, *roles.rollout.pids, os.getpid()}) == 3  # images cross processes
    lifecycle.run()
    records = [r for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl")) if "actor/pg_loss" in r]
    assert [r["step"] for r in records] == [1, 2]
    fresh = [r for r in records if r.get("training/staleness/max", 0) == 0]  # stale samples differ by design
    assert fresh and all(r["training/rollout_probs_diff_max"] < 1e-3 for r in fresh)
    assert all("actor/kl_loss" in r and "critic/score/mean" in r for r in records)
