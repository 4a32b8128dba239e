"""FSDP2 on CPU with gloo at world size 2 against one unsharded worker: the actor, ref, critic and
reward model sharded (strategy=fsdp2), every forward pass data-parallel, and sharded checkpoints
saved at 2 and resumed at 2 and at 1 (the next update equal both ways)."""

import os

import pytest
import torch

pytest.importorskip("ray")

from transformers import Qwen2Config, Qwen2ForSequenceClassification  # noqa: E402

from plait.backends.ray import DATA_PARALLEL_ROLES, RayBackend  # noqa: E402
from plait.config import ActorConfig, CriticConfig, OptimConfig, RefConfig  # noqa: E402
from plait.models import build_char_tokenizer, create_tiny_model  # noqa: E402
from plait.profiler import GlobalProfilerConfig, ProfilerSession, RoleProfilerConfig  # noqa: E402
from plait.workers.actor import Actor  # noqa: E402
from plait.workers.critic import Critic  # noqa: E402
from plait.workers.parallel import SHARDED_DIR, full_state_dict, is_sharded  # noqa: E402
from plait.workers.ref import Ref  # noqa: E402
from plait.workers.reward_model import RewardModel  # noqa: E402

from test_ray import close, make_batch, tiny_config  # noqa: E402

pytestmark = pytest.mark.ray


def reward_model_dir(path):
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_fsdp2_roles_on_two_cpu_ranks_equal_one_worker(ray_instance, tmp_path):
    model = create_tiny_model(tmp_path / "m", size="xs", seed=0)
    rm = reward_model_dir(tmp_path / "rm")
    tokenizer = build_char_tokenizer()
    fsdp2 = dict(strategy="fsdp2")
    actor_cfg = ActorConfig(optim=OptimConfig(lr=1e-3), ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=3,
                            ppo_epochs=2, shuffle=True, **fsdp2)
    critic_cfg = CriticConfig(optim=OptimConfig(lr=1e-3), ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=3, **fsdp2)
    ref_cfg = RefConfig(log_prob_micro_batch_size_per_gpu=7, **fsdp2)
    batch, odd = make_batch(16), make_batch(15, seed=1)  # 15 rows: shares 8 and 7, micro-batches of 7: 2 vs 1
    session = ProfilerSession(GlobalProfilerConfig(), {r: RoleProfilerConfig() for r in DATA_PARALLEL_ROLES}, rank=0)
    one_actor = Actor(model, actor_cfg, 4, 1.0, session.for_role("actor"), seed=3)
    one_critic = Critic(model, critic_cfg, 4, session.for_role("critic"))
    one_ref = Ref(model, ref_cfg, 1.0, session.for_role("ref"))
    one_rm = RewardModel(rm, tokenizer, session.for_role("reward_model"), micro_batch_size=3)
    assert not is_sharded(one_actor.model)  # one process: fsdp2 shards nothing
    one_logp, one_ent = one_actor.compute_log_prob(odd, 7)
    one_values = one_critic.compute_values(odd)

    backend = RayBackend(tiny_config(tmp_path), {r: RoleProfilerConfig() for r in DATA_PARALLEL_ROLES}, "cpu")
    try:
        actor = backend.spawn("actor", Actor, model, actor_cfg, 4, 1.0, seed=3)
        critic = backend.spawn("critic", Critic, model, critic_cfg, 4)
        ref = backend.spawn("ref", Ref, model, ref_cfg, 1.0)
        reward = backend.spawn("reward_model", RewardModel, rm, tokenizer, micro_batch_size=3, **fsdp2)
        assert all(g.call(lambda w: is_sharded(w.model)) for g in (actor, critic, ref, reward))
        # Forward passes: each rank its share, gathered once; every rank returns the whole batch's.
        logp, ent = actor.call(Actor.compute_log_prob, odd, 7)
        assert logp.shape == odd.responses.shape
        assert torch.allclose(logp, one_logp, atol=1e-5) and torch.allclose(ent, one_ent, atol=1e-5)
        # the sum of squared probabilities (optimal token baselines) from the sharded LM head, as from one worker
        _, _, sum_pi_squared = actor.call(Actor.compute_log_prob, odd, 7, None, True)
        assert torch.allclose(sum_pi_squared, one_actor.compute_log_prob(odd, 7, None, True)[2], atol=1e-5)
        assert torch.allclose(ref.call(Ref.compute_ref_log_prob, odd), one_ref.compute_ref_log_prob(odd), atol=1e-5)
        assert torch.allclose(critic.call(Critic.compute_values, odd), one_values, atol=1e-6)
        assert reward.call(RewardModel.compute_rm_score, odd) == pytest.approx(one_rm.compute_rm_score(odd), abs=1e-5)

        # Updates: 2 mini-batches x 2 epochs, shuffled; the sharded weights come back as one worker's.
        initial = {k: v.clone() for k, v in one_actor.state_dict().items()}
        one_metrics = one_actor.update(batch)
        metrics = actor.call(Actor.update, batch)
        assert not close(one_actor.state_dict(), initial, tol=5e-4)
        assert close(actor.call(Actor.state_dict), one_actor.state_dict())
        assert metrics["actor/pg_loss"] == pytest.approx(one_metrics["actor/pg_loss"], rel=1e-4, abs=1e-6)
        one_critic.update(batch)
        critic.call(Critic.update, batch)
        assert close(critic.call(lambda c: full_state_dict(c.model)), full_state_dict(one_critic.model))

        # Sharded checkpoint at world size 2: each rank writes its shards, nothing whole.
        ckpt, saved = tmp_path / "ckpt", actor.call(Actor.state_dict)
        actor.call(Actor.save_checkpoint, str(ckpt / "actor"))
        critic.call(Critic.save_checkpoint, str(ckpt / "critic"))
        for role in ("actor", "critic"):
            files = os.listdir(ckpt / role / SHARDED_DIR)
            assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(files), files
        assert not (ckpt / "actor" / "model.pt").exists()
        # Resumed at 1 (a fresh unsharded worker) and at 2 (the sharded ranks, after moving on):
        # the same weights, and the next update (optimizer state, lr schedule, shuffle order) equal.
        at_one = Actor(model, actor_cfg, 4, 1.0, session.for_role("actor"), seed=99)
        at_one.load_checkpoint(str(ckpt / "actor"))
        critic_at_one = Critic(model, critic_cfg, 4, session.for_role("critic"))
        critic_at_one.load_checkpoint(str(ckpt / "critic"))
        assert close(at_one.state_dict(), saved, tol=1e-9)
        actor.call(Actor.update, make_batch(16, seed=5))  # move away, then resume
        actor.call(Actor.load_checkpoint, str(ckpt / "actor"))
        critic.call(Critic.load_checkpoint, str(ckpt / "critic"))
        after = make_batch(16, seed=2)
        at_one.update(after)
        actor.call(Actor.update, after)
        assert close(actor.call(Actor.state_dict), at_one.state_dict())
        critic_at_one.update(after)
        critic.call(Critic.update, after)
        assert close(critic.call(lambda c: full_state_dict(c.model)), full_state_dict(critic_at_one.model))
    finally:
        backend.shutdown()


def test_weights_reach_a_separated_rollout_over_the_channel(ray_instance, tmp_path):
    """Separated placement: the FSDP2 actor's 2 ranks gather, rank 0 broadcasts over the weight channel
    (gloo, not the driver) and the rollout loads exactly the actor's weights, versioned; twice, so the
    channel is reused; then once by the old path through the driver (object_store), the same result."""
    from plait.workers.rollout import Rollout
    from plait.workers.weight_sync import sync_weights
    from plait.config import CriticModelConfig, FsdpConfig, MixedPrecisionConfig
    model = create_tiny_model(tmp_path / "m", size="xs", seed=0)
    # bf16 compute with fp32 reduction (FSDP2 mixed precision): the sharded fp32 weights are what syncs
    fsdp = FsdpConfig(mixed_precision=MixedPrecisionConfig(param_dtype="bf16", reduce_dtype="fp32"), forward_prefetch=True)
    cfg = ActorConfig(optim=OptimConfig(lr=1e-2), ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4, strategy="fsdp2",
                      fsdp_config=fsdp)
    critic_cfg = CriticConfig(optim=OptimConfig(lr=1e-2), ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=4,
                              strategy="fsdp2", model=CriticModelConfig(fsdp_config=fsdp))
    backend = RayBackend(tiny_config(tmp_path, "trainer.placement=separated"),
                         {r: RoleProfilerConfig() for r in ("actor", "critic", "rollout")}, "cpu")
    try:
        actor = backend.spawn("actor", Actor, model, cfg, 4, 1.0, seed=3)
        critic = backend.spawn("critic", Critic, model, critic_cfg, 4)
        rollout = backend.spawn("rollout", Rollout, model, 6, build_char_tokenizer())
        assert rollout.hosts[0] not in actor.hosts
        assert critic.call(Critic.update, make_batch(8))["critic/vf_loss"] > 0
        assert critic.call(lambda c: c.model.head.weight.dtype) == torch.float32  # sharded weights stay fp32
        for version, path in ((1, "process_group"), (2, "process_group"), (3, "object_store")):
            backend.cfg.weight_sync = path
            actor.call(Actor.update, make_batch(8, seed=version))
            sync_weights(actor, rollout, version)
            assert rollout.call(lambda r: r.version) == version
            assert close(rollout.call(lambda r: r.engine.model.state_dict()), actor.call(Actor.state_dict), tol=1e-9)
            assert backend.channel is not None
    finally:
        backend.shutdown()


def test_trainer_checkpoint_at_two_sharded_ranks_resumes_in_one_process(ray_instance, tmp_path):
    """GAE (actor and critic, both strategy=fsdp2) on 2 Ray ranks writes a sharded checkpoint at step 2;
    the same run resumed on the local backend (one unsharded process) verifies the manifest, loads
    it and trains step 3."""
    from plait import driver
    from plait.trainers.lifecycle import read_metrics
    fsdp2 = ["actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2", "algorithm.adv_estimator=gae",
             "critic.ppo_micro_batch_size_per_gpu=4", "trainer.save_freq=2"]
    driver.build(tiny_config(tmp_path, *fsdp2, "trainer.total_training_steps=2"), progress=False).run()
    step2 = tmp_path / "checkpoints" / "global_step_2"
    assert (step2 / "actor" / SHARDED_DIR / "__1_0.distcp").is_file()
    assert (step2 / "critic" / SHARDED_DIR / "__1_0.distcp").is_file()
    local = tiny_config(tmp_path, *fsdp2, "trainer.total_training_steps=3", "trainer.backend=local")
    driver.build(local, progress=False).run()
    steps = [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))]
    assert steps == [1, 2, 3]
    assert (tmp_path / "checkpoints" / "global_step_3" / "actor" / "model.pt").is_file()  # one process: whole


def test_a_full_disk_during_a_sharded_save_on_ray_is_the_one_line_with_the_previous_checkpoint_latest(
        ray_instance, tmp_path):
    """Two FSDP2 ranks in Ray workers write step 2's shards into files that are links to /dev/full,
    where every write fails in the kernel with ENOSPC, as on a full disk (step 2's save folder is made
    a link to a folder holding them as the save starts). The message is the in-process save's line,
    and step 1 stays latest and verifies."""
    from plait import driver
    from plait.errors import RunError
    from plait.trainers.checkpoint import verify_checkpoint
    crafted = tmp_path / "crafted" / "actor" / SHARDED_DIR
    crafted.mkdir(parents=True)
    for rank in (0, 1):
        (crafted / f"__{rank}_0.distcp").symlink_to("/dev/full")
    cfg = tiny_config(tmp_path, "actor_rollout_ref.actor.strategy=fsdp2", "trainer.save_freq=1",
                      "trainer.total_training_steps=2")
    lc = driver.build(cfg, progress=False)
    save = lc.trainer.save_checkpoint

    def onto_a_full_disk(path, step):
        if step == 2:
            os.symlink(tmp_path / "crafted", path, target_is_directory=True)
        return save(path, step)
    lc.trainer.save_checkpoint = onto_a_full_disk
    with pytest.raises(RunError) as err:
        lc.run()
    message, tmp = str(err.value), tmp_path / "checkpoints" / f"global_step_2.tmp-{os.getpid()}"
    assert "\n" not in message and message.startswith(f"checkpoint of step 2 not written to {tmp}: No space left on "
                                                      "device; the previous checkpoint stays latest (the Ray workers "
                                                      "were stopped; details in ")
    assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert verify_checkpoint(str(tmp_path / "checkpoints" / "global_step_1")) is None
    assert not (tmp_path / "checkpoints" / "global_step_2").exists()


def _no_reshard_rank(rank: int, model_dir: str, rdzv: str) -> None:
    import torch.distributed as dist
    from plait.config import FsdpConfig
    from plait.models import load_causal_lm
    from plait.workers.actor import micro_forward
    from plait.workers.parallel import shard_model
    from tests.workers.test_logprobs import T, assert_same, full_vocab_forward, logp_ent_grads
    from tests.workers.test_packing import make_batch as packing_batch
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=2)
    model = load_causal_lm(model_dir)
    batches = [(packing_batch(rows=4, seed=s), packed) for s, packed in enumerate([False, True, False])]
    want = [logp_ent_grads(model, b, lambda m, b: full_vocab_forward(m, b, T, packed)) for b, packed in batches]
    shard_model(model, model._no_split_modules, FsdpConfig(reshard_after_forward=False, forward_prefetch=True), "cpu")
    for (b, packed), old in zip(batches, want):
        with torch.no_grad():  # a pi_old pass between updates: without plait's reshard, the next gradients are wrong
            micro_forward(model, b, T, True, packed)
        new = logp_ent_grads(model, b, lambda m, b: micro_forward(m, b, T, True, packed))
        # both ranks ran the same rows and plait's FSDP2 sums gradients over ranks: twice one model's
        assert_same((new[0], new[1], {k: g.full_tensor() / 2 for k, g in new[2].items()}), old)
    dist.barrier()  # neither rank tears the group down while the other still talks to it
    dist.destroy_process_group()


def test_fsdp2_without_reshard_after_forward_gives_the_unsharded_gradients(tmp_path):
    """fsdp_config.reshard_after_forward=false (root and blocks) over 2 gloo ranks: after no-grad passes
    the gradients equal the unsharded model's (torch 2.13 alone gets the second step's wrong by up to ~14)."""
    import torch.multiprocessing as mp
    model = create_tiny_model(tmp_path / "m", size="xs", seed=0)
    mp.spawn(_no_reshard_rank, args=(model, str(tmp_path / "rdzv")), nprocs=2)


@pytest.mark.gpu
def test_optimizer_offload_on_cuda_keeps_the_state_in_cpu_memory_and_the_update(tmp_path):
    """fsdp_config.optimizer_offload on one GPU: Adam's moments wait in CPU memory between steps, and two
    updates give the weights they give without the offload."""
    from plait.config import FsdpConfig
    model = create_tiny_model(tmp_path / "m", size="xs", seed=0)
    session = ProfilerSession(GlobalProfilerConfig(), {"actor": RoleProfilerConfig()}, rank=0)
    weights = []
    for offload in (False, True):
        cfg = ActorConfig(optim=OptimConfig(lr=1e-2), ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2,
                          fsdp_config=FsdpConfig(optimizer_offload=offload))
        actor = Actor(model, cfg, 4, 1.0, session.for_role("actor"), device="cuda", seed=3)
        for seed in (0, 1):
            actor.update(make_batch(8, seed=seed))
        moments = [v for s in actor.optimizer.state.values() for k, v in s.items() if k != "step"]
        assert moments and all(v.device.type == ("cpu" if offload else "cuda") for v in moments)
        weights.append({k: v.cpu() for k, v in full_state_dict(actor.model).items()})
    assert close(*weights, tol=1e-6)


def test_lora_under_fsdp2_on_two_cpu_ranks_equals_one_worker(ray_instance, tmp_path):
    """LoRA with the base and adapters FSDP2-sharded: log-probs, the reference (adapters off), the update and the
    merged weights the rollout gets are one worker's; the checkpoint holds the sharded state and peft's adapter,
    and resumes in one process."""
    from plait.config import ModelConfig
    from plait.workers.actor import LORA_DIR
    model = create_tiny_model(tmp_path / "m", size="xs", seed=0)
    lora = ModelConfig(lora_rank=4, lora_alpha=8, target_modules="all-linear")
    actor_cfg = ActorConfig(optim=OptimConfig(lr=1e-2), ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=3,
                            ppo_epochs=1, shuffle=False, strategy="fsdp2")
    batch, odd = make_batch(16), make_batch(15, seed=1)
    session = ProfilerSession(GlobalProfilerConfig(), {r: RoleProfilerConfig() for r in DATA_PARALLEL_ROLES}, rank=0)
    one = Actor(model, actor_cfg, 4, 1.0, session.for_role("actor"), seed=3, model_cfg=lora)
    backend = RayBackend(tiny_config(tmp_path), {r: RoleProfilerConfig() for r in DATA_PARALLEL_ROLES}, "cpu")
    try:
        actor = backend.spawn("actor", Actor, model, actor_cfg, 4, 1.0, seed=3, model_cfg=lora)
        assert actor.call(lambda w: is_sharded(w.model) and w.lora)
        logp, _ = actor.call(Actor.compute_log_prob, odd, 7)
        assert torch.allclose(logp, one.compute_log_prob(odd, 7)[0], atol=1e-5)
        ref = actor.call(Actor.compute_ref_log_prob, odd, 7)
        assert torch.allclose(ref, one.compute_ref_log_prob(odd, 7), atol=1e-5)
        initial = one.state_dict()
        one.update(batch)
        actor.call(Actor.update, batch)
        merged = actor.call(Actor.state_dict)
        assert merged.keys() == initial.keys() and not close(one.state_dict(), initial, tol=1e-4)
        assert close(merged, one.state_dict(), tol=1e-5)
        ckpt = tmp_path / "ckpt" / "actor"
        actor.call(Actor.save_checkpoint, str(ckpt))
        assert (ckpt / SHARDED_DIR).is_dir() and (ckpt / LORA_DIR / "adapter_model.safetensors").is_file()
        at_one = Actor(model, actor_cfg, 4, 1.0, session.for_role("actor"), seed=9, model_cfg=lora)
        at_one.load_checkpoint(str(ckpt))
        assert close(at_one.state_dict(), merged, tol=1e-6)
    finally:
        backend.shutdown()
