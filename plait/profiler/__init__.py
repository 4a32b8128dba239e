"""The unified profiler: one schedule, one session per process, torch / torch_memory / nsys / memray tools.

    driver:  StepProfiler (owned by the step lifecycle) ──▶ ProfileTarget per worker process
    worker:  ProfilerSession ──for_role(role)──▶ RoleProfiler.annotate(stage)

Config nodes are in `config`, the pure window plan in `schedule`, file names and the manifest in
`naming`, the finish hook in `hook`, the tools in `tools/`; always on: the stage timeline and each Ray
rank's own spans in `timeline`, per-sample spans in `samples`; the live report in `live`; reading it all
back in `analysis/`. docs/profiling.md is the user guide.
"""

import importlib

from plait.profiler.config import (GlobalProfilerConfig, GlobalToolConfig, RoleProfilerConfig,
                                   RoleToolConfig, TorchMemoryToolConfig, TorchToolConfig)
from plait.profiler.driver import ProfileTarget, StepProfiler
from plait.profiler.naming import append_manifest, artifact_path, read_manifest
from plait.profiler.schedule import ProfilePlan, Window, plan

# The parts that need torch load on first use, so plait.config (which reads the config nodes above)
# reports a config error before torch is imported.
_LAZY = {"NULL_RANGE": "session", "ProfilerSession": "session", "RoleProfiler": "session",
         "validate_environment": "tools"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'plait.profiler' has no attribute {name!r}")
    return getattr(importlib.import_module(f"plait.profiler.{_LAZY[name]}"), name)


__all__ = [
    "GlobalProfilerConfig", "GlobalToolConfig", "RoleProfilerConfig", "RoleToolConfig",
    "TorchMemoryToolConfig", "TorchToolConfig", "ProfileTarget", "StepProfiler", "append_manifest",
    "artifact_path", "read_manifest", "ProfilePlan", "Window", "plan", "NULL_RANGE",
    "ProfilerSession", "RoleProfiler", "validate_environment",
]
