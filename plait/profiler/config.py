"""Profiler configuration, with verl's key names so a verl user's settings carry over.

`global_profiler` (GlobalProfilerConfig) picks the tool, the steps and where artifacts go; each
role's `profiler` node (RoleProfilerConfig) says whether that role is profiled and on which ranks.
Values are checked here; whether a tool can run on this machine is checked by
`plait.profiler.validate_environment`, which needs torch and so lives with the tools.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from plait.configtree import check

TOOLS = ("torch", "torch_memory", "nsys")
TORCH_CONTENTS = ("memory", "shapes", "stack", "cpu", "cuda")
ROLE_ORDER = ("actor", "rollout", "ref", "critic", "reward_model")  # the order of roles in a shared artifact's name
ROLE_KEYS = {"actor": "actor_rollout_ref.actor", "rollout": "actor_rollout_ref.rollout",
             "ref": "actor_rollout_ref.ref", "critic": "critic", "reward_model": "reward_model"}


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass
class TorchMemoryToolConfig:
    trace_alloc_max_entries: int = 100_000  # allocator events kept per window (CUDA history ring)
    stack_depth: int = 32                   # innermost Python frames kept per event in the snapshot

    def __post_init__(self):
        check(_positive_int(self.trace_alloc_max_entries), "trace_alloc_max_entries",
              self.trace_alloc_max_entries, "expected a positive integer")
        check(_positive_int(self.stack_depth), "stack_depth", self.stack_depth,
              "expected a positive integer")


@dataclass
class GlobalToolConfig:
    torch_memory: TorchMemoryToolConfig = field(default_factory=TorchMemoryToolConfig)


@dataclass
class GlobalProfilerConfig:
    """The `global_profiler` node."""

    tool: Optional[str] = None              # None (off) | torch | torch_memory | nsys
    steps: Optional[list[int]] = None       # 1-based steps to profile; None or [] profiles none
    profile_continuous_steps: bool = False  # consecutive listed steps share one window
    save_path: Optional[str] = None         # null: <run output dir>/profile, so each run keeps its own
    finish_hook_cmd: Optional[str] = None   # shell command run once after the last window
    global_tool_config: GlobalToolConfig = field(default_factory=GlobalToolConfig)

    def __post_init__(self):
        check(self.tool is None or self.tool in TOOLS, "tool", self.tool,
              "expected null or one of " + ", ".join(TOOLS))
        check(self.steps is None or isinstance(self.steps, list), "steps", self.steps,
              "expected null or a list of 1-based step numbers")
        for i, step in enumerate(self.steps or []):
            check(_positive_int(step), f"steps[{i}]", step, "expected an integer step >= 1 (steps are 1-based)")
        check(self.save_path is None or (isinstance(self.save_path, str) and self.save_path != ""), "save_path",
              self.save_path, "expected null (the run's output dir/profile) or a non-empty path")
        check(self.finish_hook_cmd is None or (isinstance(self.finish_hook_cmd, str)
                                               and self.finish_hook_cmd.strip() != ""),
              "finish_hook_cmd", self.finish_hook_cmd, "expected null or a non-empty shell command")


@dataclass
class TorchToolConfig:
    contents: list[str] = field(default_factory=list)  # memory, shapes, stack; cpu/cuda pick activities
    discrete: bool = False                             # one trace per stage instead of per window

    def __post_init__(self):
        for i, item in enumerate(self.contents):
            check(item in TORCH_CONTENTS, f"contents[{i}]", item,
                  "expected one of " + ", ".join(TORCH_CONTENTS))


@dataclass
class RoleToolConfig:
    torch: TorchToolConfig = field(default_factory=TorchToolConfig)


@dataclass
class RoleProfilerConfig:
    """A role's `profiler` node: `actor_rollout_ref.{actor,rollout,ref}.profiler`, `critic.profiler`."""

    enable: bool = False
    all_ranks: bool = False
    ranks: list[int] = field(default_factory=list)  # empty: rank 0 only
    tool_config: RoleToolConfig = field(default_factory=RoleToolConfig)

    def __post_init__(self):
        for i, rank in enumerate(self.ranks):
            check(isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0, f"ranks[{i}]",
                  rank, "expected a rank >= 0")
        # Both set would leave `ranks` doing nothing.
        check(not (self.all_ranks and self.ranks), "ranks", self.ranks,
              "must be empty when all_ranks is true")

    def selects(self, rank: int) -> bool:
        """Whether this role is profiled on `rank` (default: rank 0 only)."""
        if not self.enable:
            return False
        if self.all_ranks:
            return True
        return rank in self.ranks if self.ranks else rank == 0
