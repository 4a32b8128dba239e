"""The unified profiler: one schedule, one session per process, torch / torch_memory / nsys tools.

    driver:  StepProfiler (owned by the step lifecycle) ──▶ ProfileTarget per worker process
    worker:  ProfilerSession ──for_role(role)──▶ RoleProfiler.annotate(stage)

Config nodes are in `config`, the pure window plan in `schedule`, file names and the manifest in
`naming`, the finish hook in `hook`, the tools in `tools/`. docs/profiling.md is the user guide.
"""

from plait.profiler.config import (GlobalProfilerConfig, GlobalToolConfig, RoleProfilerConfig,
                                   RoleToolConfig, TorchMemoryToolConfig, TorchToolConfig)
from plait.profiler.driver import ProfileTarget, StepProfiler
from plait.profiler.naming import append_manifest, artifact_path, read_manifest
from plait.profiler.schedule import ProfilePlan, Window, plan
from plait.profiler.session import NULL_RANGE, ProfilerSession, RoleProfiler
from plait.profiler.tools import validate_environment

__all__ = [
    "GlobalProfilerConfig", "GlobalToolConfig", "RoleProfilerConfig", "RoleToolConfig",
    "TorchMemoryToolConfig", "TorchToolConfig", "ProfileTarget", "StepProfiler", "append_manifest",
    "artifact_path", "read_manifest", "ProfilePlan", "Window", "plan", "NULL_RANGE",
    "ProfilerSession", "RoleProfiler", "validate_environment",
]
