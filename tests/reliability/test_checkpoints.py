"""Checkpoints you can trust and crash-consistent metrics, on the real lifecycle with a small real
trainer (conftest.WalkTrainer): each test reproduces a failure seen on the pre-manifest lifecycle."""

import os
import random
import signal
import time

import pytest

from plait.trainers.checkpoint import retired, verify_checkpoint
from plait.trainers.lifecycle import read_metrics


def ckpt(out, step):
    return out / "checkpoints" / f"global_step_{step}"


def steps_logged(out):
    return [r["step"] for r in read_metrics(out / "metrics.jsonl")]


def values(out):
    return {r["step"]: r.get("w/sum") for r in read_metrics(out / "metrics.jsonl")}


def test_retention_keeps_the_new_checkpoint_whatever_the_older_numbers():
    assert retired([1, 2, 3], just_saved=3, keep=2) == [1]
    assert retired([5, 9, 2], just_saved=2, keep=1) == []     # higher numbers are never counted
    assert retired([1, 2, 3], just_saved=3, keep=None) == []


def test_fresh_start_moves_an_older_runs_checkpoints_aside(tmp_path, walk):
    walk(tmp_path, steps=6).run()
    walk(tmp_path, steps=2, resume_mode="disable").run()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["global_step_1", "global_step_2",
                                                            "latest_checkpointed_iteration.txt"]
    (old,) = os.listdir(tmp_path / "previous_runs")
    assert sorted(os.listdir(tmp_path / "previous_runs" / old / "checkpoints")) == ["global_step_5", "global_step_6"]
    assert steps_logged(tmp_path / "previous_runs" / old) == [0, 1, 2, 3, 4, 5, 6]
    assert steps_logged(tmp_path) == [0, 1, 2]
    lc = walk(tmp_path, steps=3)  # and the next resume continues the new run
    lc.run()
    assert steps_logged(tmp_path) == [0, 1, 2, 3]


@pytest.mark.parametrize("damage", ["truncate", "delete", "no_manifest", "garbage_latest"])
def test_a_damaged_newest_checkpoint_resumes_from_the_previous_one(tmp_path, walk, capfd, damage):
    walk(tmp_path / "full", steps=4).run()
    walk(tmp_path, steps=3).run()
    newest = ckpt(tmp_path, 3)
    if damage == "truncate":
        (newest / "model.pt").write_bytes((newest / "model.pt").read_bytes()[:100])
    elif damage == "delete":
        (newest / "rng.pt").unlink()
    elif damage == "no_manifest":
        (newest / "manifest.json").unlink()
    else:
        (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").write_text("\x00garbage")
    lc = walk(tmp_path, steps=4)
    lc.run()
    err = capfd.readouterr().err
    if damage == "garbage_latest":  # `latest` is only a hint: step 3 verifies and is used
        assert "resumed from" in err and "global_step_3" in err
    else:
        assert f"skipping checkpoint {newest}" in err and "global_step_2 (next step 3)" in err
    assert steps_logged(tmp_path) == [0, 1, 2, 3, 4]
    assert values(tmp_path) == values(tmp_path / "full")


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, walk, capfd):
    walk(tmp_path, steps=2).run()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "w/su')
    walk(tmp_path, steps=3).run()
    assert f"{tmp_path / 'metrics.jsonl'} line 4 is torn" in capfd.readouterr().err
    assert steps_logged(tmp_path) == [0, 1, 2, 3]


@pytest.mark.parametrize("line", ['[1, 2]', '"text"', '7', 'null', '{"step": "three"}'])
def test_a_metrics_line_that_is_not_a_step_record_is_dropped_with_a_warning(tmp_path, walk, capfd, line):
    """It crashed the resume (AttributeError: 'list' object has no attribute 'get')."""
    walk(tmp_path, steps=2).run()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(line + "\n")
    walk(tmp_path, steps=3).run()
    assert f"{tmp_path / 'metrics.jsonl'} line 4 is not a step record" in capfd.readouterr().err
    assert steps_logged(tmp_path) == [0, 1, 2, 3]


def test_a_tensorboard_folder_that_cannot_be_written_is_one_warning_and_the_run_goes_on(tmp_path, capfd):
    """A logger never kills a run: the folder is named in one line, every step still reaches metrics.jsonl."""
    from plait.profiler import GlobalProfilerConfig
    from plait.trainers.lifecycle import Lifecycle, LifecycleConfig
    from plait.trainers.tracking import Tracker
    from tests.reliability.conftest import WalkTrainer
    (tmp_path / "tensorboard").write_text("a file where the folder goes")
    tracker = Tracker(str(tmp_path), ["console", "tensorboard"], "p", "e", progress=False)
    Lifecycle(LifecycleConfig(output_dir=str(tmp_path), save_freq=-1, test_freq=-1), WalkTrainer(3, 0.0),
              GlobalProfilerConfig(), tracker).run()
    err = capfd.readouterr().err
    assert f"trainer.logger=tensorboard cannot write its event file in {tmp_path / 'tensorboard'}" in err
    assert "training goes on without TensorBoard" in err and "Traceback" not in err
    assert steps_logged(tmp_path) == [1, 2, 3]


def test_a_lost_metrics_line_is_restored_from_its_checkpoint(tmp_path, walk):
    walk(tmp_path / "full", steps=3).run()
    walk(tmp_path, steps=2).run()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # killed after save, before the line
    walk(tmp_path, steps=3).run()
    assert steps_logged(tmp_path) == [0, 1, 2, 3]
    assert values(tmp_path) == values(tmp_path / "full")


def test_stale_temp_dirs_are_removed_at_start(tmp_path, walk):
    walk(tmp_path, steps=1).run()
    stale = tmp_path / "checkpoints" / "global_step_2.tmp-99999"
    stale.mkdir()
    (stale / "model.pt").write_bytes(b"half")
    stale_latest = tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt.tmp-99999"
    stale_latest.write_text("2")
    walk(tmp_path, steps=1).run()
    assert not stale.exists() and not stale_latest.exists()


def test_kill_9_loop_during_saves_and_steps_loses_and_repeats_no_step(tmp_path, walk):
    """Several kill -9 at random points of a run (mid-step, mid-save, between save and line),
    then a resume to the end: every step logged once, each value equal to an uninterrupted run's."""
    steps, rng = 20, random.Random(0)

    def _run_child(out, steps, pause):
        walk(out, steps=steps, pause=pause, max_ckpt_to_keep=2, test_freq=3).run()
        os._exit(0)

    full, out = tmp_path / "full", tmp_path / "killed"
    _fork(lambda: _run_child(full, steps, 0.0), kill_after=None)
    kills = 0
    for _ in range(12):
        kills += _fork(lambda: _run_child(out, steps, 0.02), kill_after=rng.uniform(0.05, 0.3))
        if kills == 6:
            break
    _fork(lambda: _run_child(out, steps, 0.0), kill_after=None)
    assert kills >= 3  # a child that outruns its kill time finishes a stretch of steps: fewer kills
    assert steps_logged(out) == list(range(steps + 1))
    assert values(out) == values(full)
    assert not [p for p in os.listdir(out / "checkpoints") if ".tmp-" in p]
    assert verify_checkpoint(str(ckpt(out, steps))) is None


def _fork(child, kill_after):
    """Run `child` in a forked process; kill -9 it after `kill_after` s. True if it was killed."""
    pid = os.fork()
    if pid == 0:
        try:
            child()
        finally:
            os._exit(1)
    if kill_after is not None:
        time.sleep(kill_after)
        os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    if kill_after is None:
        assert os.waitstatus_to_exitcode(status) == 0
    return os.WIFSIGNALED(status)


def test_a_failed_write_is_one_line_and_leaves_the_previous_checkpoint_latest(tmp_path, walk):
    """A file-size limit (EFBIG, as a full disk gives ENOSPC) makes the save of step 3 fail."""
    walk(tmp_path, steps=2).run()
    read, write = os.pipe()

    def child():
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death by signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (8000, resource.RLIM_INFINITY))  # model.pt is 16 KB
        try:
            walk(tmp_path, steps=3).run()
        except Exception as err:  # noqa: BLE001 - reported to the parent
            os.write(write, f"{type(err).__name__}: {err}".encode())
        os._exit(0)
    _fork(child, kill_after=None)
    os.close(write)
    message = os.read(read, 4096).decode()
    assert message.startswith("RunError: checkpoint of step 3 not written to ")
    assert "\n" not in message and "the previous checkpoint stays latest" in message
    assert "File too large" in message
    assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(p for p in os.listdir(tmp_path / "checkpoints") if p.startswith("global")) == ["global_step_1", "global_step_2"]


def test_verls_per_role_limits_keep_whole_checkpoints(tmp_path, walk, tiny_config):
    from plait.driver import checkpoints_to_keep
    assert checkpoints_to_keep(tiny_config(tmp_path, "trainer.max_actor_ckpt_to_keep=1")) == 1
    assert checkpoints_to_keep(tiny_config(tmp_path, "trainer.max_critic_ckpt_to_keep=1")) == 2  # no critic
    assert checkpoints_to_keep(tiny_config(tmp_path, "trainer.max_ckpt_to_keep=null")) is None
    walk(tmp_path, steps=3, max_ckpt_to_keep=1).run()
    assert sorted(p for p in os.listdir(tmp_path / "checkpoints") if p.startswith("global")) == ["global_step_3"]


def test_a_full_disk_during_a_sharded_save_is_the_same_one_line(tmp_path, walk, monkeypatch):
    """The DCP writer opens each shard with pathlib's open (FileSystem.create_stream); here the open of
    step 3's shard is pointed at /dev/full, where every write fails in the kernel with ENOSPC, as on a
    full disk. DCP wraps that in a CheckpointException (a BaseException, all ranks' tracebacks);
    plait says the unsharded save's line, and step 2 stays latest."""
    from pathlib import Path

    import torch
    from torch.distributed.checkpoint.filesystem import FileSystem

    from plait.workers.parallel import save_sharded
    linear = torch.nn.Linear(64, 64)
    optim = torch.optim.AdamW(linear.parameters())

    def with_shards(lc):  # the walk's own files, and a model and optimizer saved as plait's FSDP2 roles are
        walk_save = lc.trainer.save_checkpoint
        lc.trainer.save_checkpoint = lambda path, step: (walk_save(path, step),
                                                         save_sharded(os.path.join(path, "sharded"), linear, optim))
        return lc
    with_shards(walk(tmp_path, steps=2)).run()
    real_open = FileSystem.create_stream

    def full_disk(self, path, mode):
        full = "global_step_3" in str(path) and str(path).endswith(".distcp") and mode == "wb"
        return real_open(self, Path("/dev/full") if full else path, mode)
    monkeypatch.setattr(FileSystem, "create_stream", full_disk)
    with pytest.raises(Exception) as err:
        with_shards(walk(tmp_path, steps=3)).run()
    message = f"{type(err.value).__name__}: {err.value}"
    assert message.startswith("RunError: checkpoint of step 3 not written to ")
    assert "\n" not in message and message.endswith(": No space left on device; the previous checkpoint stays latest")
    assert (tmp_path / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert verify_checkpoint(str(ckpt(tmp_path, 2))) is None
