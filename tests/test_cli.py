"""The command line a newcomer meets: every config error in one pass, one line for a hub id or a logger
that cannot log in, `--version`, and `train --help` naming every built-in config."""

import importlib.util
import os

import pytest

from plait.cli import main


def errors_of(capsys, argv) -> tuple[int, list[str]]:
    code = main(argv)
    return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("plait: config error")]


def test_errors_of_the_tree_the_files_and_the_model_dirs_come_in_one_pass(tmp_path, capsys):
    argv = ["train",
            "actor_rollout_ref.rollout.name=sglang",            # the tree: a rollout check that stops its node
            "actor_rollout_ref.rollout.gpu_memory_utilization=2",  # hidden behind it in the same node
            "trainer.total_training_steps=0",                   # another node
            "trainer.logger=[console,bogus]",
            f"actor_rollout_ref.model.path={tmp_path / 'no_model'}",
            f"data.train_files=[{tmp_path / 'train.parquet'}]", f"data.val_files=[{tmp_path / 'val.parquet'}]",
            "critic.enable=true", f"critic.model.path={tmp_path / 'no_critic'}"]
    code, lines = errors_of(capsys, argv)
    assert code == 2
    keys = [ln.split(": ")[2].split("=")[0] for ln in lines]
    assert sorted(keys) == sorted(["actor_rollout_ref.rollout.name", "trainer.total_training_steps", "trainer.logger[1]",
                    "actor_rollout_ref.rollout.gpu_memory_utilization", "data.train_files", "data.val_files",
                    "actor_rollout_ref.model.path", "critic.model.path"]), lines
    code, shown = errors_of(capsys, ["config", "show", *argv[1:]])
    assert code == 2 and shown == lines


def test_a_hub_id_as_model_path_says_how_to_get_a_local_folder(capsys):
    code, lines = errors_of(capsys, ["train", "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct"])
    assert code == 2 and len(lines) == 1
    assert "huggingface-cli download Qwen/Qwen2-7B-Instruct --local-dir models/Qwen2-7B-Instruct" in lines[0]
    assert "snapshot_download" in lines[0] and "pass that folder" in lines[0]


def test_wandb_without_the_package_or_a_login_is_one_line(tmp_path, capsys):
    from plait.checks import wandb_logged_in
    code, lines = errors_of(capsys, ["train", "trainer.logger=[console,wandb]", "trainer.total_training_steps=1",
                                     f"trainer.default_local_dir={tmp_path}"])
    if importlib.util.find_spec("wandb") is None:
        assert code == 2 and lines == ["plait: config error: trainer.logger='wandb': needs the wandb package: pip install wandb"]
    netrc = tmp_path / "netrc"
    assert not wandb_logged_in({}, str(netrc))                       # no file
    netrc.write_text("machine api.wandb.ai\n  login user\n  password abc123\n")
    os.chmod(netrc, 0o600)
    assert wandb_logged_in({}, str(netrc))                           # what `wandb login` writes
    assert not wandb_logged_in({"WANDB_BASE_URL": "https://wandb.example.com"}, str(netrc))  # another server
    assert wandb_logged_in({"WANDB_API_KEY": "k"}, str(tmp_path / "none"))
    assert wandb_logged_in({"WANDB_MODE": "offline"}, str(tmp_path / "none"))
