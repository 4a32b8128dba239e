"""The data-parallel config surface: strategies per role, fsdp_config, Ray pools and placement,
GPU counts named on CPU; and the single-process identities of plait/workers/parallel.py."""

import pytest
import torch

from plait.config import FsdpConfig, load_config
from plait.configtree import ConfigError
from plait.workers.packing import MicroBatching
from plait.workers.parallel import EvenMicroBatching, data_parallel, even_micro_batches, use_fsdp


def test_strategies_per_role_and_the_fsdp_config_keys_build():
    cfg = load_config(None, ["actor_rollout_ref.actor.strategy=fsdp2", "critic.strategy=fsdp2",
                             "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false",
                             "actor_rollout_ref.actor.fsdp_config.forward_prefetch=true",
                             "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=1000",
                             "critic.model.fsdp_config.param_offload=true"])
    arr = cfg.actor_rollout_ref
    assert arr.ref.strategy == "fsdp2"  # null: the actor's, as verl's interpolation
    assert arr.actor.fsdp_config == FsdpConfig(reshard_after_forward=False, forward_prefetch=True,
                                               wrap_policy=arr.actor.fsdp_config.wrap_policy)
    assert arr.actor.fsdp_config.wrap_policy.min_num_params == 1000
    assert cfg.critic.strategy == "fsdp2" and cfg.critic.model.fsdp_config.param_offload
    assert load_config(None, ["actor_rollout_ref.ref.strategy=fsdp"]).actor_rollout_ref.ref.strategy == "fsdp"


@pytest.mark.parametrize("override, key, words", [
    ("critic.strategy=ddp", "critic.strategy", "one of fsdp, fsdp2"),
    ("actor_rollout_ref.ref.strategy=fsdp3", "actor_rollout_ref.ref.strategy", "the actor's"),
    ("trainer.ray.placement_strategy=RANDOM", "trainer.ray.placement_strategy", "SPREAD"),
    ("critic.model.fsdp_config.mixed_precision.param_dtype=int8", "critic.model.fsdp_config.mixed_precision.param_dtype",
     "bf16"),
    ("trainer.ray.pool_resources={critic: {a: 1}}", "trainer.ray.pool_resources.critic", "train, rollout and reward"),
    ("trainer.ray.pool_resources={rollout: {a: -1}}", "trainer.ray.pool_resources.rollout", "positive amount"),
    ("trainer.placement=separated;actor_rollout_ref.rollout.nnodes=2", "actor_rollout_ref.rollout.nnodes",
     "one engine on one node"),
    ("actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.nnodes", "needs trainer.placement=separated"),
    ("trainer.placement=separated;rollout.nnodes=1;actor_rollout_ref.rollout.nnodes=0", "rollout.nnodes",
     "both name the rollout's pool"),
    ("reward.reward_model.enable_resource_pool=true;reward.reward_model.nnodes=1;reward.reward_model.n_gpus_per_node=0",
     "reward.reward_model.n_gpus_per_node", "CPU: worker processes per node"),
    ("reward.reward_model.enable_resource_pool=true;reward.reward_model.nnodes=1", "reward.reward_model.enable_resource_pool",
     "needs reward.reward_model.enable=true"),
])
def test_bad_parallel_settings_name_key_and_fix(override, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, override.split(";"))
    assert err.value.key == key and words in str(err.value)


def test_the_recipes_rollout_pool_is_the_rollouts_and_pool_keys_are_named_on_the_local_backend(capsys):
    cfg = load_config(None, ["trainer.mode=fully_async", "trainer.placement=separated", "rollout.nnodes=1",
                             "rollout.n_gpus_per_node=2", "data.train_batch_size=0"])
    assert (cfg.actor_rollout_ref.rollout.nnodes, cfg.actor_rollout_ref.rollout.n_gpus_per_node) == (1, 2)
    err = capsys.readouterr().err
    assert "the local backend runs every role in this process" in err
    assert "actor_rollout_ref.rollout.nnodes" in err and "actor_rollout_ref.rollout.n_gpus_per_node" in err
    load_config(None, ["trainer.backend=ray", "trainer.placement=separated", "actor_rollout_ref.rollout.nnodes=1"])
    assert "rollout.nnodes" not in capsys.readouterr().err  # on Ray it sizes the rollout's pool


def test_offload_is_named_once_without_cuda(capsys):
    load_config(None, ["trainer.device=cpu", "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                       "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
                       "critic.model.fsdp_config.offload_policy=true"])
    err = capsys.readouterr().err
    assert err.count("without CUDA parameters and optimizer state are in CPU memory already") == 1
    for key in ("actor_rollout_ref.actor.fsdp_config.param_offload", "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
                "critic.model.fsdp_config.offload_policy"):
        assert f"      {key}\n" in err + "\n"


def test_lora_with_fsdp2_loads():
    """verl's LoRA scripts with strategy=fsdp2 (tests/backends/test_fsdp.py trains it sharded on two ranks)."""
    cfg = load_config(None, ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.actor.strategy=fsdp2"])
    assert cfg.actor_rollout_ref.actor.strategy == "fsdp2" and cfg.actor_rollout_ref.model.lora_rank == 4


def test_gpu_counts_are_named_once_on_ray_without_cuda(capsys):
    load_config(None, ["trainer.backend=ray", "trainer.device=cpu", "trainer.n_gpus_per_node=4", "trainer.nnodes=2"])
    err = capsys.readouterr().err
    assert err.count("without CUDA the Ray backend starts trainer.ray.num_cpu_workers") == 1
    assert "trainer.nnodes" in err and "trainer.n_gpus_per_node" in err


def test_one_process_is_the_identity():
    """Without torch.distributed: nothing shards, a forward sees the whole batch, no padding."""
    assert not use_fsdp("fsdp2", "cpu") and not use_fsdp("fsdp", "cuda")
    model = torch.nn.Linear(2, 2)
    assert even_micro_batches([[0, 1], [2]], model) == [([0, 1], False), ([2], False)]
    layout = EvenMicroBatching(MicroBatching(2, None, False), model)
    assert (layout.micro_batch_size, layout.remove_padding) == (2, False)

    class Rows:  # the few fields data_parallel reads
        def __len__(self):
            return 3
    seen = []
    out = data_parallel(Rows(), lambda b: seen.append(b) or (torch.ones(3, 2),), "f")
    assert len(seen) == 1 and isinstance(seen[0], Rows) and out[0].shape == (3, 2)
