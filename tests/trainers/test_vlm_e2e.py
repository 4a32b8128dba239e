"""verl's Qwen2.5-VL geo3k GRPO command line (examples/grpo_trainer/run_qwen2_5_vl-7b.sh) on a tiny
Qwen2.5-VL and a few geo3k-format rows with small generated images: sync and fully_async, local and Ray."""

import io
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from plait import driver
from plait.config import load_config
from plait.configtree import ConfigError
from plait.export import export_checkpoint
from plait.models import check_model_dir, create_tiny_model, create_tiny_vl_model, load_causal_lm
from plait.models_vl import load_processor
from plait.trainers.lifecycle import read_metrics
from plait.workers.actor import Actor

pytestmark = pytest.mark.slow

# run_qwen2_5_vl-7b.sh's keys, with the sizes, model and data swapped for tiny ones
GEO3K = [
    "algorithm.adv_estimator=grpo", "data.train_batch_size=4", "data.max_prompt_length=256",
    "data.max_response_length=6", "data.filter_overlong_prompts=True", "data.truncation=error",
    "data.image_key=images", "actor_rollout_ref.actor.optim.lr=1e-3",
    "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.model.use_fused_kernels=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.01",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=5", "actor_rollout_ref.rollout.name=hf",
    "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=5",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
    "trainer.critic_warmup=0", "trainer.logger=[console]", "trainer.project_name=verl_grpo_example_geo3k",
    "trainer.experiment_name=qwen2_5_vl_7b_function_rm", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
    "trainer.save_freq=2", "trainer.test_freq=2", "trainer.total_training_steps=2",
]
COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220)}
# dense, so every group has an advantage to learn from (geo3k's own scorer is plait/data/rewards.py's)
REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
          "    return sum(c < 'n' for c in solution_str) / max(len(solution_str), 1)\n")


def png(colour, size):
    buf = io.BytesIO()
    Image.new("RGB", size, COLOURS[colour]).save(buf, format="PNG")
    return buf.getvalue()


def geo3k_rows(n, sizes=((28, 28), (56, 28), (56, 56))):
    """Rows as examples/data_preprocess/geo3k.py writes them: one user message with an <image> placeholder."""
    rows = []
    for i in range(n):
        colour = list(COLOURS)[i % 2]
        rows.append({"data_source": "hiyouga/geometry3k",
                     "prompt": [{"role": "user", "content": "<image>Which colour? Answer in \\boxed{}."}],
                     "images": [{"bytes": png(colour, sizes[i % len(sizes)])}], "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": colour[0]},
                     "extra_info": {"split": "train", "index": i, "answer": colour, "question": "Which colour?"}})
    return rows


@pytest.fixture(scope="module")
def vl_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    model = create_tiny_vl_model(root / "model", "qwen2_5_vl", seed=0)
    for split, n in (("train", 8), ("test", 4)):
        pq.write_table(pa.Table.from_pylist(geo3k_rows(n)), root / f"{split}.parquet")
    (root / "reward.py").write_text(REWARD)
    return root, model


def geo3k_config(root, model, out, *extra):
    return load_config(None, [*GEO3K, f"data.train_files={root / 'train.parquet'}",
                              f"data.val_files={root / 'test.parquet'}", f"actor_rollout_ref.model.path={model}",
                              f"custom_reward_function.path={root / 'reward.py'}",
                              f"trainer.default_local_dir={out}", *extra])


def test_geo3k_grpo_sync_local_trains_with_images(vl_setup, tmp_path):
    root, model = vl_setup
    # no weight decay: a changed vision weight got a gradient through the images
    lifecycle = driver.build(geo3k_config(root, model, tmp_path, "actor_rollout_ref.actor.optim.weight_decay=0"),
                             progress=False)
    actor = lifecycle.trainer.roles.actor
    before = {k: v.clone() for k, v in actor.call(Actor.state_dict).items()}
    lifecycle.run()
    after = actor.call(Actor.state_dict)
    visual = [k for k in before if ".visual." in k]
    assert visual and any(not torch.equal(before[k], after[k]) for k in visual)  # the vision tower trained
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    last = records[-1]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/score/mean", "timing_s/gen",
                "timing_s/old_log_prob", "timing_s/ref", "training/rollout_probs_diff_max",
                "val-core/hiyouga/geometry3k/reward/mean@1"):
        assert any(key in r for r in records), key
    # the rollout's log-probs are the actor's: images and rope positions went through both the same way
    assert last["training/rollout_probs_diff_max"] < 1e-3
    assert all(r["actor/pg_loss"] != 0 for r in records if "actor/pg_loss" in r)
    # the checkpoint exports as a VL folder plait loads again, with the trained weights
    out = export_checkpoint(str(tmp_path / "checkpoints" / "global_step_2"), str(tmp_path / "export"))
    check_model_dir("actor_rollout_ref.model.path", out)
    assert load_processor(out).image_processor.merge_size == 2
    exported = load_causal_lm(out).state_dict()
    assert all(torch.equal(exported[k], after[k]) for k in visual)


def test_freeze_vision_tower_keeps_the_encoder(vl_setup, tmp_path):
    root, model = vl_setup
    cfg = geo3k_config(root, model, tmp_path, "actor_rollout_ref.actor.freeze_vision_tower=True",
                       "trainer.total_training_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=False")
    lifecycle = driver.build(cfg, progress=False)
    actor = lifecycle.trainer.roles.actor
    before = {k: v.clone() for k, v in actor.call(Actor.state_dict).items()}
    lifecycle.run()
    after = actor.call(Actor.state_dict)
    assert all(torch.equal(before[k], after[k]) for k in before if ".visual." in k)
    assert any(not torch.equal(before[k], after[k]) for k in before if ".visual." not in k)


def test_text_model_given_image_rows_stops_before_training(vl_setup, tmp_path):
    root, _ = vl_setup
    text_model = create_tiny_model(tmp_path / "text", size="xs")
    with pytest.raises(ConfigError) as err:
        driver.build(geo3k_config(root, text_model, tmp_path / "run"), progress=False)
    message = str(err.value)
    assert "\n" not in message and "train.parquet" in message and "row 0" in message
    assert "vision-language model" in message and "data.image_key" in message


FULLY_ASYNC = ["trainer.mode=fully_async", "trainer.placement=separated", "async_training.trigger_parameter_sync_step=1",
               "async_training.staleness_threshold=1", "async_training.partial_rollout=True"]


def test_geo3k_grpo_fully_async_local(vl_setup, tmp_path):
    root, model = vl_setup
    lifecycle = driver.build(geo3k_config(root, model, tmp_path, *FULLY_ASYNC, "trainer.total_training_steps=3"),
                             progress=False)
    lifecycle.run()
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in records if "actor/pg_loss" in r] == [1, 2, 3]
    fresh = [r for r in records if "actor/pg_loss" in r and r["training/staleness/max"] == 0]
    assert fresh and all(r["training/rollout_probs_diff_max"] < 1e-3 for r in fresh)  # stale ones differ by design


def test_agent_loops_with_images_are_refused_at_start(vl_setup, tmp_path):
    root, model = vl_setup
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.rollout.multi_turn.enable=True: agent loops with images"):
        driver.build(geo3k_config(root, model, tmp_path, "actor_rollout_ref.rollout.multi_turn.enable=True"),
                     progress=False)
