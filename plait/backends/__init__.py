"""Backends run the worker groups: `local` in the driver process (default), `ray` as Ray actors.

`make_backend` picks one from `trainer.backend`. `RayConfig` (`trainer.ray.*`) lives here rather
than beside plait/backends/ray.py because that module imports `ray`, and the config tree must
load without it: only plait/backends/ray.py imports ray, and only when the Ray backend is chosen.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from plait.configtree import check

if TYPE_CHECKING:  # plait.config imports this module for RayConfig
    from plait.config import PlaitConfig

# Environment for a Ray instance plait starts itself. Ray reads these when imported or started:
# no usage statistics, no auth token written to ~/.ray, and Ray's single-machine mode, in which
# every Ray process listens on 127.0.0.1 instead of all interfaces.
LEAN_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


@dataclass
class RayConfig:
    """`trainer.ray`: which Ray to use and what each worker process asks it for."""

    address: Optional[str] = None                 # a running cluster ("auto", "10.0.0.1:6379"); null: RAY_ADDRESS, else plait starts one
    num_cpus: Optional[int] = None                # logical CPUs of a plait-started instance; null: the machine's count
    object_store_memory_mb: Optional[int] = None  # object store of a plait-started instance; null: Ray's default (30% of RAM)
    num_cpu_workers: int = 1                      # data-parallel trainer processes without GPUs (with GPUs: nnodes x n_gpus_per_node)
    cpus_per_worker: float = 1.0                  # CPU request per worker process; fractions let a small machine host more processes
    placement_timeout_s: float = 60.0             # fail, naming the missing resources, if workers cannot be placed in this time

    def __post_init__(self):
        check(self.address is None or self.address.strip() != "", "address", self.address, "null or a Ray address")
        check(self.num_cpus is None or self.num_cpus > 0, "num_cpus", self.num_cpus, "null or > 0")
        check(self.object_store_memory_mb is None or self.object_store_memory_mb >= 80, "object_store_memory_mb",
              self.object_store_memory_mb, "null or >= 80 (Ray's minimum object store)")
        check(self.num_cpu_workers > 0, "num_cpu_workers", self.num_cpu_workers, "must be > 0")
        check(self.cpus_per_worker > 0, "cpus_per_worker", self.cpus_per_worker, "must be > 0 (fractions are fine)")
        check(self.placement_timeout_s > 0, "placement_timeout_s", self.placement_timeout_s, "must be > 0 seconds")


def make_backend(cfg: PlaitConfig, roles_cfg: dict, device: str):
    """The backend `cfg.trainer.backend` names, ready to spawn roles."""
    from plait.profiler import ProfilerSession
    if cfg.trainer.backend == "local":
        from plait.backends.local import LocalBackend
        return LocalBackend(ProfilerSession(cfg.global_profiler, roles_cfg, rank=0))
    address = cfg.trainer.ray.address or os.environ.get("RAY_ADDRESS")
    if address is None:
        for key, value in LEAN_RAY_ENV.items():  # before `import ray`: Ray fixes its node address on import
            os.environ.setdefault(key, value)
    from plait.backends.ray import RayBackend
    return RayBackend(cfg, roles_cfg, device, address)
