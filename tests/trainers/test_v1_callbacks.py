"""verl 0.9.1's trainer.checkpoint_callback_class (on_save after each verified checkpoint; its failure one line)
and trainer.val_only (validate, then stop), end to end on the tiny model."""

import json
import os
import sys

import pytest

from plait import driver
from plait.cli import main
from plait.errors import RunError
from plait.trainers.checkpoint import verify_checkpoint
from plait.trainers.lifecycle import read_metrics

CALLBACK = '''
import json, os
from plait.trainers.checkpoint import verify_checkpoint

class Recorder:
    def __init__(self, config=None):
        self.config = config
        self.seen = []

    def on_save(self, trainer, global_step, checkpoint_dir, async_save=False, **kwargs):
        # the checkpoint is whole when the hook runs: it verifies
        self.seen.append((global_step, os.path.basename(checkpoint_dir), async_save, verify_checkpoint(checkpoint_dir),
                          trainer.version, self.config.trainer.save_freq))
        if self.config.trainer.get("experiment_name") == "fails" and global_step == 4:
            raise OSError("upload failed")
'''


@pytest.fixture
def callback_module(tmp_path, monkeypatch):
    (tmp_path / "my_callbacks.py").write_text(CALLBACK)
    monkeypatch.chdir(tmp_path)  # imported as verl imports it: the working directory first
    yield "my_callbacks.Recorder"
    sys.modules.pop("my_callbacks", None)


def test_on_save_runs_after_each_verified_checkpoint_with_verls_arguments(tmp_path, tiny_config, callback_module):
    lifecycle = driver.build(tiny_config(tmp_path / "run", "trainer.total_training_steps=4", "trainer.save_freq=2",
                                         f"trainer.checkpoint_callback_class={callback_module}"), progress=False)
    lifecycle.run()
    seen = lifecycle.cfg.checkpoint_callback.seen
    assert seen == [(2, "global_step_2", False, None, 2, 2), (4, "global_step_4", False, None, 4, 2)]


def test_a_failing_on_save_stops_the_run_with_one_line_and_the_checkpoint_kept(tmp_path, tiny_config, callback_module):
    lifecycle = driver.build(tiny_config(tmp_path / "run", "trainer.total_training_steps=6", "trainer.save_freq=2",
                                         "trainer.experiment_name=fails",
                                         f"trainer.checkpoint_callback_class={callback_module}"), progress=False)
    with pytest.raises(RunError) as err:
        lifecycle.run()
    line = str(err.value)
    assert "\n" not in line and "Recorder.on_save raised OSError: upload failed" in line and "step 4" in line
    assert verify_checkpoint(str(tmp_path / "run" / "checkpoints" / "global_step_4")) is None
    assert not (tmp_path / "run" / "checkpoints" / "global_step_6").exists()


def test_a_callback_that_does_not_import_is_one_config_error(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["config", "show", "trainer.checkpoint_callback_class=nowhere.Hook"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("plait: config error")]
    assert len(errors) == 1 and "trainer.checkpoint_callback_class" in errors[0] and "nowhere" in errors[0]


def test_val_only_validates_and_stops(tmp_path, tiny_config):
    lifecycle = driver.build(tiny_config(tmp_path, "trainer.val_only=true", "trainer.test_freq=-1",
                                         "trainer.save_freq=1"), progress=False)
    metrics = lifecycle.run()
    assert any(key.startswith("val-core/") for key in metrics)
    assert [r["step"] for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl"))] == [0]
    assert not (tmp_path / "checkpoints").exists() or not os.listdir(tmp_path / "checkpoints")


def test_val_only_without_val_before_train_trains_as_verl_does(tmp_path, tiny_config):
    lifecycle = driver.build(tiny_config(tmp_path, "trainer.val_only=true", "trainer.val_before_train=false",
                                         "trainer.total_training_steps=2", "trainer.test_freq=-1"), progress=False)
    lifecycle.run()
    assert [r["step"] for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl"))] == [1, 2]


def test_val_only_validates_a_checkpoint_and_trains_nothing(tmp_path, tiny_config):
    """The common use of val_only: the newest checkpoint of a run, validated again (its step's record kept)."""
    driver.build(tiny_config(tmp_path, "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=-1"),
                 progress=False).run()
    lifecycle = driver.build(tiny_config(tmp_path, "trainer.total_training_steps=4", "trainer.val_only=true",
                                         "trainer.test_freq=-1"), progress=False)
    metrics = lifecycle.run()
    assert lifecycle.trainer.version == 2 and any(key.startswith("val-core/") for key in metrics)
    assert [r["step"] for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl"))] == [1, 2, 2]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["global_step_2", "latest_checkpointed_iteration.txt"]
