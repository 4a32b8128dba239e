"""LoRA and the reward-model role on the Ray backend: 2 data-parallel actor ranks with adapters,
the reference from the actor's base, a reward model on its own worker, 2 steps."""

import os

import pytest

pytest.importorskip("ray")

from transformers import Qwen2Config, Qwen2ForSequenceClassification  # noqa: E402

from plait import driver  # noqa: E402
from plait.models import build_char_tokenizer  # noqa: E402
from plait.trainers.lifecycle import read_metrics  # noqa: E402

from test_ray import tiny_config  # noqa: E402

pytestmark = pytest.mark.ray


def test_lora_and_reward_model_on_ray(ray_instance, tmp_path):
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tokenizer.save_pretrained(tmp_path / "rm")
    cfg = tiny_config(tmp_path / "run", "trainer.total_training_steps=2", "actor_rollout_ref.model.lora_rank=4",
                      "actor_rollout_ref.actor.use_kl_loss=true", "reward_model.enable=true",
                      f"reward_model.model.path={tmp_path / 'rm'}", "trainer.save_freq=2")
    lifecycle = driver.build(cfg, progress=False)
    assert lifecycle.trainer.roles.ref is None
    lifecycle.run()
    last = read_metrics(os.path.join(tmp_path, "run", "metrics.jsonl"))[-1]
    assert last["step"] == 2 and "actor/kl_loss" in last and "timing_s/ref" in last
    assert os.path.isfile(tmp_path / "run" / "checkpoints" / "global_step_2" / "actor" / "lora_adapter" /
                          "adapter_model.safetensors")
    assert last["critic/score/mean"] * 16 % 1 != 0  # the classifier's logits, not a rule's 0/1
