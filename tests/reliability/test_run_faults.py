"""The `plait` command under faults: a busy output dir, SIGTERM and SIGINT (exit 143 and 130, no
partial checkpoint). Runs are forked children of the test process (torch already imported)."""

import json
import os
import signal
import time

import pytest
import yaml

from plait import cli
from plait.configtree import ConfigError, to_dict
from plait.trainers.checkpoint import output_dir_lock, verify_checkpoint
from plait.trainers.lifecycle import read_metrics


def config_file(tmp_path, tiny_config, *overrides):
    """The tiny config as a YAML file for `plait train --config`."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(to_dict(tiny_config(tmp_path / "out", *overrides))))
    return str(path)


def fork(child):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child()
        finally:
            os._exit(code)
    return pid


def test_a_second_run_on_a_busy_output_dir_is_refused_naming_the_holder(tmp_path, tiny_config, capsys):
    out = tmp_path / "out"
    ready_r, ready_w = os.pipe()
    holder = fork(lambda: _hold(out, ready_w))
    os.read(ready_r, 1)
    try:
        with pytest.raises(ConfigError, match=f"in use by another plait run \\(pid {holder}\\)"):
            with output_dir_lock(str(out)):
                pass
        assert cli.main(["train", "--config", config_file(tmp_path, tiny_config)]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
        assert line.startswith("plait: config error: trainer.default_local_dir=") and str(holder) in line
    finally:
        os.kill(holder, signal.SIGKILL)  # kill -9 releases the lock: the next run may go
        os.waitpid(holder, 0)
    with output_dir_lock(str(out)):
        pass


def _hold(out, ready_w):
    with output_dir_lock(str(out)):
        os.write(ready_w, b"1")
        time.sleep(60)
    return 0


@pytest.mark.parametrize("sigs, code", [((signal.SIGTERM, signal.SIGTERM), 143), ((signal.SIGINT,), 130),
                                         ((signal.SIGTERM, signal.SIGINT), 130)])
def test_a_signal_mid_run_exits_128_plus_signum_and_leaves_nothing_partial(tmp_path, tiny_config, capfd, sigs, code):
    """SIGINT, or a second SIGTERM while the first waits for the step to end: at once, nothing partial. The second
    is sent once the first was handled (two SIGTERMs before the main thread runs Python are one to its handler),
    and the rewards take 0.3 s a step, so that it comes while the step is under way."""
    reward = tmp_path / "slow.py"
    reward.write_text("import time\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    time.sleep(0.02)\n    return 0.0\n")
    config = config_file(tmp_path, tiny_config, "trainer.total_training_steps=200", "trainer.save_freq=1",
                         "trainer.test_freq=-1", f"custom_reward_function.path={reward}", "reward.num_workers=0")
    pid = fork(lambda: cli.main(["train", "--no-progress", "--config", config]))
    metrics = tmp_path / "out" / "metrics.jsonl"
    while not (metrics.exists() and len(read_metrics(metrics)) >= 2):
        time.sleep(0.05)
    err = ""  # all of it: the line may come in two reads
    for k, sig in enumerate(sigs):
        os.kill(pid, sig)
        while k < len(sigs) - 1 and "plait: SIGTERM: finishing this step" not in err:
            err += capfd.readouterr().err
            time.sleep(0.005)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == code
    ckpts = os.listdir(tmp_path / "out" / "checkpoints")
    assert not [p for p in ckpts if ".tmp-" in p]
    latest = (tmp_path / "out" / "checkpoints" / "latest_checkpointed_iteration.txt").read_text()
    assert verify_checkpoint(str(tmp_path / "out" / "checkpoints" / f"global_step_{latest}")) is None


def test_one_sigterm_finishes_the_step_saves_and_verifies_it_and_exits_0(tmp_path, tiny_config, capfd):
    """Preemption: no periodic checkpoints (save_freq -1), yet the step under way when SIGTERM came is
    finished, saved and verified; one line says so; the same command resumes after it."""
    config = config_file(tmp_path, tiny_config, "trainer.total_training_steps=200", "trainer.save_freq=-1",
                         "trainer.test_freq=-1")
    pid = fork(lambda: cli.main(["train", "--no-progress", "--config", config]))
    metrics = tmp_path / "out" / "metrics.jsonl"
    while not (metrics.exists() and len(read_metrics(metrics)) >= 2):
        time.sleep(0.05)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    last = read_metrics(metrics)[-1]["step"]
    step = tmp_path / "out" / "checkpoints" / f"global_step_{last}"
    assert sorted(os.listdir(tmp_path / "out" / "checkpoints")) == [f"global_step_{last}", "latest_checkpointed_iteration.txt"]
    assert verify_checkpoint(str(step)) is None
    err = capfd.readouterr().err
    assert f"plait: stopped on SIGTERM after step {last}: {step} written and verified; the same command resumes " \
           f"from step {last + 1}" in err and "Traceback" not in err
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["status"] == "preempted"


def test_a_run_that_dies_on_a_fatal_signal_leaves_its_stacks_and_the_report_names_them(tmp_path, tiny_config, capsys):
    """No `finally` runs after SIGSEGV or an abort in malloc, so no summary.json: crash.log holds every thread's
    Python stack, and the report says so. A run that ends in Python leaves no crash.log."""
    reward = tmp_path / "dies.py"
    reward.write_text("import os\ncalls = 0\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    global calls\n    calls += 1\n    if calls > 20:\n        os.abort()\n    return 0.0\n")
    config = config_file(tmp_path, tiny_config, "trainer.total_training_steps=3", f"custom_reward_function.path={reward}",
                         "reward.num_workers=0")
    pid = fork(lambda: cli.main(["train", "--no-progress", "--config", config]))
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGABRT
    out = tmp_path / "out"
    stacks = (out / "crash.log").read_text()
    assert "Fatal Python error: Aborted" in stacks and 'dies.py", line 7 in compute_score' in stacks
    assert not (out / "summary.json").exists()
    assert cli.main(["profile", "report", str(out)]) == 0
    assert "crash.log holds its threads' Python stacks" in capsys.readouterr().out
    clean = tmp_path / "clean"
    clean.mkdir()
    assert cli.main(["train", "--no-progress", "--config", config_file(clean, tiny_config)]) == 0
    assert (clean / "out" / "summary.json").exists() and not (clean / "out" / "crash.log").exists()
