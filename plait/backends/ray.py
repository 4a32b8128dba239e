"""The Ray backend: worker groups as Ray actors, data-parallel over torch.distributed.

    driver ── RayWorkerGroup.call / call_dp ──▶ Host actors (one process per GPU, or per CPU worker)
                                                  │  each hosts role objects: actor, ref, critic, rollout
      train pool:   Host rank 0 .. W-1  ◀── torch.distributed group (gloo on CPU, NCCL on GPU)
      rollout:      Host rank 0 of the train pool (colocated) or its own one-process pool (separated)
      reward pool:  Host rank 0 .. R-1  ◀── a torch.distributed group of its own (enable_resource_pool)
      teacher pool: Host rank 0 .. D-1  ◀── likewise (distillation.nnodes > 0; else the teachers are on train)

Placement: a pool is one placement group of bundles ({CPU: cpus_per_worker} plus {GPU: 1} on GPUs,
plus the pool's custom resources from `trainer.ray.pool_resources`, which pin it to the nodes that
have them): W = `trainer.ray.num_cpu_workers` on CPU or `trainer.nnodes * trainer.n_gpus_per_node`
with GPUs; R = verl's `reward.reward_model.nnodes * n_gpus_per_node` (CPU: worker processes), D = `distillation.nnodes *
n_gpus_per_node` likewise; the
rollout's one process holds `rollout.n_gpus_per_node` devices (CPU: cpus_per_worker slots) when
`rollout.nnodes` is 1. Each is laid out by `trainer.ray.placement_strategy` (PACK onto few nodes,
SPREAD across them); a pool that cannot be placed in `placement_timeout_s` is an error naming the
keys that sized it (bigger than the cluster) or the missing resources, never a silent pending wait.
The data-parallel roles (actor, critic, ref, and the reward model and teachers without their own pools) live on
every host of the train pool; the rollout runs one worker. Each role says at start, in one line,
where it runs (node, ranks, devices). Each host process runs its own ProfilerSession with its
rank; `profile_targets()` gives the driver one proxy for all of them.

Ports: the train pool's rendezvous store (torch's TCPStore, no authentication) and gloo's pair
sockets listen on 127.0.0.1 when the whole pool is on one node, else on the node's cluster address.

A worker that dies or raises fails the whole group at once: the first error is raised on the
driver as one `WorkerError`, open profiler windows on the surviving hosts are closed (their
records handed to the driver's profiler), every host is killed (a surviving rank may be blocked
in a collective) and a Ray instance plait started is shut down. Except on a pool that holds one role alone (the
separated rollout's, the reward pool of a reward model or judge, the teachers' pool): its process's death is an
EngineDied, which the trainer repairs with `RayWorkerGroup.recover` (fresh processes for the pool) and a
re-issued call.

Left out: data-parallel generation (one rollout engine, so a rollout pool spans one node), pools for
the critic or ref apart from the actor's, and actor restarts.
"""

from __future__ import annotations

import atexit
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

import ray
import torch
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from plait.config import PlaitConfig, RayConfig
from plait.configtree import ConfigError
from plait.errors import EngineDied, RunError
from plait.profiler.config import ROLE_KEYS
from plait.profiler.timeline import TIMELINE
from plait.allocator import keep_freed_memory
from plait.workers.engine import ENGINES

DATA_PARALLEL_ROLES = ("actor", "critic", "ref", "reward_model", "teacher")
OWN_POOLS = {"reward_model": "reward", "teacher": "teacher"}  # roles that may have a pool of their own: its name
DATA_PARALLEL_POOLS = ("train", "reward", "teacher")  # each its own torch.distributed world
CHANNEL_DEATH_S = 60.0  # how long a weight sender may take to notice its receiver died (gloo sees the socket close)
QUIET_TORCH_ENV = {"KINETO_LOG_LEVEL": "6", "TORCH_CPP_LOG_LEVEL": "ERROR"}
LOOPBACK = "127.0.0.1"
PEER_DEATH_GRACE_S = 3.0  # how long a failed call waits for its peers' calls to say whether one of them died


class WorkerError(RunError):
    """A worker process died or raised; the Ray backend has been shut down. One line; the remote
    traceback (or Ray's account of the death) goes to `<output_dir>/worker_errors.log` (`log`), and
    `cause` is the exception the worker raised (None when it died)."""


@ray.remote(concurrency_groups={"control": 1})
class Host:
    """One worker process: the role objects placed on it, its profiler session, its DP rank."""

    def __init__(self, rank: int, world_size: int, cwd: str, threads: int, profiler_cfg, roles_cfg: dict):
        from plait.profiler import ProfilerSession
        if os.path.isdir(cwd):  # relative model, data and profile paths mean what they mean on the driver
            os.chdir(cwd)
        torch.set_num_threads(threads)
        if not torch.cuda.is_available():  # its workers' tensors live in host memory
            keep_freed_memory()
        self.rank, self.world_size = rank, world_size
        # this process's stage spans, every step, back with each reply; imported here, not at the top: Ray
        # pickles this class by value, and with it a copy of any object it names from the module's globals
        from plait.profiler.timeline import RANK_SPANS
        RANK_SPANS.enable(rank)
        self.session = ProfilerSession(profiler_cfg, roles_cfg, rank=rank, world_size=world_size)
        from plait.profiler.tools.torch import TorchTool, init_kineto
        if isinstance(self.session.tool, TorchTool):  # this is the thread that loaded torch: see init_kineto
            init_kineto()
        self.workers: dict[str, Any] = {}
        self.store = None
        self.channel = self.channel_store = None  # the weight channel (join_channel)
        self.channel_syncs = 0

    def where(self) -> tuple[str, str, list[int], float]:
        """(node id, node address, GPU ids, CPUs) of this process."""
        ctx = ray.get_runtime_context()
        cpus = ctx.get_assigned_resources().get("CPU", 0.0)
        return ctx.get_node_id(), ray.util.get_node_ip_address(), [int(g) for g in ray.get_gpu_ids()], cpus

    def open_store(self, one_node: bool, size: Optional[int] = None) -> tuple[str, int]:
        """Rank 0: a TCP store on a free port for a process group of `size` (the pool's) to meet at,
        bound to loopback when the group is on one node, else to this node's cluster address
        (torch alone would bind `*`). The weight channel's store is a second one."""
        import socket
        import torch.distributed as dist
        host = LOOPBACK if one_node else ray.util.get_node_ip_address()
        listener = socket.create_server((host, 0))
        port = listener.getsockname()[1]
        store = dist.TCPStore(host, port, size or self.world_size, is_master=True, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
        # the store owns the descriptor now and closes it when it goes: a socket object closing it too (when a
        # respawned rollout's channel replaced the store) could close a descriptor reused meanwhile, such as the
        # new channel's connection ("Failed to recv, got 0 bytes")
        listener.detach()
        if size is None:
            self.store = store
        else:
            self.channel_store = store
        return host, port

    def join_channel(self, host: str, port: int, rank: int) -> None:
        """The weight channel: a 2-process group of train rank 0 (0) and the rollout (1), gloo on CPU,
        NCCL on GPU, outside the train pool's group."""
        import datetime
        import torch.distributed as dist
        if host == LOOPBACK:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        else:  # across nodes: the hostname's interface (the train pool may have set lo in this process)
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        self.channel_syncs = 0  # a fresh channel (a respawned rollout): both ends count its syncs from 0
        if rank == 1:
            self.channel_store = dist.TCPStore(host, port, 2, is_master=False)
        store = dist.PrefixStore("weights", self.channel_store)
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this process's GPU
            self.channel = dist.ProcessGroupNCCL(store, rank, 2)
        else:
            self.channel = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(minutes=30))

    def send(self, role: str, method: Callable, root: bool) -> None:
        """`method(worker)` (a state dict) on every rank; rank 0 broadcasts it over the weight channel:
        names, shapes and dtypes through the channel's store, then one flat buffer per dtype."""
        import json
        state = method(self.workers[role])
        if not root:
            return reply(None)
        names = list(state)
        meta = [(k, list(state[k].shape), str(state[k].dtype).removeprefix("torch.")) for k in names]
        self.channel_syncs += 1
        self.channel_store.set(f"meta{self.channel_syncs}", json.dumps(meta))
        for dtype in sorted({m[2] for m in meta}):
            flat = torch.cat([state[k].reshape(-1) for k, _, d in meta if d == dtype])
            self.channel.broadcast([flat.cuda() if torch.cuda.is_available() else flat]).wait()
        return reply(None)

    def receive(self, role: str, method: Callable, payload: tuple) -> None:
        """The other end of `send`: rebuild the state dict, then `method(worker, state, *args)`."""
        import json
        self.channel_syncs += 1
        meta = json.loads(self.channel_store.get(f"meta{self.channel_syncs}"))
        device = "cuda" if torch.cuda.is_available() else "cpu"
        state = {}
        for dtype in sorted({m[2] for m in meta}):
            group = [m for m in meta if m[2] == dtype]
            flat = torch.empty(sum(math.prod(shape) for _, shape, _ in group), dtype=getattr(torch, dtype), device=device)
            self.channel.broadcast([flat]).wait()
            for (name, shape, _), part in zip(group, flat.split([math.prod(shape) for _, shape, _ in group])):
                state[name] = part.view(shape)
        args, kwargs = payload
        method(self.workers[role], state, *args, **kwargs)
        return reply(None)

    def pipe(self, src: str, get: Callable, dst: Optional[str], put: Callable, payload: tuple) -> None:
        """In one process: `put(dst worker, get(src worker), *args)`; without `dst` here, only `get`
        (its collectives with the other ranks)."""
        out = get(self.workers[src])
        if dst is not None:
            args, kwargs = payload
            put(self.workers[dst], out, *args, **kwargs)
        return reply(None)

    def join_group(self, host: str, port: int) -> None:
        import torch.distributed as dist
        if host == LOOPBACK:  # gloo's pair sockets on loopback too (it would pick the hostname's interface)
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        store = self.store or dist.TCPStore(host, port, self.world_size, is_master=False)
        if torch.cuda.is_available():
            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this process's GPU
        # NCCL for CUDA tensors, gloo for the small CPU reductions (token counts, metrics).
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size)

    def construct(self, role: str, cls: type, payload: tuple) -> int:
        args, kwargs = payload
        self.workers[role] = cls(*args, profiler=self.session.for_role(role), **kwargs)
        return os.getpid()

    def run(self, role: str, method: Callable, payload: tuple, keep: bool) -> Any:
        """`method(worker, *args, **kwargs)`; the result crosses to the driver on CPU, or not at all."""
        args, kwargs = payload
        out = method(self.workers[role], *args, **kwargs)
        return reply(to_cpu(out) if keep else None)

    @ray.method(concurrency_group="control")
    def run_out_of_band(self, role: str, method: Callable, payload: tuple) -> None:
        """A worker method marked `out_of_band` (an abort), on the control thread: it overtakes `run`."""
        args, kwargs = payload
        method(self.workers[role], *args, **kwargs)

    def start_profile(self, first_step: int, last_step: int, version: int) -> None:
        self.session.start(first_step, last_step, version)

    def stop_profile(self, complete: bool) -> list[dict]:
        # On the actor's one thread, after any running call: torch's profiler crashes when stopped
        # from a thread other than the one that started it.
        return self.session.stop(complete)


class Reply:
    """A worker call's result with the stage spans the process recorded since its last reply
    (profiler/timeline.py RANK_SPANS); `gather` writes the spans into the driver's timeline."""
    __slots__ = ("out", "spans", "pid")

    def __init__(self, out: Any, spans: list, pid: int):
        self.out, self.spans, self.pid = out, spans, pid


def reply(out: Any) -> Any:
    from plait.profiler.timeline import RANK_SPANS  # the process's own (see Host.__init__)
    spans = RANK_SPANS.take()
    return Reply(out, spans, os.getpid()) if spans else out


def to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(v) for v in x)
    if isinstance(x, dict):
        return {k: to_cpu(v) for k, v in x.items()}
    return x


def start_local_ray(temp_dir: str, num_cpus: Optional[int] = None, object_store_memory_mb: Optional[int] = None) -> str:
    """Start a lean single-machine Ray (no dashboard, no usage stats, session files under `temp_dir`).

    Ray's sockets live in its temp dir and a socket path may not exceed 107 bytes, so Ray is given
    a short link in /tmp to `temp_dir`; returns the link's folder for `stop_local_ray`. A watchdog
    process kills this Ray's processes if the driver dies without stopping it (kill -9).
    Set plait.backends.LEAN_RAY_ENV in os.environ before importing this module.
    """
    os.makedirs(temp_dir, exist_ok=True)
    link_dir = tempfile.mkdtemp(prefix="plait-ray-")
    link = os.path.join(link_dir, "t")
    os.symlink(os.path.abspath(temp_dir), link)
    store = None if object_store_memory_mb is None else object_store_memory_mb * 2**20
    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, object_store_memory=store, _temp_dir=link,
                 configure_logging=False)
    except BaseException:
        shutil.rmtree(link_dir, ignore_errors=True)
        raise
    # Ray's own list of the processes it started for this instance (gcs, raylet, agents): private API.
    node = ray._private.worker._global_node
    pids = [str(p.pid) for _, p in node.live_processes()]
    session = os.path.realpath(node.get_session_dir_path())
    _WATCHDOGS[link_dir] = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(os.getpid()), link_dir, session, *pids],
                                            start_new_session=True, stdin=subprocess.DEVNULL)
    return link_dir


def stop_local_ray(link_dir: str) -> None:
    ray.shutdown()
    watchdog = _WATCHDOGS.pop(link_dir, None)
    if watchdog is not None:
        watchdog.kill()
        watchdog.wait()
    shutil.rmtree(link_dir, ignore_errors=True)


_WATCHDOGS: dict[str, subprocess.Popen] = {}

# Waits for the driver (argv[1]) to die, then SIGKILLs the Ray processes (argv[4:]) and everything
# they started (workers, the raylet's dashboard and runtime-env agents), and removes the socket link
# folder (argv[2]). The tree is followed while the driver lives, and a process that still holds a
# file in this instance's session folder (argv[3]) at the end is Ray's too: when the raylet dies
# with the driver, an agent started moments before is reparented to init and no walk finds it.
# A followed pid is killed only if its start time is the one seen (a reused pid is spared).
# Linux /proc; stdlib only.
WATCHDOG = r"""
import os, shutil, signal, sys, time
driver, link_dir, session, roots = int(sys.argv[1]), sys.argv[2], sys.argv[3], {int(p) for p in sys.argv[4:]}

def stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # [state, ppid, ... starttime at 19]
    except OSError:
        return None

def alive(pid):
    s = stat(pid)
    return s is not None and s[0] != "Z"

seen = {}  # pid -> start time, for every Ray process and descendant seen so far

def follow():
    stats = {int(n): s for n in os.listdir("/proc") if n.isdigit() and (s := stat(int(n)))}
    children = {}
    for pid, s in stats.items():
        children.setdefault(int(s[1]), []).append(pid)
    todo = [p for p in roots | set(seen) if p in stats]
    while todo:
        pid = todo.pop()
        if seen.setdefault(pid, stats[pid][19]) == stats[pid][19]:
            todo += [c for c in children.get(pid, []) if c not in seen]

def holds_session_file(pid):
    if not os.path.basename(session).startswith("session_"):  # never match more than one Ray's folder
        return False
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(session + "/"):
                return True
        except OSError:
            pass
    return False

while alive(driver):
    follow()
    time.sleep(0.5)
follow()
doomed = [pid for pid, start in seen.items() if (s := stat(pid)) is not None and s[19] == start]
me = os.getpid()
doomed += [int(n) for n in os.listdir("/proc") if n.isdigit() and int(n) not in seen and int(n) != me
           and holds_session_file(int(n))]
for pid in doomed:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
shutil.rmtree(link_dir, ignore_errors=True)
"""


class RayBackend:
    def __init__(self, cfg: PlaitConfig, roles_cfg: dict, device: str, address: Optional[str] = None):
        self.cfg: RayConfig = cfg.trainer.ray
        self.error_log = os.path.join(cfg.output_dir, "worker_errors.log")
        self.failed: Optional[WorkerError] = None
        self.fail_lock = threading.Lock()
        self.link_dir: Optional[str] = None  # set when plait started the Ray instance
        self.connected = False  # plait called ray.init (started or joined), so it disconnects at the end
        self.pgs: list = []
        self.hosts: list = []  # every host, train pool first
        self.locations: dict = {}  # host -> (node id, node address, GPU ids)
        self.channel: Optional[tuple] = None  # (sender, receiver) hosts of the weight channel, once opened
        self.pools: dict[str, list] = {}  # "train", "rollout" and "reward" -> their hosts
        self.own_pools: set[str] = set()  # roles on a pool of their own (reward.reward_model.enable_resource_pool,
        #   distillation.nnodes > 0)
        self.salvaged: list[dict] = []  # profiler records rescued from a failing group
        self.pool_args: dict[str, tuple] = {}  # pool -> what made its hosts (placement group, bundle, ...): respawn
        self.profile_open = False
        self.profiler_tool = cfg.global_profiler.tool
        if not ray.is_initialized():
            self.connected = True
            if address is not None:
                ray.init(address=address, configure_logging=False)
            else:
                self.link_dir = start_local_ray(os.path.join(cfg.output_dir, "ray"), self.cfg.num_cpus,
                                                self.cfg.object_store_memory_mb)
        atexit.register(self.shutdown)
        try:
            self._place(cfg, roles_cfg, device)
        except BaseException:
            self.shutdown()
            raise

    def _place(self, cfg: PlaitConfig, roles_cfg: dict, device: str) -> None:
        """Reserve each pool (train; rollout when separated; reward with its own pool), start its hosts, and
        join each data-parallel pool's process group."""
        gpu = device.startswith("cuda")
        t, rollout, rm, d = cfg.trainer, cfg.actor_rollout_ref.rollout, cfg.reward.reward_model, cfg.distillation
        separated = t.placement == "separated"
        own = self.own_pools = {role for role, on in (("reward_model", rm.enable and rm.enable_resource_pool),
                                                       ("teacher", d.enabled and d.pool_size > 0)) if on}
        cpus = self.cfg.cpus_per_worker
        # The rollout's one process holds its pool's devices: n_gpus_per_node GPUs (its engine's tensor
        # parallelism), or without CUDA that many CPU slots of cpus_per_worker (its torch threads).
        slots = rollout.n_gpus_per_node if rollout.nnodes else 1
        if gpu and separated:
            engine = ENGINES[rollout.name]
            need = engine.devices(rollout)
            if slots != need:
                raise ConfigError("actor_rollout_ref.rollout.n_gpus_per_node", slots,
                                  f"{need} here: plait's rollout is one {rollout.name} engine, which uses {need} GPU(s) "
                                  f"({engine.devices_rule} with {rollout.name})")
        one = {"CPU": cpus, **({"GPU": 1} if gpu else {})}
        specs = {"train": (t.nnodes * t.n_gpus_per_node if gpu else self.cfg.num_cpu_workers, one),
                 "rollout": (1 if separated else 0, {"CPU": cpus, "GPU": slots} if gpu else {"CPU": cpus * slots}),
                 "reward": (rm.nnodes * rm.n_gpus_per_node if "reward_model" in own else 0, one),
                 "teacher": (d.pool_size if "teacher" in own else 0, one)}
        specs = {name: (size, {**bundle, **self.cfg.pool_resources.get(name, {})})
                 for name, (size, bundle) in specs.items() if size}
        for role, rc in roles_cfg.items():  # a rank no worker of the role has would silently profile nothing
            n = specs.get(pool_of(role, own), (1,))[0]  # the colocated rollout: 1
            if any(r >= n for r in rc.ranks):
                raise ConfigError(f"{ROLE_KEYS.get(role, role)}.profiler.ranks", rc.ranks,
                                  f"the Ray backend runs {n} {role} worker(s): ranks must be below {n}")
        profiler_cfg = cfg.global_profiler
        # Kineto's and PyTorch's C++ log lines ("External init callback", CPUAllocator's warnings): read when a
        # worker imports torch, before any plait code runs there, so set in its environment (the user's own wins)
        runtime_env: dict = {"env_vars": {k: os.environ.get(k, v) for k, v in QUIET_TORCH_ENV.items()}}
        if profiler_cfg.tool == "nsys":  # each window is one capture range (cudaProfilerApi) in a per-process report
            runtime_env["nsight"] = {"t": "cuda,nvtx,osrt", "capture-range": "cudaProfilerApi",
                                     "capture-range-end": "repeat", "cuda-memory-usage": "true"}
        # Each host's profiler session knows the roles it hosts, so its artifacts are named after them;
        # colocated, the rollout's roles live on train rank 0.
        def roles_on(pool: str, rank: int) -> dict:
            return {r: c for r, c in roles_cfg.items() if pool_of(r, own) == pool
                    or (pool == "train" and rank == 0 and not separated and pool_of(r, own) == "rollout")}
        self.pools = {}
        for name, (size, bundle) in specs.items():
            try:
                self.pools[name] = self._pool(name, [roles_on(name, i) for i in range(size)], bundle, profiler_cfg, runtime_env)
            except WorkerError:  # not placed in time: pools bigger than the cluster are the config's fault
                self._check_fits({n: specs[n] for n in (*self.pools, name)}, cfg, gpu)
                raise
        self.pools.setdefault("rollout", self.pools["train"][:1])
        self.locations = dict(zip(self.hosts, self.gather([h.where.remote() for h in self.hosts], "worker process", "start")))
        for name in DATA_PARALLEL_POOLS:  # each data-parallel pool is its own torch.distributed world
            if name in specs:
                self._join_group(self.pools[name])

    def _join_group(self, hosts: list) -> None:
        """`hosts` (a pool's, in rank order) into one torch.distributed world, met at rank 0's store."""
        one_node = len({self.locations[h][0] for h in hosts}) == 1
        [(host, port)] = self.gather([hosts[0].open_store.remote(one_node)], "worker process", "start")
        self.gather([h.join_group.remote(host, port) for h in hosts], "worker process", "init_process_group")

    def _check_fits(self, specs: dict, cfg: PlaitConfig, gpu: bool) -> None:
        """Pools that together ask for more than the cluster has are a config error, named by the keys that
        sized the first pool that does not fit. Asked once a pool has waited `placement_timeout_s`, as
        nodes may still be joining."""
        total, used = ray.cluster_resources(), {}
        for name, (size, bundle) in specs.items():
            for res, amount in bundle.items():
                used[res] = used.get(res, 0) + size * amount
                if used[res] > total.get(res, 0) + 1e-9:
                    key, value = pool_keys(name, res, cfg, gpu)
                    beside = f" with the pools before it ({used[res] - size * amount:g})" if used[res] > size * amount else ""
                    raise ConfigError(key, value, f"the {name} pool asks for {res} {size * amount:g}{beside} and the "
                                      f"Ray cluster has {total.get(res, 0):g} in all (ray status): lower it or add nodes")

    def _pool(self, name: str, roles_per_rank: list[dict], bundle: dict, profiler_cfg, runtime_env) -> list:
        size = len(roles_per_rank)
        pg = placement_group([bundle] * size, strategy=self.cfg.placement_strategy)
        self.pgs.append(pg)
        if not pg.wait(self.cfg.placement_timeout_s):
            raise WorkerError(self._placement_message(name, size, bundle))
        self.pool_args[name] = (pg, bundle, roles_per_rank, profiler_cfg, runtime_env)
        hosts = [self._host(name, i) for i in range(size)]
        self.hosts += hosts
        return hosts

    def _host(self, pool: str, rank: int):
        """Start rank `rank`'s Host of `pool` in its bundle of the pool's placement group."""
        pg, bundle, roles_per_rank, profiler_cfg, runtime_env = self.pool_args[pool]
        custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        return Host.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), resources=custom, runtime_env=runtime_env,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
                            ).remote(rank, len(roles_per_rank), os.getcwd(), max(1, int(bundle["CPU"])), profiler_cfg,
                                     roles_per_rank[rank])

    def respawn(self, group: "RayWorkerGroup") -> None:
        """Fresh worker processes for a role on a pool of its own (the separated rollout, the reward model or judge
        with reward.reward_model.enable_resource_pool, the teachers with distillation.nnodes > 0) one of whose
        processes died: every rank's, in the same bundles, joined into a new torch.distributed world where the
        pool is data-parallel, the role object built again from the same arguments; the weight channel reopens at
        the next sync."""
        self.check_up()  # not after another call's failure shut the backend down: that failure is the error
        pool = pool_of(group.role, self.own_pools)
        old = group.hosts
        for host in old:
            try:
                ray.kill(host, no_restart=True)
            except RayError:
                pass
        new = [self._host(pool, rank) for rank in range(len(old))]
        self.hosts = [new[old.index(h)] if h in old else h for h in self.hosts]
        self.pools[pool] = new
        for host in old:
            self.locations.pop(host, None)
        self.locations.update(zip(new, self.gather([h.where.remote() for h in new], f"{group.role} worker", "respawn")))
        if self.channel is not None and any(h in self.channel for h in old):
            self.channel = None
        if pool in DATA_PARALLEL_POOLS:
            self._join_group(new)
        group.pids = self.gather([h.construct.remote(group.role, group.cls, group.payload) for h in new],
                                 f"{group.role} worker", f"{group.cls.__name__}()")
        group.hosts, group.gone = new, False

    def _placement_message(self, name: str, size: int, bundle: dict) -> str:
        total, free = ray.cluster_resources(), ray.available_resources()
        short = [f"{k}: needs {size * v:g}, {free.get(k, 0):g} free of {total.get(k, 0):g}"
                 for k, v in bundle.items() if size * v > free.get(k, 0)]
        return (f"Ray could not place the {name} pool within {self.cfg.placement_timeout_s:g} s: {size} worker "
                f"process(es) of {bundle} each; {'; '.join(short) or 'resources are fragmented across nodes'}. "
                "Wait for the cluster's other jobs, raise trainer.ray.placement_timeout_s, or shrink the pool.")

    # -- the backend interface ------------------------------------------------------------------

    def spawn(self, role: str, cls: type, *args, **kwargs) -> "RayWorkerGroup":
        self.check_up()
        hosts = self.pools[pool_of(role, self.own_pools)]
        payload = ray.put((args, kwargs))
        pids = self.gather([h.construct.remote(role, cls, payload) for h in hosts], f"{role} worker", f"{cls.__name__}()")
        print(f"plait: {self.placement_line(role, hosts)}", file=sys.stderr)
        # the separated rollout's pool, the reward pool and the teacher pool hold this role alone: a death there is
        # the role's only (the rest of the run is whole)
        own_pool = hosts[0] is not self.pools["train"][0] and pool_of(role, self.own_pools) in ("rollout", "reward", "teacher")
        return RayWorkerGroup(self, role, hosts, pids, cls, payload, own_pool)

    def placement_line(self, role: str, hosts: list) -> str:
        """Where a role runs, one line: per node, its ranks and devices."""
        by_node: dict[str, list[int]] = {}
        for rank, h in enumerate(hosts):
            by_node.setdefault(self.locations[h][1] + " (node " + self.locations[h][0][:8] + ")", []).append(rank)
        parts = []
        for node, ranks in by_node.items():
            gpus = [g for r in ranks for g in self.locations[hosts[r]][2]]
            cpus = sum(self.locations[hosts[r]][3] for r in ranks)
            devices = f"GPUs {','.join(map(str, gpus))}" if gpus else f"{len(ranks)} CPU process(es), {cpus:g} CPUs"
            parts.append(f"{node}: rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}, {devices}")
        return f"{role} runs on {'; '.join(parts)}"

    def open_channel(self, sender, receiver) -> None:
        """The weight channel between `sender` and `receiver` hosts, once."""
        if self.channel is not None:
            return
        one_node = self.locations[sender][0] == self.locations[receiver][0]
        [(host, port)] = self.gather([sender.open_store.remote(one_node, 2)], "worker process", "weight channel")
        self.gather([sender.join_channel.remote(host, port, 0), receiver.join_channel.remote(host, port, 1)],
                    "worker process", "weight channel")
        self.channel = (sender, receiver)

    def profile_targets(self) -> list["RayProfileTarget"]:
        return [RayProfileTarget(self)]

    @property
    def world_size(self) -> int:
        """The training ranks (the actor's data-parallel processes): perf/throughput is per device."""
        return len(self.pools["train"])

    def shutdown(self) -> None:
        """Stop every worker process and, if plait started the Ray instance, Ray itself. Idempotent."""
        atexit.unregister(self.shutdown)
        if ray.is_initialized():
            for h in self.hosts:
                ray.kill(h, no_restart=True)
            for pg in self.pgs:
                remove_placement_group(pg)
        self.hosts, self.pgs = [], []
        if self.link_dir is not None:
            stop_local_ray(self.link_dir)
            self.link_dir = None
        elif self.connected:  # joined a cluster: disconnect, the cluster stays up
            ray.shutdown()
        self.connected = False

    # -- calls and failures ---------------------------------------------------------------------

    def check_up(self) -> None:
        """Refuse calls once down: a Ray API call after ray.shutdown() would start a fresh default Ray."""
        if self.failed is not None:
            raise WorkerError(f"the Ray backend was shut down after an earlier failure: {self.failed}")
        if not self.hosts:
            raise WorkerError("the Ray backend has been shut down")

    def gather(self, refs: list, who: str, what: str, group: Optional["RayWorkerGroup"] = None) -> list:
        """Results in rank order; the first failure (by time, not rank) fails the backend at once, except a
        rollout engine's death (EngineDied: its engine process, or the `group`'s own worker process when it
        is the separated rollout's), which the trainer repairs (trainers/rollout_client.py)."""
        rank_of = {ref: i for i, ref in enumerate(refs)}
        out: list = [None] * len(refs)
        pending = list(refs)
        while pending:
            [ready], pending = ray.wait(pending, num_returns=1)
            try:
                value = ray.get(ready)
            except RayTaskError as err:
                if isinstance(err.cause, EngineDied):
                    raise EngineDied(str(err.cause)) from None
                dead = self._dead_peer(pending, rank_of)
                if dead is not None and group is not None and group.own_pool:  # a peer's death failed its collective
                    raise self._gone(group, who, *dead, what) from None
                rank, err = dead or (rank_of[ready], err)
                raise self._fail(who, rank, what, err) from None
            except RayActorError as err:
                if self.failed is not None:  # killed by the shutdown after another call's failure: that one
                    raise self.failed from None
                if group is not None and group.own_pool:  # its process alone: the rest of the run is whole
                    raise self._gone(group, who, rank_of[ready], err, what) from None
                raise self._fail(who, rank_of[ready], what, err) from None
            except RayError as err:
                raise self._fail(who, rank_of[ready], what, err) from None
            if isinstance(value, Reply):
                TIMELINE.add_remote(value.pid, value.spans)
                value = value.out
            out[rank_of[ready]] = value
        return out

    def _gone(self, group: "RayWorkerGroup", who: str, rank: int, err: RayActorError, what: str) -> EngineDied:
        """A process died on a pool that holds `group`'s role alone: the role is repaired (`recover`), the run goes on."""
        group.gone = True
        self._log(who, rank, what, err)
        return EngineDied(f"its Ray worker process died during {what}; details in {self.error_log}")

    def _dead_peer(self, pending: list, rank_of: dict) -> Optional[tuple[int, RayActorError]]:
        """A rank that died, among the calls still pending, within a short grace. When one rank is killed
        mid-collective its peers' calls fail too ('Connection reset by peer'), sometimes before Ray has
        reported the death: the dead rank is the cause and is what the error names."""
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_DEATH_GRACE_S) if pending else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as err:
                return rank_of[ref], err
            except RayError:
                pass
        return None

    def _fail(self, who: str, rank: int, what: str, err: RayError) -> WorkerError:
        with self.fail_lock:  # two driver threads (async modes) may see the failure; the first account wins
            if self.failed is None:
                self.failed = self._shut_down_after(who, rank, what, err)
            return self.failed

    def _shut_down_after(self, who: str, rank: int, what: str, err: RayError) -> WorkerError:
        if isinstance(err, RayTaskError):  # details: the remote traceback
            first = (str(err.cause).strip().splitlines() or [""])[0][:200]
            summary = f"raised {type(err.cause).__name__}: {first}"
        elif isinstance(err, RayActorError):  # details: Ray's account of the death (killed, OOM, ...)
            summary = "died"
        else:
            summary = f"failed ({type(err).__name__})"
        # Survivors close their windows (and hand over torch_memory's OOM dumps); a dead one's, or
        # one stuck past 5 s, is lost.
        if self.profile_open or self.profiler_tool == "torch_memory":
            refs = [h.stop_profile.remote(False) for h in self.hosts]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=5.0)
            for ref in ready:
                try:
                    self.salvaged += ray.get(ref)
                except RayError:
                    pass
        started = self.link_dir is not None
        self.shutdown()
        self._log(who, rank, what, err)
        error = WorkerError(
            f"{who} rank {rank} {summary} during {what}; every Ray worker was stopped"
            f"{' and the Ray instance plait started was shut down' if started else ''}; "
            f"details in {self.error_log}")
        error.cause = err.cause if isinstance(err, RayTaskError) else None  # what the worker raised
        error.log = self.error_log
        error.recoverable = isinstance(err, RayActorError)  # a process died (OOM, a node lost): max_restarts
        return error

    def _log(self, who: str, rank: int, what: str, err: RayError) -> None:
        """The remote traceback, or Ray's account of a death, into worker_errors.log."""
        os.makedirs(os.path.dirname(self.error_log) or ".", exist_ok=True)
        with open(self.error_log, "a") as f:
            f.write(f"== {time.strftime('%Y-%m-%d %H:%M:%S')} {who} rank {rank} during {what}\n{err}\n")


def pool_of(role: str, own: set[str]) -> str:
    """The pool a role's workers live on: a role in `own` on its own (the reward model with
    reward.reward_model.enable_resource_pool, the teachers with distillation.nnodes > 0), the other data-parallel
    roles on train, the rest on rollout."""
    if role in own:
        return OWN_POOLS[role]
    return "train" if role in DATA_PARALLEL_ROLES else "rollout"


def pool_keys(pool: str, resource: str, cfg: PlaitConfig, gpu: bool) -> tuple[str, str]:
    """(keys, values) that sized `pool`'s ask for `resource`, for a one-line refusal."""
    t, r, rm = cfg.trainer, cfg.actor_rollout_ref.rollout, cfg.reward.reward_model
    if resource not in ("CPU", "GPU"):
        return f"trainer.ray.pool_resources.{pool}", str(cfg.trainer.ray.pool_resources[pool])
    cpus = f"trainer.ray.cpus_per_worker={t.ray.cpus_per_worker:g}"
    sizes = {"train": ("trainer.nnodes x trainer.n_gpus_per_node", f"{t.nnodes} x {t.n_gpus_per_node}")
                      if gpu else ("trainer.ray.num_cpu_workers", f"{t.ray.num_cpu_workers}"),
             "rollout": ("actor_rollout_ref.rollout.n_gpus_per_node", f"{r.n_gpus_per_node if r.nnodes else 1}"),
             "reward": ("reward.reward_model.nnodes x reward.reward_model.n_gpus_per_node",
                        f"{rm.nnodes} x {rm.n_gpus_per_node}"),
             "teacher": ("distillation.nnodes x distillation.n_gpus_per_node",
                         f"{cfg.distillation.nnodes} x {cfg.distillation.n_gpus_per_node}")}
    key, value = sizes[pool]
    return (key, value) if resource == "GPU" else (f"{key} (with {cpus})", value)


class RayWorkerGroup:
    """One role's workers: `call` runs a method on every rank, `call_dp` gives each rank a shard. `cls` and
    `payload` built the role objects; `own_pool`: the role has its pool to itself (the separated rollout, the
    reward model or judge on the reward pool), so the death of its process (`gone`) is repaired by `recover`
    instead of stopping the run."""

    def __init__(self, backend: RayBackend, role: str, hosts: list, pids: list[int], cls: type = object,
                 payload: Any = None, own_pool: bool = False):
        self.backend, self.role, self.hosts, self.pids = backend, role, hosts, pids
        self.cls, self.payload, self.own_pool, self.gone = cls, payload, own_pool, False
        self.world_size = len(hosts)

    def recover(self, method: Optional[Callable] = None) -> None:
        """Repair the role after an EngineDied: new worker processes when its process died, else `method`
        on the living workers (Rollout.restart_engine; None: nothing to repair there)."""
        if self.gone:
            self.backend.respawn(self)
        elif method is not None:
            self.call(method)

    def call(self, method: Callable, *args, **kwargs) -> Any:
        """Run `method` on every rank with the same arguments (stored once); return rank 0's result."""
        self.backend.check_up()
        payload = ray.put((args, kwargs))
        if getattr(method, "out_of_band", False):  # the marker is optional on worker methods
            refs = [h.run_out_of_band.remote(self.role, method, payload) for h in self.hosts]
        else:
            refs = [h.run.remote(self.role, method, payload, rank == 0) for rank, h in enumerate(self.hosts)]
        return self.backend.gather(refs, f"{self.role} worker", method.__qualname__, self)[0]

    def call_dp(self, method: Callable, batch, *args, **kwargs) -> list[Any]:
        """Split `batch` (a RolloutBatch) across the ranks; one result per rank, in rank order."""
        self.backend.check_up()
        refs = [h.run.remote(self.role, method, ray.put(((shard, *args), kwargs)), True)
                for h, shard in zip(self.hosts, batch.split(self.world_size))]
        return self.backend.gather(refs, f"{self.role} worker", method.__qualname__)

    def pipe(self, get: Callable, dst: "RayWorkerGroup", put: Callable, *args, **kwargs) -> None:
        """`put(dst's worker, get(rank 0's worker), *args)` with every rank running `get`, and the
        result never on the driver: in-process where dst lives on rank 0's host (colocated), else
        over the weight channel (`trainer.ray.weight_sync=process_group`); `object_store` sends it
        through the driver as `call` would."""
        b = self.backend
        b.check_up()
        what = f"{get.__qualname__} -> {put.__qualname__}"
        if b.cfg.weight_sync == "object_store" or len(dst.hosts) != 1:
            dst.call(put, self.call(get), *args, **kwargs)
            return
        payload = ray.put((args, kwargs))
        if dst.hosts[0] is self.hosts[0]:
            refs = [h.pipe.remote(self.role, get, dst.role if r == 0 else None, put, payload)
                    for r, h in enumerate(self.hosts)]
        else:
            b.open_channel(self.hosts[0], dst.hosts[0])
            refs = [h.send.remote(self.role, get, r == 0) for r, h in enumerate(self.hosts)]
            try:
                b.gather([dst.hosts[0].receive.remote(dst.role, put, payload)], f"{dst.role} worker", what, dst)
            except EngineDied:  # the receiver's process died: the sender's broadcast fails with it, not on its own
                ray.wait(refs, num_returns=len(refs), timeout=CHANNEL_DEATH_S)
                raise
        b.gather(refs, f"{self.role} worker", what)


class RayProfileTarget:
    """The driver's ProfileTarget for every host: windows open and close on all of them together."""

    def __init__(self, backend: RayBackend):
        self.backend = backend

    def start_profile(self, first_step: int, last_step: int, version: int) -> None:
        b = self.backend
        b.check_up()
        b.gather([h.start_profile.remote(first_step, last_step, version) for h in b.hosts], "worker process", "start_profile")
        b.profile_open = True

    def stop_profile(self, complete: bool) -> list[dict]:
        b = self.backend
        b.profile_open = False
        if b.failed is not None:  # the workers are gone; hand over what was rescued when they failed
            records, b.salvaged = b.salvaged, []
            return records
        b.check_up()
        per_host = b.gather([h.stop_profile.remote(complete) for h in b.hosts], "worker process", "stop_profile")
        return [r for records in per_host for r in records]

    def __repr__(self) -> str:
        return f"RayProfileTarget({len(self.backend.hosts)} worker processes)"
