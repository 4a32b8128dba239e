"""The vl_demo preset: its format warm start (one-letter answers drawn at random, independently of the picture;
the images' tokens in the prompt; cached) and a couple of GRPO steps of the preset through `plait train --config
vl_demo`, with the built-in tiny-qwen2-vl-demo model built in a temporary cache (the warm start shrunk to 2 steps)."""

import json

import pytest

import plait.cli
import plait.vl_demo
from plait.cli import main
from plait.config import load_config
from plait.models import create_tiny_vl_model
from plait.models_vl import load_processor
from plait.data.tasks import make_task_rows


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    return load_processor(create_tiny_vl_model(tmp_path_factory.mktemp("vl") / "init", "qwen2_vl", seed=0))


def answer_of(processor, example):
    ids = [t for t, m in zip(example["ids"], example["mask"]) if m]
    return processor.tokenizer.decode(ids[:-1]), ids[-1]


def test_format_examples_answer_in_the_task_format_independently_of_the_picture(processor):
    rows = make_task_rows("larger_shape", "train", 64, 0)
    random_ones = plait.vl_demo.format_examples(processor, "larger_shape", 64, 0, "random")
    true_ones = plait.vl_demo.format_examples(processor, "larger_shape", 64, 0, "true")
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    said = [answer_of(processor, e) for e in random_ones]
    assert all(word in ("r", "b") and last == end for word, last in said)  # one letter, then <|im_end|>
    truth = [r["reward_model"]["ground_truth"] for r in rows]
    assert [answer_of(processor, e)[0] for e in true_ones] == truth
    agree = sum(word == t for (word, _), t in zip(said, truth)) / len(truth)
    assert 0.25 < agree < 0.75  # random answers: about half agree with the picture
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    e = random_ones[0]
    assert e["ids"].count(image_id) == int(e["inputs"]["image_grid_thw"].prod()) // 4 == 4  # 56x56: 4 tokens
    assert not any(m for t, m in zip(e["ids"], e["mask"]) if t == image_id)  # no loss on the prompt


def test_format_warmstart_trains_saves_and_is_cached(tmp_path):
    init = create_tiny_vl_model(tmp_path / "init", "qwen2_vl", seed=0)
    out = plait.vl_demo.format_warmstart(init, "larger_shape", tmp_path / "ws", steps=3, batch_size=4, lr=1e-3)
    marker = tmp_path / "ws" / "warmstart.json"
    record = json.loads(marker.read_text())
    assert record["settings"]["labels"] == "random" and len(record["losses"]) == 3
    assert record["losses"][-1] < record["losses"][0]
    load_processor(out)  # a whole VL folder: tokenizer and image processor beside the weights
    stamp = marker.stat().st_mtime_ns
    assert plait.vl_demo.format_warmstart(init, "larger_shape", tmp_path / "ws", 3, 4, 1e-3) == out
    assert marker.stat().st_mtime_ns == stamp  # reused, not retrained
    with pytest.raises(ValueError, match="no format warm start"):
        plait.vl_demo.format_warmstart(init, "arithmetic", tmp_path / "ws2", 1, 1, 1e-3)


SMOKE = ["data.train_size=16", "data.val_size=8", "data.val_batch_size=8", "data.train_batch_size=4",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=2", "trainer.test_freq=2",
         "trainer.num_threads=1", "trainer.logger=[]"]


def test_vl_demo_preset_builds_its_model_and_trains(tmp_path, monkeypatch):
    cfg = load_config(plait.cli.builtin_config("vl_demo"))
    assert cfg.data.task == "larger_shape" and cfg.actor_rollout_ref.model.path == "tiny-qwen2-vl-demo"
    monkeypatch.setenv("PLAIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(plait.vl_demo.DEMO_WARMSTART, "steps", 2)
    monkeypatch.setitem(plait.vl_demo.DEMO_WARMSTART, "batch_size", 2)
    out = tmp_path / "run"
    assert main(["train", "--config", "vl_demo", "--no-progress", f"trainer.default_local_dir={out}", *SMOKE]) == 0
    built = tmp_path / "cache" / "tiny-qwen2-vl-demo"
    marker = json.loads((built / "warmstart" / "warmstart.json").read_text())
    assert marker["settings"]["steps"] == 2 and marker["settings"]["labels"] == "random"
    assert plait.vl_demo.DEMO_WARMSTART["true_steps"] == 0 and not (built / "primed").exists()  # no true answers
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    val = [r for r in records if "val-core/larger_shape/reward/mean@1" in r]
    assert [r["step"] for r in val] == [0, 2] and all(0 <= r["val-core/larger_shape/reward/mean@1"] <= 1 for r in val)
    assert [r["step"] for r in records if "actor/pg_loss" in r] == [1, 2]
