"""kill -9 of a driver that started its own Ray: the watchdog leaves no Ray process behind."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")
pytestmark = pytest.mark.ray

DRIVER = """
import os, sys
from plait.backends import LEAN_RAY_ENV
os.environ.update(LEAN_RAY_ENV)
import ray
from plait.backends.ray import start_local_ray
start_local_ray(sys.argv[1], num_cpus=1, object_store_memory_mb=128)
print(" ".join(str(p.pid) for _, p in ray._private.worker._global_node.live_processes()), flush=True)
import time
time.sleep(300)
"""


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_kill_9_of_the_driver_leaves_no_ray_processes(tmp_path):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path / "ray")], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    pids = [int(p) for p in driver.stdout.readline().split()]
    assert pids and all(alive(p) for p in pids)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)]
