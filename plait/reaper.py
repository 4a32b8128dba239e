"""A child process and everything it ever starts, ended together on every exit path.

    caller ──Popen──▶ guardian (a small stdlib-only Python: PR_SET_CHILD_SUBREAPER, own session)
      │                 │ fork + exec
      │                 └──▶ child (the worker, its own process group) ──▶ anything it starts,
      │                                                                    setsid / double fork included
      └─ pidfd ◀── the guardian watches its caller: when the caller dies (kill -9 included), when the
                   child exits, or when asked (SIGTERM), it SIGKILLs every descendant, reaps them, and
                   exits with the child's own status (a signal death mirrored as the same signal)

Why a subreaper and not only a process group or a cgroup: a process group is left by `setsid`, and
a cgroup needs privileges and someone alive to empty it; a process that double-forks out of its
session is reparented to its nearest living subreaper ancestor, which is the guardian, so the
guardian always sees the whole tree as its descendants. The guardian watches its caller through a
pidfd (Linux >= 5.3; else it polls getppid every 0.2 s), so a caller killed with SIGKILL still has
its tree ended. With `cgroup` (a pids cgroup folder the caller made), the guardian joins it before
forking, so the whole tree counts against its pids limit; after its caller died, the last guardian
out removes the folder.

Where PR_SET_CHILD_SUBREAPER is missing (not Linux), the guardian still ends the child's process group
on every exit path, but a descendant that left that group (setsid) survives the caller. What no
unprivileged mechanism covers: user code that SIGKILLs the guardian itself (its tree is then reparented
to init); a pids cgroup, where one can be made, still lets the caller's clean close empty it.

`ReapedPopen` is the API: a `subprocess.Popen` of the guardian whose `returncode` is the child's, and
whose `stop()` ends the whole tree. The reward, tool and interaction workers start through it
(plait/data/reward_pool.py); so can anything else that runs user code in a process. A launcher that is
not Popen (asyncio's subprocesses) runs `reaped_argv(args)` and ends the tree with `stop(pid)`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Optional, Sequence

# The guardian: stdlib only (starts in ~20 ms with -I -S), argv = [caller pid, cgroup or "", child argv...].
GUARDIAN = r"""
import ctypes, os, resource, select, signal, sys, time
caller, cgroup, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
CALLER_ENV = "PLAIT_REAPER_CALLER"
me = os.getpid()
if cgroup:
    try:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write(str(me))
    except OSError:   # the folder went (the caller's close raced this start): no pids bound, the tree still reaped
        pass
try:
    subreaper = ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0   # PR_SET_CHILD_SUBREAPER
except (OSError, AttributeError):
    subreaper = False
try:
    watch = os.pidfd_open(caller) if os.getppid() == caller else None
except (AttributeError, OSError):
    watch = None
wake_r, wake_w = os.pipe()
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
asked = []
signal.signal(signal.SIGCHLD, lambda *a: None)
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, lambda *a: asked.append(1))
child = os.fork()
if child == 0:
    try:
        os.setpgid(0, 0)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.close(wake_r); os.close(wake_w)
        if watch is not None:
            os.close(watch)
        os.environ[CALLER_ENV] = str(caller)
        os.execvp(argv[0], argv)
    finally:
        os._exit(127)

def descendants():
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    parents[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, todo = set(), [me]
    while todo:
        pid = todo.pop()
        kids = [p for p, pp in parents.items() if pp == pid and p not in found]
        found.update(kids)
        todo += kids
    return found

status = None
def reap():
    global status
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid == child:
            status = st

while status is None and not asked:
    reap()
    if status is not None or asked:
        break
    if os.getppid() != caller:   # the caller died (the pidfd says it at once; this is the fallback)
        break
    # with a pidfd nothing needs polling: a SIGCHLD or a stop request writes to wake_r, the caller's end wakes watch
    ready = select.select([wake_r] + ([watch] if watch is not None else []), [], [], None if watch is not None else 0.2)[0]
    if watch is not None and watch in ready:
        break
    if wake_r in ready:
        try:
            os.read(wake_r, 4096)
        except BlockingIOError:
            pass
for _ in range(500):   # kill the tree until nothing is left: orphans are reparented here as their parents die
    try:
        os.killpg(child, signal.SIGKILL)
    except OSError:
        pass
    left = descendants() if os.path.isdir("/proc") else set()
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    reap()
    if not left and status is not None:
        break
    time.sleep(0.01)
if cgroup and os.getppid() != caller:   # an orphaned tree: the folder goes with its last guardian
    try:
        with open(os.path.join(os.path.dirname(cgroup), "cgroup.procs"), "w") as f:
            f.write(str(me))
        os.rmdir(cgroup)
    except OSError:
        pass
if status is not None and os.WIFSIGNALED(status):
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.WTERMSIG(status) not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
    os.kill(me, os.WTERMSIG(status))
    os._exit(128 + os.WTERMSIG(status))
os._exit(os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else 1)
"""


def reaped_argv(args: Sequence[str], cgroup: Optional[str] = None) -> list[str]:
    """The command line that runs `args` under a guardian, for a launcher other than Popen (asyncio's
    create_subprocess_exec: start it with start_new_session=True). The process it starts is the guardian:
    end the tree with `stop(pid)`, not a SIGKILL of its group (the guardian would die before reaping)."""
    return [sys.executable, "-I", "-S", "-c", GUARDIAN, str(os.getpid()), cgroup or "", *args]


def stop(pid: int) -> None:
    """Ask the guardian `pid` to SIGKILL its whole tree and exit (wait for it as its launcher does)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def caller_pid() -> int:
    """In a process started under a guardian: the pid of the process that started it (its parent is the
    guardian); elsewhere the parent's. Workers of one pool share it (the search tool's rate-limit files)."""
    return int(os.environ.get("PLAIT_REAPER_CALLER") or os.getppid())


class ReapedPopen(subprocess.Popen):
    """`subprocess.Popen(args, ...)` run under a guardian: `returncode` is the child's (negative for a
    signal, as Popen says it), and `stop()` (or the caller's death, kill -9 included) ends the child
    and every process it started, wherever they moved. `pid` is the guardian's; the child leads its
    own process group. `cgroup`: a pids cgroup folder the tree is to count against (and that its
    last guardian removes). Popen's keyword arguments pass through (pass_fds, env, stdin, ...);
    `start_new_session` is always on: a terminal's Ctrl-C goes to the caller, which then stops it."""

    def __init__(self, args: Sequence[str], cgroup: Optional[str] = None, **kwargs):
        kwargs["start_new_session"] = True
        super().__init__(reaped_argv(args, cgroup), **kwargs)

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """End the child and its whole tree, wait for the guardian; returns the child's returncode."""
        if self.poll() is None:
            stop(self.pid)  # the guardian's cue: it SIGKILLs the tree, reaps it, exits
            try:
                self.wait(timeout)
            except subprocess.TimeoutExpired:  # a guardian that does not answer: its group goes at once
                os.killpg(self.pid, signal.SIGKILL)
                self.wait()
        return self.returncode
