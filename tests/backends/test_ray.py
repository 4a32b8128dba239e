"""The Ray backend on one shared lean Ray instance: data-parallel equivalence, sync GRPO end to end
with per-rank profiler artifacts, a killed worker, and workers that cannot be placed.

Every test spawns 2 worker processes at 0.5 CPU each (about 4 s before their first call here).
"""

import gzip
import os
import signal
import time

import pytest
import torch

pytest.importorskip("ray")

from plait.backends.ray import DATA_PARALLEL_ROLES, RayBackend, WorkerError
from plait.config import ActorConfig, CriticConfig, OptimConfig, load_config
from plait.configtree import ConfigError
from plait.models import create_tiny_model
from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig, read_manifest
from plait.types import RolloutBatch
from plait.workers.actor import Actor
from plait.workers.parallel import full_state_dict
from plait.workers.critic import Critic

pytestmark = pytest.mark.ray
torch.set_num_threads(1)

TINY = ["demo.model_size=xs", "demo.warmstart_steps=0", "data.train_size=32", "data.val_size=4",
        "data.train_batch_size=4", "data.max_response_length=6", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.logger=[]", "trainer.backend=ray", "trainer.ray.num_cpu_workers=2",
        "trainer.ray.cpus_per_worker=0.5"]


def tiny_config(out_dir, *overrides):
    return load_config(None, [*TINY, f"trainer.default_local_dir={out_dir}", *overrides])


def make_batch(n_rows: int, seed: int = 0, prompt_len: int = 5, resp_len: int = 6) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, resp_len + 1, (n_rows,), generator=g)
    response_mask = (torch.arange(resp_len) < lengths[:, None]).float()        # [rows, resp_len]
    prompt_mask = torch.ones(n_rows, prompt_len, dtype=torch.long)
    prompt_mask[::3, :2] = 0                                                    # some left padding
    rand = lambda: torch.randn(n_rows, resp_len, generator=g) * response_mask  # noqa: E731
    return RolloutBatch(
        prompts=torch.randint(4, 90, (n_rows, prompt_len), generator=g) * prompt_mask, prompt_mask=prompt_mask,
        responses=torch.randint(4, 90, (n_rows, resp_len), generator=g), response_mask=response_mask,
        rollout_logprobs=-rand().abs(), group_ids=torch.arange(n_rows) // 4, versions=torch.zeros(n_rows, dtype=torch.long),
        data_sources=["t"] * n_rows, ground_truths=[""] * n_rows, extra_infos=[{}] * n_rows,
        stop_reasons=["eos"] * n_rows, old_logprobs=-rand().abs() - 3.0, advantages=rand(), values=rand(),
        returns=rand())


def close(a: dict, b: dict, tol: float = 1e-5) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a) < tol


def test_two_ranks_update_exactly_like_one_worker(ray_instance, tmp_path):
    """2 DP ranks == 1 worker on the same batch: 2 mini-batches x 2 epochs, shuffled, micro-batches
    that split unevenly; the actor all-reduces gradients, the critic is FSDP2-sharded (on gloo)."""
    model = create_tiny_model(tmp_path / "m", size="xs", seed=0)
    # Adam moves every weight by about lr (1e-3), so 1e-5 is 1% of a step; rounding differences in
    # near-zero gradients are amplified by Adam to about lr * 2.5e-3.
    actor_cfg = ActorConfig(optim=OptimConfig(lr=1e-3), ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=3,
                            ppo_epochs=2, shuffle=True)
    critic_cfg = CriticConfig(optim=OptimConfig(lr=1e-3), ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=3)
    batch = make_batch(16)  # n=4: a mini-batch is 8 rows, 4 per rank
    session = ProfilerSession(GlobalProfilerConfig(), {r: RoleProfilerConfig() for r in ("actor", "critic")}, rank=0)
    one_actor = Actor(model, actor_cfg, 4, 1.0, session.for_role("actor"), seed=3)
    one_critic = Critic(model, critic_cfg, 4, session.for_role("critic"))
    one_logp, _ = one_actor.compute_log_prob(batch, 5)
    initial = {k: v.clone() for k, v in one_actor.state_dict().items()}
    one_metrics = one_actor.update(batch)
    assert not close(one_actor.state_dict(), initial, tol=5e-4)  # the update moved the weights
    one_critic_metrics = one_critic.update(batch)

    backend = RayBackend(tiny_config(tmp_path), {r: RoleProfilerConfig() for r in DATA_PARALLEL_ROLES}, "cpu")
    try:
        actor = backend.spawn("actor", Actor, model, actor_cfg, 4, 1.0, seed=3)
        critic = backend.spawn("critic", Critic, model, CriticConfig(**{**vars(critic_cfg), "strategy": "fsdp2"}), 4)
        assert actor.world_size == 2 and len(set(actor.pids)) == 2
        # Forward passes are data-parallel inside: each rank its share, every rank the whole result.
        logp, _ = actor.call(Actor.compute_log_prob, batch, 5)
        assert torch.allclose(logp, one_logp, atol=1e-5)

        metrics = actor.call(Actor.update, batch)
        assert close(actor.call(Actor.state_dict), one_actor.state_dict())
        for k, v in one_metrics.items():  # summed over ranks, the metrics are the one worker's too
            if not k.startswith("perf/"):  # timings (MFU) are not
                assert metrics[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
        critic_metrics = critic.call(Critic.update, batch)
        assert close(critic.call(lambda c: full_state_dict(c.model)), full_state_dict(one_critic.model))
        for k in ("critic/vf_loss", "critic/grad_norm"):  # vf_clipfrac counts float ties, so it is left out
            assert critic_metrics[k] == pytest.approx(one_critic_metrics[k], rel=1e-4, abs=1e-6), k
        # The FSDP2 checkpoint is sharded and loads into an unsharded critic (and back);
        # the actor's replicas write one whole model.pt from rank 0.
        critic.call(Critic.save_checkpoint, str(tmp_path / "critic"))
        whole = Critic(model, critic_cfg, 4, session.for_role("critic"))
        whole.load_checkpoint(str(tmp_path / "critic"))
        critic.call(Critic.load_checkpoint, str(tmp_path / "critic"))
        assert close(full_state_dict(whole.model), full_state_dict(one_critic.model))
        assert len(whole.optimizer.state_dict()["state"]) > 0
        actor.call(Actor.save_checkpoint, str(tmp_path / "actor"))
        assert close(torch.load(tmp_path / "actor" / "model.pt", weights_only=True), one_actor.state_dict())

        # A pre-split update would silently train on half the data: it is refused, on every rank.
        with pytest.raises(WorkerError, match="call_dp"):
            actor.call_dp(Actor.update, batch)
        assert backend.hosts == []  # a failure stops every worker
    finally:
        backend.shutdown()


def test_sync_grpo_on_ray_is_the_local_run_with_per_rank_profiles(ray_instance, tmp_path):
    """3 GRPO steps, 2 DP actor ranks and a separated rollout process: step 1's metrics are the local
    backend's, throughput is per training rank, the rollout ends on the last weights, a checkpoint is
    written, and the profiler writes one artifact per selected (role, rank) process: actor on rank 1
    only, rollout on 0."""
    from plait import driver
    from plait.trainers.lifecycle import read_metrics
    reward = tmp_path / "reward.py"  # varied rewards, so advantages and gradients are not all zero
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(len(solution_str) % 3)\n")
    common = ["trainer.total_training_steps=3", f"custom_reward_function.path={reward}"]
    driver.build(tiny_config(tmp_path / "local", *common, "trainer.backend=local"), progress=False).run()
    save = tmp_path / "profile"
    cfg = tiny_config(tmp_path / "ray", *common, "trainer.placement=separated", "global_profiler.tool=torch",
                      "global_profiler.steps=[2]", f"global_profiler.save_path={save}",
                      "actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.actor.profiler.ranks=[1]",
                      "actor_rollout_ref.rollout.profiler.enable=true")
    lifecycle = driver.build(cfg, progress=False)
    lifecycle.shutdown = lambda: None  # keep the workers up to inspect them; `finally` shuts them down
    roles = lifecycle.trainer.roles
    try:
        assert len(set(roles.actor.pids + roles.rollout.pids)) == 3
        lifecycle.run()
        actor_state = roles.actor.call(Actor.state_dict)
        assert close(roles.rollout.call(lambda r: {k: v.clone() for k, v in r.engine.model.state_dict().items()}), actor_state)
        assert roles.rollout.call(lambda r: r.version) == 3
    finally:
        roles.actor.backend.shutdown()
    local, remote = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("local", "ray"))
    assert [r["step"] for r in remote] == [1, 2, 3]
    assert any(r["actor/grad_norm"] > 0 for r in remote)
    # Step 1 starts from the same weights, so everything matches; later steps start from weights that
    # differ by rounding, and one sampled token flipped by it would change every metric after it.
    for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert remote[0][key] == pytest.approx(local[0][key], rel=1e-4, abs=1e-6), key
    assert os.path.isfile(tmp_path / "ray" / "checkpoints" / "global_step_3" / "actor" / "model.pt")
    # verl's perf/throughput is tokens / s / device: 2 training ranks on Ray, one process locally
    for records, devices in ((remote, 2), (local, 1)):
        for r in records:
            assert r["perf/throughput"] == pytest.approx(r["perf/total_num_tokens"] / r["perf/time_per_step"] / devices)
    manifest = read_manifest(str(save))
    assert sorted((r["role"], r["rank"]) for r in manifest) == [("actor", 1), ("rollout", 0)]
    assert len({r["pid"] for r in manifest}) == 2 and all(r["complete"] and r["steps"] == [2, 2] for r in manifest)
    assert sorted(os.listdir(save / "step2")) == sorted(os.path.basename(r["path"]) for r in manifest)
    actor_trace = next(r["path"] for r in manifest if r["role"] == "actor")
    with gzip.open(save / actor_trace, "rt") as f:
        assert "update_actor" in f.read()  # the stage ran inside rank 1's window


def test_killed_worker_is_one_clear_error_within_seconds(ray_instance, tmp_path):
    """SIGKILL rank 1 during step 1 (inside a profiled window): the run stops with one WorkerError
    naming the rank, within seconds; rank 0's open window is closed and listed as incomplete."""
    from plait import driver
    save = tmp_path / "profile"
    cfg = tiny_config(tmp_path, "trainer.total_training_steps=2", "global_profiler.tool=torch",
                      "global_profiler.steps=[1]", f"global_profiler.save_path={save}",
                      "actor_rollout_ref.actor.profiler.enable=true", "actor_rollout_ref.actor.profiler.all_ranks=true")
    lifecycle = driver.build(cfg, progress=False)
    trainer, actor = lifecycle.trainer, lifecycle.trainer.roles.actor
    score, killed = trainer.reward_fn, []

    def kill_rank1_then_score(*args, **kwargs):  # the reward runs on the driver, between two worker calls
        if not killed:
            os.kill(actor.pids[1], signal.SIGKILL)
            killed.append(time.monotonic())
        return score(*args, **kwargs)

    trainer.reward_fn = kill_rank1_then_score
    with pytest.raises(WorkerError, match="actor worker rank 1 died") as err:
        lifecycle.run()
    assert time.monotonic() - killed[0] < 15
    assert "every Ray worker was stopped" in str(err.value)
    assert "\n" not in str(err.value) and str(err.value).endswith(f"details in {tmp_path / 'worker_errors.log'}")
    assert "actor worker rank 1 during" in (tmp_path / "worker_errors.log").read_text()  # Ray's account, not the console
    assert actor.backend.hosts == []
    with pytest.raises(WorkerError, match="earlier failure"):
        actor.call(Actor.state_dict)
    assert [(r["role"], r["rank"], r["complete"]) for r in read_manifest(str(save))] == [("actor", 0, False)]


@pytest.mark.gpu
def test_fsdp2_actor_on_gpus_updates_like_one_worker(ray_instance, tmp_path):
    """On CUDA (NCCL): every visible GPU is a rank, the actor is FSDP2-sharded, the update matches one
    unsharded worker on GPU 0, and the weights come back whole."""
    model = create_tiny_model(tmp_path / "m", size="xs", seed=0)
    cfg = ActorConfig(optim=OptimConfig(lr=1e-2), ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2)
    batch = make_batch(16)
    session = ProfilerSession(GlobalProfilerConfig(), {"actor": RoleProfilerConfig()}, rank=0)
    one = Actor(model, cfg, 4, 1.0, session.for_role("actor"), device="cuda", seed=3)
    one.update(batch)
    world = torch.cuda.device_count()
    backend = RayBackend(tiny_config(tmp_path, f"trainer.n_gpus_per_node={world}"), {"actor": RoleProfilerConfig()}, "cuda")
    try:
        actor = backend.spawn("actor", Actor, model, cfg, 4, 1.0, device="cuda", seed=3)
        actor.call(Actor.update, batch)
        assert close(actor.call(Actor.state_dict), {k: v.cpu() for k, v in one.state_dict().items()}, tol=1e-4)
        actor.call(Actor.save_checkpoint, str(tmp_path / "ckpt"))
        actor.call(Actor.load_checkpoint, str(tmp_path / "ckpt"))
    finally:
        backend.shutdown()


def test_pools_bigger_than_the_cluster_are_refused_naming_the_keys(ray_instance, tmp_path):
    cfg = tiny_config(tmp_path, "trainer.ray.cpus_per_worker=3", "trainer.ray.placement_timeout_s=1")
    with pytest.raises(ConfigError, match=r"^trainer.ray.num_cpu_workers \(with trainer.ray.cpus_per_worker=3\)='2': "
                                          r"the train pool asks for CPU 6 and the Ray cluster has 4 in all"):
        RayBackend(cfg, {"actor": RoleProfilerConfig()}, "cpu")
    # Each pool fits alone; the reward pool does not beside the train pool and the rollout.
    cfg = tiny_config(tmp_path, "trainer.placement=separated", "trainer.ray.placement_timeout_s=1",
                      "reward.reward_model.enable=true", f"reward.reward_model.model_path={tmp_path}",
                      "reward.reward_model.enable_resource_pool=true", "reward.reward_model.nnodes=1",
                      "reward.reward_model.n_gpus_per_node=6")
    with pytest.raises(ConfigError, match=r"^reward.reward_model.nnodes x reward.reward_model.n_gpus_per_node "
                                          r"\(with trainer.ray.cpus_per_worker=0.5\)='1 x 6': the reward pool asks for "
                                          r"CPU 3 with the pools before it \(1.5\) and the Ray cluster has 4"):
        RayBackend(cfg, {"actor": RoleProfilerConfig()}, "cpu")


def test_workers_that_cannot_be_placed_in_time_fail_naming_the_pool(ray_instance, tmp_path):
    # Fits the cluster's CPUs, but STRICT_SPREAD wants one worker per node and there is one node.
    cfg = tiny_config(tmp_path, "trainer.ray.placement_strategy=STRICT_SPREAD", "trainer.ray.placement_timeout_s=1")
    with pytest.raises(WorkerError, match=r"could not place the train pool within 1 s: .*fragmented across nodes"):
        RayBackend(cfg, {"actor": RoleProfilerConfig()}, "cpu")


def test_abort_overtakes_a_running_generate_on_ray(ray_instance, tmp_path):
    """Rollout.abort is out-of-band: it reaches the rollout process while its generate runs, and the
    generate returns early with the tokens so far (what partial rollout needs on Ray)."""
    import threading

    from plait import driver
    from plait.config import SamplingConfig
    from plait.types import PromptBatch
    from plait.workers.rollout import Rollout
    cfg = tiny_config(tmp_path, "trainer.placement=separated", "data.max_response_length=480")
    lifecycle = driver.build(cfg, progress=False)
    rollout = lifecycle.trainer.roles.rollout
    prompts = PromptBatch(prompt_ids=[[5, 6, 7]] * 32, data_sources=["x"] * 32, ground_truths=["1"] * 32,
                          extra_infos=[{}] * 32, indices=list(range(32)))
    out = {}
    try:
        worker = threading.Thread(target=lambda: out.update(
            batch=rollout.call(Rollout.generate, prompts, SamplingConfig(n=1), 0)))
        worker.start()
        deadline = time.monotonic() + 60
        while worker.is_alive() and time.monotonic() < deadline:  # an abort with no generate running is a no-op
            rollout.call(Rollout.abort)
            time.sleep(0.05)
        worker.join(timeout=5)
        assert not worker.is_alive()
        assert "aborted" in out["batch"].stop_reasons
        assert out["batch"].response_mask.sum(-1).max() < 480
    finally:
        lifecycle.trainer.roles.actor.backend.shutdown()
