"""Backends run the worker groups: `local` in the driver process (default), `ray` as Ray actors.

`make_backend` picks one from `trainer.backend`. Only plait/backends/ray.py imports ray, and only
when the Ray backend is chosen; its config node (`trainer.ray.*`, `RayConfig`) is in plait/config.py.
"""

from __future__ import annotations

import os

from plait.config import PlaitConfig

# Environment for a Ray instance plait starts itself. Ray reads these when imported or started:
# no usage statistics, no auth token written to ~/.ray, and Ray's single-machine mode, in which
# every Ray process listens on 127.0.0.1 instead of all interfaces.
LEAN_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


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
