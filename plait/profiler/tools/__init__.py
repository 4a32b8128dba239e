"""Profiler tools and the check that a tool can run on this machine.

A tool is a small stateful object driven by a ProfilerSession:

    open(window)                     window start: begin collecting
    stage(role, stage, own_file)     a context manager around one stage, only inside a window
    close()                          window end: stop collecting, write artifacts via window.save

`own_file` is False for a stage of a hosted role that is not profiled on this rank: it still
gets a range in the shared collection but never a discrete file of its own.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from typing import Mapping, Optional

# Not `import torch`: importing the submodule tools/torch.py rebinds `torch` in this namespace.
from torch.cuda import is_available as cuda_available

from plait.configtree import check
from plait.profiler.config import ROLE_KEYS, SCHEDULED_ROLES, GlobalProfilerConfig, RoleProfilerConfig, no_effect_notes

log = logging.getLogger("plait.profiler")


def validate_environment(cfg: GlobalProfilerConfig,
                         roles: Optional[Mapping[str, RoleProfilerConfig]] = None) -> None:
    """Raise ConfigError if `cfg.tool` (or a role's torch contents) cannot run on this machine.

    Call before any training work, with the role nodes when the caller has them. Also warns in
    one line when no role is enabled, and says what torch_memory writes without CUDA.
    """
    check_environment(cfg, roles or {})
    if cfg.tool and cfg.steps and roles is not None and not any(rc.enable for rc in roles.values()):
        log.warning("profiler: global_profiler.tool is %s but no role has profiler.enable: true; "
                    "nothing will be profiled", cfg.tool)
    if cfg.tool and not cfg.steps:
        log.warning("profiler: global_profiler.tool is %s but global_profiler.steps is %s; nothing will be "
                    "profiled (list the 1-based steps to profile)", cfg.tool, cfg.steps)
    enabled = [ROLE_KEYS.get(role, role) for role, rc in (roles or {}).items() if rc.enable]
    if cfg.tool is None and enabled:
        log.warning("profiler: %s.profiler.enable is true but global_profiler.tool is null; nothing will be "
                    "profiled (set global_profiler.tool)", " and ".join(enabled))
    if cfg.tool == "torch_memory" and not cuda_available():
        log.warning("profiler: torch_memory without CUDA writes a torch.profiler trace with CPU "
                    "memory events per window; trace_alloc_max_entries, stack_depth, context, stacks and "
                    "kw_args apply to CUDA snapshots only (docs/profiling.md)")
    for note in no_effect_notes(cfg, dict(roles or {})):
        log.warning("profiler: %s", note)


def check_environment(cfg: GlobalProfilerConfig, roles: Mapping[str, RoleProfilerConfig]) -> None:
    if cfg.tool is None:
        return
    cuda = cuda_available()
    if cfg.tool == "nsys":
        check(cuda, "global_profiler.tool", cfg.tool,
              "nsys needs CUDA, and torch.cuda.is_available() is False on this machine; "
              "use torch or torch_memory here")
        check(importlib.util.find_spec("nvtx") is not None, "global_profiler.tool", cfg.tool,
              "nsys needs the nvtx package for its stage ranges: pip install nvtx")
    if cfg.tool == "memray":
        check(sys.platform in ("linux", "darwin"), "global_profiler.tool", cfg.tool,
              f"memray runs on Linux and macOS only, not {sys.platform}; use torch_memory here")
        check(importlib.util.find_spec("memray") is not None, "global_profiler.tool", cfg.tool,
              "memray needs the memray package: pip install 'plait[memray]'")
    if cfg.tool == "torch":
        for role, rc in roles.items():
            check(cuda or not rc.enable or "cuda" not in rc.tool_config.torch.contents,
                  f"{ROLE_KEYS.get(role, role)}.profiler.tool_config.torch.contents",
                  rc.tool_config.torch.contents,
                  "lists cuda, but torch.cuda.is_available() is False on this machine")
    if cfg.save_path is None:  # resolved by PlaitConfig; a bare GlobalProfilerConfig writes nowhere yet
        return
    check(not os.path.isfile(cfg.save_path), "global_profiler.save_path", cfg.save_path,
          "is an existing file; expected a folder")
    check(_writable(cfg.save_path), "global_profiler.save_path", cfg.save_path,
          "cannot be written by this process (its nearest existing folder is not writable)")


def _writable(path: str) -> bool:
    """Whether `path` exists as a writable folder or could be created under its nearest existing ancestor."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def make_tool(cfg: GlobalProfilerConfig, roles: Mapping[str, RoleProfilerConfig]):
    """The tool for the roles profiled in one process; they share one collection."""
    check_environment(cfg, roles)
    if cfg.tool == "torch":
        contents = set().union(*(rc.tool_config.torch.contents for rc in roles.values()))
        discrete = {rc.tool_config.torch.discrete for rc in roles.values()}
        check(len(discrete) == 1, " / ".join(f"{ROLE_KEYS.get(r, r)}.profiler.tool_config.torch.discrete" for r in roles),
              {role: rc.tool_config.torch.discrete for role, rc in roles.items()},
              "roles profiled in one process share one collection; give them the same value")
        # "cpu" without "cuda" keeps CUDA kernels out; CPU is always on for the stage ranges.
        cuda = cuda_available() and not ("cpu" in contents and "cuda" not in contents)
        # The roles whose update loops step the one collection must agree on its schedule.
        schedules = {r: rc.tool_config.torch.schedule.torch_kwargs() for r, rc in roles.items() if r in SCHEDULED_ROLES}
        kinds = {str(s) for s in schedules.values() if s is not None}
        check(len(kinds) <= 1, " / ".join(f"{ROLE_KEYS.get(r, r)}.profiler.tool_config.torch.schedule" for r in schedules),
              schedules, "roles profiled in one process share one collection; give them the same schedule")
        schedule = next((s for s in schedules.values() if s is not None), None)
        from plait.profiler.tools.torch import TorchTool
        return TorchTool(contents, discrete.pop(), cuda, schedule)
    if cfg.tool == "torch_memory":
        from plait.profiler.tools.torch_memory import torch_memory_tool
        return torch_memory_tool(cfg.global_tool_config.torch_memory)
    if cfg.tool == "memray":
        from plait.profiler.tools.memray import MemrayTool
        return MemrayTool()
    from plait.profiler.tools.nsys import NsysTool
    return NsysTool()
