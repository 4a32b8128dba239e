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


class Terminal:
    """A stream that says it is a terminal, for the progress bar, and keeps what was written."""

    def __init__(self):
        import io
        self.buffer = io.StringIO()

    def isatty(self):
        return True

    def write(self, text):
        return self.buffer.write(text)

    def flush(self):
        pass


def test_the_progress_bar_counts_each_step_when_its_line_prints_and_ends_drawn_once(tmp_path, monkeypatch):
    import re
    import sys
    from plait.trainers.tracking import Tracker
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    tracker = Tracker(str(tmp_path), ["console"], "p", "e")
    for step in tracker.progress(range(1, 4), total=3, initial=0):
        tracker.log({"actor/pg_loss": 0.5}, step=step)
    tracker.close()
    frames = [f.strip() for f in re.split(r"[\r\n]", term.buffer.getvalue()) if f.strip()]
    bars = [f for f in frames if f.startswith("plait:")]
    assert sum("3/3" in f for f in bars) == 1 and "3/3" in bars[-1], frames  # the finished bar: drawn once
    for i, frame in enumerate(frames):  # the bar drawn after step N's line counts N (tqdm alone: N - 1)
        if frame.startswith("step ") and i + 1 < len(frames) and frames[i + 1].startswith("plait:"):
            assert f"{frame.split()[1]}/3" in frames[i + 1], frames
    assert frames[-1].startswith("step 3"), frames  # nothing drawn under the last step's line


def test_version_and_a_train_help_that_names_every_built_in_config(capsys):
    from plait import __version__
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out.strip() == f"plait {__version__}"
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    shipped = sorted(n.removesuffix(".yaml") for n in os.listdir(os.path.join(os.path.dirname(__import__("plait").__file__), "configs"))
                     if n.endswith(".yaml"))  # the folders beside them (tools/, agents/) hold what configs name
    assert len(shipped) >= 3 and all(name in text for name in shipped), text


def test_the_first_validation_says_each_batch_and_ctrl_c_says_what_was_kept(tmp_path, tiny_config, capsys):
    from plait import driver
    from plait.cli import kept
    cfg = tiny_config(tmp_path, "data.val_size=8", "data.val_batch_size=3", "trainer.total_training_steps=1",
                      "trainer.logger=[console]", "trainer.val_before_train=true")
    driver.build(cfg, progress=False).run()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("plait: validation (policy version 0)")]
    assert [ln.split(": ")[2].split(",")[0] for ln in lines] == ["batch 1/3", "batch 2/3", "batch 3/3"], lines
    assert "3/8 prompts answered" in lines[1]
    fresh = tmp_path / "fresh"
    assert "no checkpoint was saved" in kept(str(fresh)) and "intact" not in kept(str(fresh))
    (fresh / "checkpoints" / "global_step_4").mkdir(parents=True)
    assert "global_step_4" in kept(str(fresh)) and "resumes after step 4" in kept(str(fresh))


def test_ctrl_c_before_any_checkpoint_does_not_claim_one(tmp_path):
    """SIGINT during the first validation of a real `plait train` process: exit 130, and the last line says
    no checkpoint exists (it used to say the last checkpoint was intact)."""
    import signal
    import subprocess
    import sys
    from tests.conftest import TINY
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    proc = subprocess.Popen([sys.executable, "-m", "plait.cli", "train", "--no-progress", *TINY, "data.val_size=64",
                             "data.val_batch_size=1", "trainer.total_training_steps=50", "trainer.save_freq=40",
                             f"trainer.default_local_dir={tmp_path}"], stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stderr:  # the first validation's second batch: the run is under way
        if "batch 2/" in line:
            break
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("plait: interrupted; no checkpoint was saved"), err


def test_a_reused_output_dir_is_named_before_the_backend_starts(tmp_path, tiny_config, capsys):
    from plait import driver
    driver.build(tiny_config(tmp_path, "trainer.total_training_steps=1", "trainer.save_freq=1"), progress=False).run()
    capsys.readouterr()
    lifecycle = driver.build(tiny_config(tmp_path, "trainer.total_training_steps=2", "trainer.save_freq=1"), progress=False)
    err = capsys.readouterr().err  # said at build, before the lifecycle (and a Ray backend) starts anything
    assert f"{tmp_path} holds checkpoints of an earlier run (newest: step 1)" in err and "experiment_name" in err
    lifecycle.shutdown()
