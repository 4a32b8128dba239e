"""Reward functions run in their own processes (`reward.num_workers`), never in the trainer's.

    trainer thread ── pool(**call) ──▶ requests queue ──▶ feeder thread i ──socket──▶ worker process i
      awaits its futures                  (one per worker; blocks on     (under a guardian; the reward loaded
                                          its worker's reply, at most    from its file; RLIMIT_AS; a
                                          reward.custom_reward_function  pids limit of its own)
                                          .timeout)

A pool call returns an awaitable, so the reward managers (rewards.py) score a batch's responses on
all workers at once. Whatever user code does to its process (raises, returns garbage, calls
sys.exit, segfaults, is killed for memory, forks without end, hangs) becomes one RunError naming
the function, the data source and the sample; the worker and everything it started are killed (its
guardian, plait/reaper.py, is their subreaper: setsid and double forks included, and on the trainer's
death too) and the trainer's state is untouched. Results come back through plait's plain-data unpickler, so a reward
cannot hand the trainer anything but data. Workers start at the first call and end at
`close_reward_workers()` (the lifecycle's shutdown), on EOF of their socket, or when the trainer dies.

With a judge (a causal LM as the reward model, plait/workers/judge.py) each worker loads the judge's tokenizer
once, before its first call (transformers and torch come with it: about 250 MB and several seconds a worker),
and passes it to every call as `reward_model_tokenizer`, as verl's reward loop workers do.

Limits: memory is RLIMIT_AS per worker (address space: a reward that starts CUDA needs far more
than it uses). Processes are limited by a pids cgroup where plait may create one (cgroup v1
`/sys/fs/cgroup/pids`), else by RLIMIT_NPROC (which does not bind root); `pids_limit()` says which.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
import queue
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from multiprocessing.connection import Connection
from typing import Any, Callable, Optional

from plait.errors import RunError
from plait.reaper import ReapedPopen
from plait.safeload import UnsafeFileError, first_line, loads_plain

PIDS_CGROUP = "/sys/fs/cgroup/pids"


def describe_call(name: str, args: tuple, kwargs: dict) -> str:
    """"reward function NAME (data_source '...', response '<first 80 chars>')" for one call (or a
    batch call: its first sample)."""
    data_source = kwargs.get("data_source", args[0] if args else None)
    solution = kwargs.get("solution_str", args[1] if len(args) > 1 else None)
    if "data_sources" in kwargs:
        data_source, solution = (kwargs["data_sources"] or [None])[0], (kwargs.get("solution_strs") or [None])[0]
    return f"reward function {name} (data_source {data_source!r}, response {str(solution)[:80]!r})"


@dataclass
class RewardSpec:
    """What a worker loads: the user's function `name` from the file at `path`; with a judge, its tokenizer
    (`judge_tokenizer`: the judge's folder), passed to every call as `reward_model_tokenizer` as verl does."""
    path: str
    name: str = "compute_score"
    reward_kwargs: dict = field(default_factory=dict)
    judge_tokenizer: Optional[str] = None


@dataclass(frozen=True)
class PoolWording:
    """How a pool's failures name the call and the limits: a reward's by default; the tool pool
    (plait/agents/tool_pool.py) names the tool, the row and its own keys."""
    describe: Optional[Callable[[str, tuple, dict], str]] = None  # (label, args, kwargs) -> line; None: describe_call
    timeout_key: str = "reward.custom_reward_function.timeout"
    memory_key: str = "reward.memory_limit_mb"
    load_timeout_key: str = "the workers' load time limit"
    must: str = "a reward function must return a score"


class RewardPool:
    """`num_workers` processes calling one reward function; `pool(**kwargs)` is an awaitable result."""

    def __init__(self, spec: RewardSpec, label: str, num_workers: int, timeout: Optional[float] = None,
                 memory_limit_mb: Optional[int] = None, max_processes: int = 64,
                 wording: PoolWording = PoolWording(), warmup: Optional[dict] = None, load_timeout: float = 600.0):
        """`warmup`: the keyword arguments of a call each new worker answers before its first real call,
        within `load_timeout` rather than the call's `timeout` (the tool workers load their tools so);
        `load_timeout` also bounds the import of the function's file."""
        self.spec, self.label, self.timeout, self.wording = spec, label, timeout, wording
        self.warmup, self.load_timeout = warmup, load_timeout
        self.memory_limit_mb, self.max_processes = memory_limit_mb, max_processes
        self.workers = [_Worker(self) for _ in range(num_workers)]
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.feeders: list[threading.Thread] = []
        self.started = False
        self.lock = threading.Lock()
        _POOLS.add(self)

    def __call__(self, *args, **kwargs):
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._start()
        self.requests.put((future, args, kwargs))

        async def result():
            return await asyncio.wrap_future(future)
        return result()

    def _start(self) -> None:
        with self.lock:
            if self.started:
                return
            self.started = True
            for worker in self.workers:  # a cgroup each: one worker's fork bomb cannot starve another's start
                worker.cgroup = _make_pids_cgroup(4 + self.max_processes)
            self.feeders = [threading.Thread(target=w.feed, daemon=True, name="plait-reward-feeder")
                            for w in self.workers]  # daemons: a hung call never holds up the exit
            for feeder in self.feeders:
                feeder.start()

    def close(self) -> None:
        """Stop every worker and everything it started."""
        with self.lock:
            if not self.started:
                return
            self.started = False
            for _ in self.workers:
                self.requests.put(None)
            for worker in self.workers:
                worker.kill()
            for feeder in self.feeders:  # each sees its worker's socket close, then the None
                feeder.join(timeout=5)
            for worker in self.workers:
                _remove_cgroup(worker.cgroup)
                worker.cgroup = None


def pids_limit() -> str | None:
    """How a reward worker's processes are limited here: "cgroup", "rlimit", or None (root without
    a writable pids cgroup: a fork bomb in a reward is then bounded only by the call's timeout)."""
    if os.access(PIDS_CGROUP, os.W_OK):
        return "cgroup"
    return "rlimit" if os.geteuid() != 0 else None


def close_reward_workers() -> None:
    """End the workers of every pool (the driver calls it when a run ends, however it ends)."""
    for pool in list(_POOLS):
        pool.close()


_POOLS: "weakref.WeakSet[RewardPool]" = weakref.WeakSet()


class _Worker:
    """One worker process and the feeder thread's side of its socket."""

    def __init__(self, pool: RewardPool):
        self.pool = pool
        self.proc: Optional[ReapedPopen] = None
        self.conn: Optional[Connection] = None
        self.cgroup: Optional[str] = None  # its pids cgroup, where plait may make one (the pool's start)
        # kill() runs on the feeder thread (a failed call) and on the closing thread at once:
        # each takes the process and socket out under the lock, so an fd is never closed twice.
        self.kill_lock = threading.Lock()

    def feed(self) -> None:
        while (item := self.pool.requests.get()) is not None:
            future, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self.call(args, kwargs))
            except BaseException as err:  # noqa: BLE001 - handed to the awaiting caller
                future.set_exception(err)
        # close() kills every worker, but one this thread was starting for a call in flight at that
        # moment had no process yet: end it here, once that call is over and the pool said stop.
        self.kill()

    def call(self, args: tuple, kwargs: dict) -> Any:
        describe = self.pool.wording.describe or describe_call
        where = describe(self.pool.label, args, kwargs)
        if self.proc is None or self.proc.poll() is not None:
            self.start(where)
            if self.pool.warmup is not None:  # its loading, under the load time limit: not the call's
                self.request((), self.pool.warmup, where, self.pool.load_timeout, self.pool.wording.load_timeout_key)
        return self.request(args, kwargs, where, self.pool.timeout, self.pool.wording.timeout_key)

    def request(self, args: tuple, kwargs: dict, where: str, timeout: Optional[float], timeout_key: str) -> Any:
        conn = self.conn  # a local: close() may take self.conn away mid-call
        try:
            if conn is None:
                raise EOFError
            conn.send_bytes(pickle.dumps((args, kwargs)))
            if not conn.poll(timeout):
                self.kill()
                raise RunError(f"{where} did not return within {timeout_key}={timeout} s; its worker process was killed")
            kind, detail = loads_plain(conn.recv_bytes(), "a reward worker's reply")
        except (EOFError, OSError):
            raise RunError(f"{where} {self.death()}") from None
        except UnsafeFileError as err:
            self.kill()
            raise RunError(f"{where} returned something that is not plain data ({err})") from None
        if kind == "ok":
            return detail
        self.kill()  # what it raised may have left children or a broken state behind
        raise RunError(f"{where} {detail}")

    def start(self, where: str) -> None:
        ours, theirs = socket.socketpair()
        # The worker imports this same plait, wherever the trainer found it.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        # under a guardian (plait/reaper.py): whatever the worker starts ends with it, on every exit
        # path (kill -9 of this process included); it joins the pids cgroup before any user code runs
        self.proc = ReapedPopen([sys.executable, "-m", "plait.data.reward_pool", str(theirs.fileno())],
                                cgroup=self.cgroup, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        self.conn = Connection(ours.detach())
        pool = self.pool
        self.conn.send_bytes(pickle.dumps((vars(pool.spec), pool.memory_limit_mb, pool.max_processes, self.cgroup is not None)))
        try:
            if not self.conn.poll(pool.load_timeout):
                self.kill()
                raise RunError(f"{where}: its worker process did not load the function within "
                               f"{pool.wording.load_timeout_key}={pool.load_timeout} s; it was killed")
            kind, detail = loads_plain(self.conn.recv_bytes(), "a reward worker's reply")
        except (EOFError, OSError):
            raise RunError(f"{where}: its worker process {self.death()} while loading the function") from None
        if kind != "ok":
            self.kill()
            raise RunError(f"{where}: its worker process could not load the function: {detail}")

    def death(self) -> str:
        """How the worker ended, in words (it has, or is about to)."""
        proc = self.proc
        if proc is None:
            return "was stopped: the reward workers were closed"
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()
            return "broke its worker's connection"
        self.kill()
        if code < 0:
            name = signal.Signals(-code).name
            if -code == signal.SIGKILL:
                limit = self.pool.memory_limit_mb
                return (f"was killed by {name} in its worker process (out of memory? each worker may use "
                        f"{self.pool.wording.memory_key}={limit} MiB)")
            return f"crashed with {name} in its worker process"
        return f"ended its worker process with exit status {code} (os._exit?); {self.pool.wording.must}"

    def kill(self) -> None:
        """End the worker and every process it started (its guardian kills the tree), and close the socket."""
        with self.kill_lock:
            proc, self.proc = self.proc, None
            conn, self.conn = self.conn, None
        if proc is not None:
            proc.stop()
        if conn is not None:
            conn.close()


def _make_pids_cgroup(limit: int) -> str | None:
    if pids_limit() != "cgroup":
        return None
    path = os.path.join(PIDS_CGROUP, f"plait-rewards-{os.getpid()}-{id(threading.current_thread())}-{time.monotonic_ns()}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "pids.max"), "w") as f:
            f.write(str(limit))
    except OSError:
        return None
    return path


def _remove_cgroup(path: str | None) -> None:
    if path is None:
        return
    for _ in range(50):  # kill whatever escaped its process group, then the empty cgroup goes
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                pids = [int(p) for p in f.read().split()]
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.02)


# -- the worker process -------------------------------------------------------------------------

def worker_main(fd: int) -> None:
    conn = Connection(fd)
    spec, memory_limit_mb, max_processes, in_cgroup = pickle.loads(conn.recv_bytes())  # from the trainer
    spec = RewardSpec(**spec)
    parent = os.getppid()
    threading.Thread(target=_exit_with(parent), daemon=True).start()
    if memory_limit_mb is not None:
        limit = memory_limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if not in_cgroup and os.geteuid() != 0:  # RLIMIT_NPROC counts all of this user's tasks
        nproc = _user_tasks() + max_processes
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    try:
        fn = _load(spec)
    except BaseException as err:  # noqa: BLE001 - said to the trainer, which stops the run
        conn.send_bytes(pickle.dumps(("error", f"{type(err).__name__}: {first_line(err)}")))
        return
    conn.send_bytes(pickle.dumps(("ok", None)))
    while True:
        try:
            args, kwargs = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        conn.send_bytes(pickle.dumps(_run(fn, args, kwargs)))


def _run(fn, args: tuple, kwargs: dict) -> tuple[str, Any]:
    import inspect
    try:
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            result = asyncio.run(_awaited(result))
        return "ok", plain_result(result)
    except (SystemExit, KeyboardInterrupt) as err:
        return "error", (f"raised {type(err).__name__}({err}); a reward function must return a score, "
                         "not end the process")
    except MemoryError:
        return "error", "raised MemoryError in its worker process (reward.memory_limit_mb limits each worker)"
    except BaseException as err:  # noqa: BLE001 - said to the trainer
        return "error", f"raised {type(err).__name__}: {first_line(err)}"


async def _awaited(awaitable):
    return await awaitable


def plain_result(value: Any) -> Any:
    """A reward's result as plain data, the one form the trainer sees whether the reward ran in a
    worker (for its plain-data unpickler) or in-process (rewards.guard_reward): numpy and other
    number types become int/float, numpy bools bool, arrays and tensors their values; anything else
    unknown its repr (so the trainer names what came back)."""
    import numbers
    if value is None or type(value) in (bool, str, int, float):  # exactly: np.float64 is a float subclass
        return value
    if isinstance(value, str):  # np.str_
        return str(value)
    if isinstance(value, dict):
        return {str(k): plain_result(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_result(v) for v in value]
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "tolist"):  # a numpy array or tensor: its values
        return plain_result(value.tolist())
    return f"<{type(value).__name__}: {value!r:.60}>"


def _load(spec: RewardSpec):
    """The user's function, imported from its file as load_custom_reward does (the driver already
    checked that it imports). Not through plait.data.rewards: that would import torch in every worker."""
    import functools
    import importlib.util
    module_spec = importlib.util.spec_from_file_location(f"plait_custom_reward_{Path(spec.path).stem}", spec.path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, spec.name)
    kwargs = dict(spec.reward_kwargs)
    if spec.judge_tokenizer is not None:  # loaded once, in this process (transformers and torch: only for judges)
        kwargs["reward_model_tokenizer"] = judge_tokenizer(spec.judge_tokenizer)
    return functools.partial(fn, **kwargs) if kwargs else fn


def judge_tokenizer(path: str):
    """The judge's tokenizer as verl hands it to a reward function (hf_tokenizer): transformers' AutoTokenizer of
    its folder, its pad token the EOS where it has none."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _exit_with(parent: int):
    """Watch the trainer: when it dies (kill -9 included) this worker and its children go too."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os.killpg(os.getpid(), signal.SIGKILL)
    return watch


def _user_tasks() -> int:
    uid, n = os.getuid(), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{name}/task"))
            except OSError:
                pass
    return n


if __name__ == "__main__":
    worker_main(int(sys.argv[1]))
