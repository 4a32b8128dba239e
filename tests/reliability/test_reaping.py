"""Processes that user code starts end with its worker, on every exit path: a clean close, a killed
call, and a kill -9 of the process that owns the pool (the driver, or a Ray worker hosting the
rollout). User code here leaves its worker's session (setsid) and double-forks a daemon, the two
ways out of a process group (plait/reaper.py)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from plait.reaper import ReapedPopen, reaped_argv, stop

# Prints the pids of two processes that left its process group: one in a session of its own
# (setsid), one double-forked (its parent exits at once, so it is nobody's child but the reaper's).
ESCAPE = textwrap.dedent('''
    import os, subprocess, sys, time
    def escape():
        lone = subprocess.Popen(["sleep", "600"], start_new_session=True).pid
        r, w = os.pipe()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.write(w, str(os.getpid()).encode())
                time.sleep(600)
            os._exit(0)
        os.wait()
        daemon = int(os.read(r, 32))
        return lone, daemon
''')


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def all_gone(pids, within=10.0):
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not [p for p in pids if alive(p)]


def test_stop_ends_the_child_and_what_left_its_session_and_returncode_is_the_childs(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(ESCAPE + "print(*escape(), flush=True)\ntime.sleep(600)\n")
    proc = ReapedPopen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(alive(p) for p in pids)
    assert proc.stop() == -signal.SIGKILL
    assert all_gone(pids, within=2.0)
    assert ReapedPopen([sys.executable, "-c", "import sys; sys.exit(3)"]).wait() == 3
    segv = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    assert ReapedPopen([sys.executable, "-c", segv]).wait() == -signal.SIGSEGV


def test_what_the_child_left_behind_ends_when_the_child_exits(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(ESCAPE + "print(*escape(), flush=True)\n")
    proc = ReapedPopen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert proc.wait(timeout=10) == 0
    assert all_gone(pids, within=2.0)


def test_an_asyncio_launcher_reaps_the_same_way(tmp_path):
    """The gateway's agents start with asyncio: reaped_argv and stop give them the same guarantees."""
    import asyncio
    script = tmp_path / "child.py"
    script.write_text(ESCAPE + "print(*escape(), flush=True)\nimport sys; sys.exit(5)\n")

    async def launch():
        proc = await asyncio.create_subprocess_exec(*reaped_argv([sys.executable, str(script)]),
                                                    stdout=asyncio.subprocess.PIPE, start_new_session=True)
        pids = [int(p) for p in (await proc.stdout.readline()).split()]
        return pids, await proc.wait()
    pids, code = asyncio.run(launch())
    assert code == 5 and len(pids) == 2 and all_gone(pids, within=2.0)

    async def stopped():
        proc = await asyncio.create_subprocess_exec(*reaped_argv(["sleep", "600"]), start_new_session=True)
        await asyncio.sleep(0.3)
        stop(proc.pid)
        return await proc.wait()
    assert asyncio.run(stopped()) == -signal.SIGKILL


TOOLS = ESCAPE + textwrap.dedent('''
    from plait.agents.tools import function_tool

    @function_tool(schema={"type": "function", "function": {"name": "spawn", "description": "s"}})
    def spawn():
        return " ".join(map(str, escape()))
''')

# The pool's owner: builds a ToolBox, has the tool start its escapees, prints their pids and waits.
OWNER = textwrap.dedent('''
    import asyncio, sys, time
    from types import SimpleNamespace
    from plait.agents.tool_parser import FunctionCall
    from plait.agents.tools import ToolBox, ToolLimits
    mt = SimpleNamespace(tool_config_path=None, function_tool_path=sys.argv[1], max_tool_response_length=256,
                         tool_response_truncate_side="middle")
    box = ToolBox.from_config(mt, ToolLimits(num_workers=1, timeout_s=20, memory_limit_mb=1024))
    result = asyncio.run(box.call([FunctionCall("spawn", "{}")], {}, "row 0"))[0]
    print(result.text, flush=True)
    time.sleep(600)
''')


def test_tool_processes_outside_the_workers_session_end_when_the_driver_is_killed(tmp_path):
    """Fails without the guardian: only the worker's process group was killed when its owner died."""
    (tmp_path / "tools.py").write_text(TOOLS)
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "tools.py")], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    line = owner.stdout.readline()
    pids = [int(p) for p in line.split()]
    assert len(pids) == 2 and all(alive(p) for p in pids), line
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait()
    assert all_gone(pids), [p for p in pids if alive(p)]
    from plait.data.reward_pool import PIDS_CGROUP, pids_limit
    if pids_limit() == "cgroup":  # the pool's pids cgroup goes with its last guardian (it stayed, empty)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and [n for n in os.listdir(PIDS_CGROUP) if n.startswith(f"plait-rewards-{owner.pid}-")]:
            time.sleep(0.1)
        assert not [n for n in os.listdir(PIDS_CGROUP) if n.startswith(f"plait-rewards-{owner.pid}-")]


@pytest.mark.ray
def test_tool_processes_end_when_the_ray_worker_that_owns_them_is_killed(tmp_path):
    """The rollout's tools live in a Ray worker process; kill -9 of that process ends them too."""
    ray = pytest.importorskip("ray")
    from plait.backends import LEAN_RAY_ENV
    os.environ.update(LEAN_RAY_ENV)
    from plait.backends.ray import start_local_ray, stop_local_ray
    (tmp_path / "tools.py").write_text(TOOLS)
    started = None if ray.is_initialized() else start_local_ray(str(tmp_path / "ray"), num_cpus=2,
                                                                 object_store_memory_mb=128)

    @ray.remote(num_cpus=0.1)
    class Owner:
        def spawn(self, path):
            import asyncio
            from types import SimpleNamespace
            from plait.agents.tool_parser import FunctionCall
            from plait.agents.tools import ToolBox, ToolLimits
            mt = SimpleNamespace(tool_config_path=None, function_tool_path=path, max_tool_response_length=256,
                                 tool_response_truncate_side="middle")
            self.box = ToolBox.from_config(mt, ToolLimits(num_workers=1, timeout_s=20, memory_limit_mb=1024))
            text = asyncio.run(self.box.call([FunctionCall("spawn", "{}")], {}, "row 0"))[0].text
            return os.getpid(), [int(p) for p in text.split()]
    try:
        owner = Owner.options(runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}}).remote()
        worker_pid, pids = ray.get(owner.spawn.remote(str(tmp_path / "tools.py")), timeout=120)
        assert len(pids) == 2 and all(alive(p) for p in pids)
        os.kill(worker_pid, signal.SIGKILL)
        assert all_gone(pids), [p for p in pids if alive(p)]
    finally:
        if started is not None:
            stop_local_ray(started)
