"""kill -9 of a driver that started its own Ray: the watchdog leaves no Ray process behind, Ray's
dashboard and runtime-env agents (started by the raylet, reparented when it dies) included."""

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
import time


def tree(root):
    parents = {}
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                parents.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(name))
        except (OSError, ValueError):
            pass
    out, todo = [], [root]
    while todo:
        children = parents.get(todo.pop(), [])
        out += children
        todo += children
    return out


def names(pids):
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out[pid] = f.read().split(b"\\0")[0].decode()
        except OSError:
            pass
    return out


deadline = time.monotonic() + 30  # Ray's raylet starts its agents a little after ray.init returns
while time.monotonic() < deadline:
    found = names(tree(os.getpid()))
    if {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= set(found.values()):
        break
    time.sleep(0.5)
print(" ".join(f"{pid}={name.split('/')[-1].split()[0]}" for pid, name in found.items()), flush=True)
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
    named = dict(p.split("=", 1) for p in driver.stdout.readline().split())
    pids = [int(p) for p in named]
    assert {"ray::DashboardAgent", "ray::RuntimeEnvAgent", "raylet", "gcs_server"} <= set(named.values())
    assert all(alive(p) for p in pids)
    os.kill(driver.pid, signal.SIGKILL)
    driver.wait()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [named[str(p)] for p in pids if alive(p)]
