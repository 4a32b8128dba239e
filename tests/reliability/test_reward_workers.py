"""Rewards run in worker processes (reward.num_workers): whatever user code does there (crash,
segfault, OOM kill, sys.exit, a fork bomb, unbounded memory, a hang, a result that is no score)
is one RunError naming the function, data source and sample; no worker process is left and the
trainer (this process) goes on. A full run with a segfaulting reward exits 1 with one line and its
last checkpoint resumes."""

import os
import time

import pytest

from plait.data.reward_pool import RewardPool, RewardSpec, close_reward_workers, pids_limit
from plait.data.rewards import ScoreRequest, batch_manager, guard_reward, naive_manager
from plait.errors import RunError

HOSTILE = '''
import ctypes, os, signal, sys, time

def fine(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "pid": os.getpid()}

def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.3)
    return 1.0

def segfault(data_source, solution_str, ground_truth, extra_info=None):
    return ctypes.string_at(0)

def exits(data_source, solution_str, ground_truth, extra_info=None):
    sys.exit(3)

def hard_exit(data_source, solution_str, ground_truth, extra_info=None):
    os._exit(7)

def oom_killed(data_source, solution_str, ground_truth, extra_info=None):
    os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does

def hog(data_source, solution_str, ground_truth, extra_info=None):
    return len(bytearray(8 << 30))  # 8 GiB

def fork_bomb(data_source, solution_str, ground_truth, extra_info=None):
    while True:
        os.fork()

def hangs(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(60)

def text(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"

def nothing(data_source, solution_str, ground_truth, extra_info=None):
    return None

def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}

def greedy(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "fill":  # as many processes as its worker may start, left running
        started = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                started += 1
        except OSError:
            return float(started)
    time.sleep(0.3)
    return 1.0

def batch_of_strings(data_sources, solution_strs, ground_truths, extra_infos):
    return ["x" for _ in solution_strs]
'''

REQUEST = ScoreRequest(["mine", "mine"], ["a", "b"], ["a", "b"], [None, None], [1, 1])


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "hostile.py"
    path.write_text(HOSTILE)
    return str(path)


def pool_for(reward_file, name, workers=2, **limits):
    return RewardPool(RewardSpec(reward_file, name), name, workers, **limits)


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


CASES = {
    "segfault": ({}, "crashed with SIGSEGV in its worker process"),
    "exits": ({}, "raised SystemExit(3); a reward function must return a score, not end the process"),
    "hard_exit": ({}, "ended its worker process with exit status 7"),
    "oom_killed": ({}, "was killed by SIGKILL in its worker process (out of memory? each worker may use "
                       "reward.memory_limit_mb=4096 MiB)"),
    "hog": ({"memory_limit_mb": 512}, "raised MemoryError in its worker process (reward.memory_limit_mb limits"),
    "fork_bomb": ({"max_processes": 16}, "raised BlockingIOError: [Errno 11] Resource temporarily unavailable"),
    "hangs": ({"timeout": 1.0}, "did not return within reward.custom_reward_function.timeout=1.0 s; its worker process "
                                "was killed"),
    "text": ({}, "returned '1.0'; a reward must be a number or a dict with a numeric 'score'"),
    "nothing": ({}, "returned None; a reward must be a number"),
    "no_score": ({}, "returned a dict without 'score' (keys: acc); a reward must be"),
}


@pytest.mark.parametrize("name", CASES)
def test_hostile_reward_in_a_worker_is_one_line_and_leaves_no_process(reward_file, name):
    limits, said = CASES[name]
    if name == "fork_bomb" and pids_limit() is None:
        pytest.skip("root without a writable pids cgroup: nothing here would bound a fork bomb")
    limits = {"memory_limit_mb": 4096, **limits}
    pool = pool_for(reward_file, name, **limits)
    started = time.monotonic()
    with pytest.raises(RunError) as err:
        naive_manager(guard_reward(pool, name), REQUEST)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"reward function {name} (data_source 'mine', response ")
    assert said in message
    assert time.monotonic() - started < 30
    cgroups = [w.cgroup for w in pool.workers if w.cgroup is not None]
    pool.close()
    assert all(w.proc is None for w in pool.workers)
    assert not any(os.path.exists(c) for c in cgroups)  # their processes, forks included, are gone


def test_the_pool_goes_on_after_a_failed_call_and_workers_end_at_close(reward_file):
    pool = pool_for(reward_file, "fine")
    scores, extras = naive_manager(guard_reward(pool, "fine"), REQUEST)
    assert scores == [1.0, 1.0]
    pids = {int(p) for p in extras["pid"]}
    assert os.getpid() not in pids and all(alive(p) for p in pids)  # scored in other processes
    close_reward_workers()
    assert not [p for p in pids if alive(p)]
    assert naive_manager(guard_reward(pool, "fine"), REQUEST)[0] == [1.0, 1.0]  # restarts on demand
    pool.close()


def test_a_worker_that_used_up_its_processes_does_not_starve_another_workers_start(reward_file):
    """Each worker has a pids limit of its own: one that started all it may start (and keeps them) leaves
    the other worker free to start and score."""
    if pids_limit() != "cgroup":
        pytest.skip("no writable pids cgroup here: workers are bounded by RLIMIT_NPROC, which is per user")
    pool = pool_for(reward_file, "greedy", max_processes=8)
    filled = naive_manager(guard_reward(pool, "greedy"), ScoreRequest(["m"], ["fill"], ["x"], [None], [1]))[0]
    assert 0 < filled[0] <= 8 + 4
    assert naive_manager(guard_reward(pool, "greedy"), REQUEST)[0] == [1.0, 1.0]  # both workers: one starts now
    assert len({w.cgroup for w in pool.workers}) == 2
    pool.close()


def test_a_batch_call_is_checked_per_sample(reward_file):
    pool = pool_for(reward_file, "batch_of_strings", workers=1)
    with pytest.raises(RunError, match=r"^reward function batch_of_strings \(data_source 'mine', response 'a'\) "
                                       r"returned 'x'; a reward must be"):
        batch_manager(guard_reward(pool, "batch_of_strings"), REQUEST)
    pool.close()


def test_workers_score_in_parallel(reward_file):
    request = ScoreRequest(["mine"] * 8, ["a"] * 8, ["a"] * 8, [None] * 8, [1] * 8)
    pool = pool_for(reward_file, "slow", workers=4)
    naive_manager(guard_reward(pool, "slow"), ScoreRequest(["m"], ["a"], ["a"], [None], [1]))  # start the workers
    started = time.monotonic()
    assert naive_manager(guard_reward(pool, "slow"), request)[0] == [1.0] * 8
    took = time.monotonic() - started
    pool.close()
    assert took < 8 * 0.3 * 0.75  # serial would be 2.4 s; 4 workers about 0.6 s


def test_a_segfaulting_reward_stops_the_run_with_one_line_and_the_last_checkpoint_resumes(tmp_path, tiny_config,
                                                                                           capsys):
    import yaml
    from plait import cli
    from plait.configtree import to_dict
    reward = tmp_path / "reward.py"
    reward.write_text("import ctypes\nCALLS = [0]\n"
                      "def crashes_late(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    CALLS[0] += 1\n"
                      "    return ctypes.string_at(0) if CALLS[0] > 16 else 0.5\n"
                      "def fine(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 0.5\n")

    def train(name):
        cfg = tiny_config(tmp_path / "out", f"custom_reward_function.path={reward}", f"custom_reward_function.name={name}",
                          "reward.num_workers=1", "trainer.save_freq=1", "trainer.test_freq=-1")
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
        return cli.main(["train", "--no-progress", "--config", str(tmp_path / "config.yaml")])

    assert train("crashes_late") == 1  # step 1 scores 16 responses, step 2 crashes
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("plait: error: reward function crashes_late (data_source 'arithmetic', response ")
    assert last.endswith("crashed with SIGSEGV in its worker process")
    assert sorted(os.listdir(tmp_path / "out" / "checkpoints")) == ["global_step_1", "latest_checkpointed_iteration.txt"]
    assert train("fine") == 2  # a changed reward name is a meaning-changing key: refused ...
    err = capsys.readouterr().err
    assert "plait: config error: reward.custom_reward_function.name='fine': the checkpoint" in err
    cfg_allow = "trainer.resume_allow_config_change=true"
    cfg = tiny_config(tmp_path / "out", f"custom_reward_function.path={reward}", "custom_reward_function.name=fine",
                      "reward.num_workers=1", "trainer.save_freq=1", "trainer.test_freq=-1", cfg_allow)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    assert cli.main(["train", "--no-progress", "--config", str(tmp_path / "config.yaml")]) == 0  # ... unless allowed
    assert f"plait: resumed from {tmp_path / 'out' / 'checkpoints' / 'global_step_1'} (next step 2)" in capsys.readouterr().err


TRAINER = """
import sys
from plait.data.reward_pool import RewardPool, RewardSpec
from plait.data.rewards import ScoreRequest, guard_reward, naive_manager
pool = RewardPool(RewardSpec(sys.argv[1], "fine"), "fine", 2)
_, extras = naive_manager(guard_reward(pool, "fine"), ScoreRequest(["m", "m"], ["a", "b"], ["a", "b"], [None] * 2, [1, 1]))
print(" ".join(str(int(p)) for p in set(extras["pid"])), flush=True)
import time
time.sleep(300)
"""


def test_workers_end_when_the_trainer_is_killed(reward_file):
    import signal
    import subprocess
    import sys
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, reward_file], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    pids = [int(p) for p in trainer.stdout.readline().split()]
    assert pids and all(alive(p) for p in pids)
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if alive(p)]


def test_a_second_sigterm_while_a_reward_hangs_exits_143_and_ends_its_workers(tmp_path, tiny_config):
    import signal
    import subprocess
    import sys
    import yaml
    from plait.configtree import to_dict
    reward = tmp_path / "reward.py"
    reward.write_text("import os, time\n"
                      "def stuck(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    open({str(tmp_path / 'pids')!r} + '/' + str(os.getpid()), 'w').close()\n"
                      "    time.sleep(120)\n")
    (tmp_path / "pids").mkdir()
    cfg = tiny_config(tmp_path / "out", f"custom_reward_function.path={reward}", "custom_reward_function.name=stuck",
                      "reward.num_workers=2", "trainer.test_freq=-1")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    trainer = subprocess.Popen([sys.executable, "-m", "plait.cli", "train", "--no-progress", "--config",
                                str(tmp_path / "config.yaml")], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.monotonic() + 120
    while len(os.listdir(tmp_path / "pids")) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = [int(p) for p in os.listdir(tmp_path / "pids")]
    assert len(workers) == 2 and all(alive(p) for p in workers)
    trainer.send_signal(signal.SIGTERM)  # the first waits for the step (which hangs); the second stops at once
    time.sleep(0.5)
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(timeout=30) == 143
    assert "Traceback" not in trainer.stderr.read()
    assert not [p for p in workers if alive(p)]


NUMPY_EXTRAS = '''
import numpy as np

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    right = solution_str == ground_truth
    return {"score": np.float32(right), "acc": np.bool_(right), "len": np.int64(len(solution_str)),
            "half": np.float64(0.5), "zero_d": np.array(2.0), "label": np.str_("x"), "vec": np.ones(2)}
'''


def test_numpy_extras_give_the_same_record_in_process_and_in_workers(tmp_path):
    """numpy scalars, numpy bools and 0-d arrays in a reward's extra fields: reward.num_workers=0
    (in-process) and =2 (workers, whose results pass a plain-data unpickler) log the same metrics
    (numpy bools were 1.0 from workers and absent in-process)."""
    from plait.configtree import build
    from plait.data.rewards import RewardConfig, resolve_reward
    path = tmp_path / "numpy_reward.py"
    path.write_text(NUMPY_EXTRAS)
    request = ScoreRequest(["mine"] * 3, ["a", "bb", "c"], ["a", "b", "c"], [None] * 3, [1] * 3)
    records = []
    try:
        for workers in (0, 2):
            reward = build(RewardConfig, {"num_workers": workers, "custom_reward_function": {"path": str(path)}})
            records.append(resolve_reward(reward, 8)(request))
    finally:
        close_reward_workers()
    in_process, in_workers = records
    assert in_process == in_workers
    assert in_process == ([1.0, 0.0, 1.0], {"acc": [1.0, 0.0, 1.0], "len": [1.0, 2.0, 1.0], "half": [0.5] * 3,
                                            "zero_d": [2.0] * 3})


RAISES = '''
async def later(data_source, solution_str, ground_truth, extra_info=None):
    raise KeyError("no such field")

def now(data_source, solution_str, ground_truth, extra_info=None):
    raise ValueError("bad\\nsecond line")
'''


@pytest.mark.parametrize("name, said", [("now", "raised ValueError: bad"), ("later", "raised KeyError: 'no such field'")])
def test_a_reward_that_raises_is_the_same_one_line_in_process_and_in_workers(tmp_path, name, said):
    from plait.configtree import build
    from plait.data.rewards import RewardConfig, resolve_reward
    path = tmp_path / "raises.py"
    path.write_text(RAISES)
    messages = []
    try:
        for workers in (0, 1):
            reward = build(RewardConfig, {"num_workers": workers, "custom_reward_function": {"path": str(path), "name": name}})
            with pytest.raises(RunError) as err:
                resolve_reward(reward, 8)(REQUEST)
            messages.append(str(err.value))
    finally:
        close_reward_workers()
    assert messages[0] == messages[1]
    assert messages[0] == f"reward function {name} (data_source 'mine', response 'a') {said}"
