"""The config tree: verl's keys, YAML + overrides, and errors that name key, value and fix."""

import os
import subprocess
import sys

import pytest

from plait.config import PlaitConfig, load_config
from plait.configtree import ConfigError, to_dict


def test_defaults_build_and_round_trip_through_yaml(tmp_path):
    cfg = load_config()
    assert isinstance(cfg, PlaitConfig)
    path = tmp_path / "c.yaml"
    import yaml
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    assert to_dict(load_config(str(path))) == to_dict(cfg)


def test_overrides_parse_numbers_bools_lists_and_null():
    cfg = load_config(None, ["trainer.total_training_steps=7", "actor_rollout_ref.actor.optim.lr=3e-4",
                             "trainer.val_before_train=false", "global_profiler.steps=[1,2]",
                             "global_profiler.tool=torch", "critic.model.path=null", "trainer.logger=[console,tensorboard]"])
    assert cfg.trainer.total_training_steps == 7
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-4)
    assert cfg.trainer.val_before_train is False
    assert cfg.global_profiler.steps == [1, 2]
    assert cfg.critic.model.path is None
    assert cfg.trainer.logger == ["console", "tensorboard"]


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  train_batch_size: 8\nactor_rollout_ref:\n  actor:\n    ppo_mini_batch_size: 4\n")
    cfg = load_config(str(path), ["data.train_batch_size=16"])
    assert cfg.data.train_batch_size == 16 and cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 4


@pytest.mark.parametrize("override, key, words", [
    ("trainer.total_traning_steps=3", "trainer.total_traning_steps", "trainer.total_training_steps"),
    ("actor_rollout_ref.actor.optim.lrr=1", "actor_rollout_ref.actor.optim.lrr", "actor_rollout_ref.actor.optim.lr"),
    ("data.train_batch_size=abc", "data.train_batch_size", "integer"),
    ("trainer.val_before_train=3", "trainer.val_before_train", "boolean"),
    ("actor_rollout_ref.actor.loss_agg_mode=foo", "actor_rollout_ref.actor.loss_agg_mode", "token-mean"),
    ("algorithm.gamma=2", "algorithm.gamma", "[0, 1]"),
    ("algorithm.adv_estimator=ppo", "algorithm.adv_estimator", "gae"),
    ("actor_rollout_ref.rollout.top_p=0", "actor_rollout_ref.rollout.top_p", "(0, 1]"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=5", "actor_rollout_ref.actor.ppo_mini_batch_size", "divide"),
    ("global_profiler.steps=[0]", "global_profiler.steps", "1"),
    ("global_profiler.tool=perf", "global_profiler.tool", "torch"),
    ("trainer.mode=turbo", "trainer.mode", "sync"),
])
def test_bad_input_names_key_value_and_what_is_valid(override, key, words):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    msg = str(err.value)
    assert msg.startswith(key) and words in msg
    assert override.split("=", 1)[1].strip("[]") in msg


def test_cli_bad_key_exits_2_with_one_line_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "train", "trainer.total_traning_steps=3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "trainer.total_training_steps" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0


def test_cli_config_show_prints_resolved_tree():
    proc = subprocess.run([sys.executable, "-m", "plait.cli", "config", "show", "data.train_batch_size=8",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=8"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import yaml
    tree = yaml.safe_load(proc.stdout)
    assert tree["data"]["train_batch_size"] == 8
    assert tree["actor_rollout_ref"]["actor"]["clip_ratio_low"] == 0.2


@pytest.mark.parametrize("override, key", [
    ("custom_reward_function.path=/no/such/reward.py", "reward.custom_reward_function.path"),  # 0.8 spelling, mapped
    ("data.train_files=[/no/such/train.parquet]", "data.train_files"),
    ("actor_rollout_ref.model.path=/no/such/model", "actor_rollout_ref.model.path"),
])
def test_missing_inputs_exit_2_before_any_work(tmp_path, capsys, override, key):
    from plait.cli import main
    out = tmp_path / "run"
    assert main(["train", "--no-progress", f"trainer.default_local_dir={out}", override]) == 2
    err = capsys.readouterr().err
    assert f"config error: {key}=" in err and "/no/such/" in err
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


def test_a_config_error_is_reported_before_torch_is_imported(tmp_path):
    """`plait train` with a typo fails in about a second: loading and checking the config imports neither
    torch nor transformers (the algorithms' names, the diffusion and profiler nodes are torch-free)."""
    code = ("import sys\n"
            "from plait.cli import main\n"
            "rc = main(['train', 'actor_rollout_ref.actor.optim.lrr=1'])\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
            "print('rc', rc, 'heavy', heavy)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))})
    assert "actor_rollout_ref.actor.optim.lrr=1: unknown key; did you mean 'actor_rollout_ref.actor.optim.lr'?" in out.stderr
    assert out.stdout.split() == ["rc", "2", "heavy", "[]"], (out.stdout, out.stderr)
