"""The reward-model role on a tiny Qwen2 sequence classifier with its own tokenizer, alone and in
a 2-step training run (profiled as role reward_model)."""

import os

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForSequenceClassification

from plait import driver
from plait.models import load_tokenizer
from plait.profiler import read_manifest
from plait.trainers.lifecycle import read_metrics
from plait.build import resolve_model
from plait.data.dataset import prompt_batch
from plait.workers.reward_model import RewardModel
from plait.workers.rollout import Rollout


def save_reward_model(path):
    """A tiny Qwen2 classifier (one label) with a tokenizer unlike the policy's: byte-level, but
    with the byte ids shifted and its pad token last, so ids only match after decode -> encode."""
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(list(reversed(byte_chars)) + ["<eos>", "<pad>"])}
    backend = Tokenizer(models.BPE(vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    config = Qwen2Config(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=64, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, max_position_embeddings=128)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture
def rm_dir(tmp_path):
    return save_reward_model(tmp_path / "rm")


def test_scores_are_the_classifier_on_retokenised_text(tmp_path, tiny_config, rm_dir):
    cfg = tiny_config(tmp_path)
    policy_tok = load_tokenizer(resolve_model(cfg))
    lifecycle = driver.build(cfg, progress=False)
    trainer = lifecycle.trainer
    items = [trainer.cursor.dataset[i] for i in range(3)]
    batch = trainer.roles.rollout.call(Rollout.generate, prompt_batch(items), trainer.sampling, 0)
    profiler = trainer.roles.actor.worker.profiler
    rm = RewardModel(rm_dir, policy_tok, profiler, micro_batch_size=5)
    texts = rm.texts(batch)
    assert texts[0].startswith(items[0].prompt_text)
    model = Qwen2ForSequenceClassification.from_pretrained(rm_dir).eval()
    with torch.no_grad():
        expected = [model(**rm.tokenizer(t, return_tensors="pt")).logits[0, 0].item() for t in texts]
    scores = rm.compute_rm_score(batch)  # 12 responses in micro-batches of 5, right-padded
    assert len(scores) == len(batch) == 12
    assert scores == pytest.approx(expected, abs=1e-5)
    whole = RewardModel(rm_dir, policy_tok, profiler).compute_rm_score(batch)
    assert whole == pytest.approx(scores, abs=1e-5)
    # with the row's messages (data.return_raw_chat) and a chat template, the conversation is rendered
    rm.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    question = items[0].extra_info["raw_prompt"][0]["content"]
    response = texts[0][len(items[0].prompt_text):]
    assert rm.texts(batch)[0] == f"user: {question}\nassistant: {response}\n"


def test_reward_model_trains_two_steps_and_is_profiled(tmp_path, tiny_config, rm_dir):
    save = tmp_path / "profile"
    cfg = tiny_config(tmp_path / "run", "reward.reward_model.enable=true", f"reward.reward_model.model_path={rm_dir}",
                      "reward.reward_model.micro_batch_size_per_gpu=4", "trainer.total_training_steps=2",
                      "trainer.val_before_train=false", "global_profiler.tool=torch", "global_profiler.steps=[1]",
                      f"global_profiler.save_path={save}", "reward.reward_model.profiler.enable=true",
                      "data.max_prompt_length=6", "data.filter_overlong_prompts=true")  # drops "12+34=\n"
    lifecycle = driver.build(cfg, progress=False)
    rm = lifecycle.trainer.roles.reward_model.worker
    dataset = lifecycle.trainer.cursor.dataset
    assert dataset.filtered > 0 and len(dataset) >= 4 and all(len(it.prompt_ids) <= 6 for it in dataset)
    lifecycle.run()
    records = read_metrics(os.path.join(tmp_path, "run", "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    # the classifier's logits, not the rule's 0/1: a score that is no 0/1 mean of 16 responses
    assert all(r["critic/score/mean"] * 16 % 1 != 0 for r in records)
    assert all(r["data/filtered_overlong_prompts"] == dataset.filtered for r in records)
    assert "timing_s/reward" in records[0] and "val-core/arithmetic/reward/mean@1" in records[-1]
    assert [(r["role"], r["rank"], r["complete"]) for r in read_manifest(str(save))] == [("reward_model", 0, True)]
    assert rm.model.config.pad_token_id == rm.tokenizer.pad_token_id


def test_a_missing_reward_model_directory_is_refused_before_any_work(tmp_path, tiny_config):
    from plait.configtree import ConfigError
    cfg = tiny_config(tmp_path, "reward_model.enable=true", f"reward_model.model.path={tmp_path / 'nope'}")
    with pytest.raises(ConfigError, match="reward.reward_model.model_path"):  # the 0.8 spelling, mapped
        driver.preflight(cfg)


def _without_head(source, path):
    """The classifier's checkpoint with its score head's weights taken out (a backbone saved as a classifier)."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(source, path)
    weights = load_file(os.path.join(path, "model.safetensors"))
    save_file({k: v for k, v in weights.items() if not k.startswith("score.")}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    return str(path)


def test_a_reward_model_that_is_not_a_trained_classifier_is_refused_in_one_line(tmp_path, rm_dir):
    # verl's GenRM points reward_model.model_path at a causal LM; loaded as a classifier it would get a random head
    from plait.configtree import ConfigError
    from plait.models import check_reward_model_dir, create_tiny_model, load_reward_model
    causal = create_tiny_model(tmp_path / "causal", size="xs")
    for check in (check_reward_model_dir, load_reward_model):
        with pytest.raises(ConfigError) as err:
            check(causal)
        message = str(err.value)
        assert message.startswith(f"reward.reward_model.model_path={causal!r}: a Qwen2ForCausalLM checkpoint")
        assert "GenRM" in message and "\n" not in message
    headless = _without_head(rm_dir, tmp_path / "headless")
    check_reward_model_dir(headless)  # its config says classifier; its weights do not hold the head
    with pytest.raises(ConfigError, match=r"its weights lack score.weight: plait's reward model is a "
                                          r"\*ForSequenceClassification checkpoint with its trained score head"):
        load_reward_model(headless)
    assert load_reward_model(rm_dir).score.weight.shape == (1, 32)  # the trained head loads


def test_a_causal_lm_reward_model_is_refused_by_preflight_and_train(tmp_path, tiny_config, capsys):
    from plait.cli import main
    from plait.configtree import ConfigError
    from plait.models import create_tiny_model
    causal = create_tiny_model(tmp_path / "causal", size="xs")
    cfg = tiny_config(tmp_path, "reward.reward_model.enable=true", f"reward.reward_model.model_path={causal}")
    with pytest.raises(ConfigError, match="GenRM"):
        driver.preflight(cfg)
    assert main(["config", "show", "reward.reward_model.enable=true", f"reward.reward_model.model_path={causal}"]) == 2
    err = capsys.readouterr().err
    assert "GenRM" in err and "Traceback" not in err
