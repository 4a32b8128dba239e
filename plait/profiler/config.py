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

TOOLS = ("torch", "torch_memory", "nsys", "memray")
MEMORY_CONTEXTS = ("alloc", "state", "all")   # torch.cuda.memory._record_memory_history(context=...)
MEMORY_STACKS = ("python", "all")             # ... stacks=: Python frames, or Python and C++
TORCH_CONTENTS = ("memory", "shapes", "stack", "cpu", "cuda")
ROLE_ORDER = ("actor", "rollout", "ref", "critic", "reward_model", "teacher")  # the order of roles in a shared artifact's name
ROLE_KEYS = {"actor": "actor_rollout_ref.actor", "rollout": "actor_rollout_ref.rollout",
             "ref": "actor_rollout_ref.ref", "critic": "critic", "reward_model": "reward.reward_model",
             "teacher": "distillation"}


def snapshot_steps(cfg: "GlobalProfilerConfig") -> int:
    """Profiled windows per artifact: the memory tools' memory_snapshot_num_steps, else 1."""
    tools = cfg.global_tool_config
    return {"torch_memory": tools.torch_memory.memory_snapshot_num_steps,
            "memray": tools.memray.memory_snapshot_num_steps}.get(cfg.tool, 1)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass
class TorchMemoryToolConfig:
    """`global_profiler.global_tool_config.torch_memory`: verl 0.9's keys and meanings."""

    trace_alloc_max_entries: int = 100_000  # allocator events kept per window (CUDA history ring)
    stack_depth: int = 32                   # innermost Python frames kept per event in the snapshot
    memory_snapshot_num_steps: int = 1      # profiled steps per snapshot: every N windows become one
    context: Optional[str] = "all"          # CUDA events recorded: alloc (with stacks) | state | all | null
    stacks: str = "all"                     # frames recorded: python | all (Python and C++)
    kw_args: dict = field(default_factory=dict)  # more keywords for _record_memory_history, e.g. clear_history

    def __post_init__(self):
        check(_positive_int(self.trace_alloc_max_entries), "trace_alloc_max_entries",
              self.trace_alloc_max_entries, "expected a positive integer")
        check(_positive_int(self.stack_depth), "stack_depth", self.stack_depth,
              "expected a positive integer")
        check(_positive_int(self.memory_snapshot_num_steps), "memory_snapshot_num_steps",
              self.memory_snapshot_num_steps, "expected a positive integer (profiled steps per snapshot)")
        check(self.context is None or self.context in MEMORY_CONTEXTS, "context", self.context,
              "expected null or one of " + ", ".join(MEMORY_CONTEXTS))
        check(self.stacks in MEMORY_STACKS, "stacks", self.stacks, "expected one of " + ", ".join(MEMORY_STACKS))
        check(isinstance(self.kw_args, dict) and set(self.kw_args) <= set(MEMORY_KW_ARGS), "kw_args", self.kw_args,
              "expected a mapping with keys among " + ", ".join(MEMORY_KW_ARGS) + " (plait sets the others itself)")


# _record_memory_history keywords kw_args may set: the rest are the keys above, or the window's own
MEMORY_KW_ARGS = ("clear_history", "device", "record_context", "global_record_annotations")


@dataclass
class MemrayToolConfig:
    """`global_profiler.global_tool_config.memray` (verl's memray tool, verl#7961): host memory by call stack."""

    memory_snapshot_num_steps: int = 1      # profiled steps per capture: every N windows become one

    def __post_init__(self):
        check(_positive_int(self.memory_snapshot_num_steps), "memory_snapshot_num_steps",
              self.memory_snapshot_num_steps, "expected a positive integer (profiled steps per capture)")


@dataclass
class GpuStallDiagnosticsConfig:
    """`global_profiler.gpu_stall_diagnostics` (verl#7073): accepted with verl's checks, no effect here."""

    enable: bool = False
    sample_interval_s: float = 0.25          # NVML utilisation samples, 0.2-0.5 s apart (verl's range)
    zero_utilization_threshold: float = 1.0  # a sample at or below this percent counts as idle

    def __post_init__(self):
        check(0.2 <= self.sample_interval_s <= 0.5, "sample_interval_s", self.sample_interval_s,
              "expected seconds in [0.2, 0.5] (verl's range)")
        check(0 <= self.zero_utilization_threshold <= 100, "zero_utilization_threshold",
              self.zero_utilization_threshold, "expected a percent in [0, 100]")


GPU_STALL_WHY = ("verl samples every GPU's utilisation through NVML while each phase of the step runs (rollout, "
                 "actor update, weight sync) and logs gpu_stall/<phase>/... metrics, to find stretches where the GPUs "
                 "sit idle; plait reads no NVML, and without a GPU there is nothing to sample. Where the step waits "
                 "is on plait's timeline (`plait profile report`: the Gantt per step and the verdict)")


@dataclass
class PrecisionDebuggerConfig:
    """verl's msprobe precision debugger (`precision_debugger`): accepted, no effect here."""

    config_path: Optional[str] = None
    steps: Optional[list[int]] = None   # deprecated in verl too: global_profiler.steps picks the steps
    stages: Optional[list[str]] = None
    strict: bool = False


PRECISION_DEBUGGER_WHY = ("needs msprobe (Huawei MindStudio's precision tool for Ascend NPUs), which plait does not "
                          "drive; compare dtypes and values with tool=torch contents=[shapes] or your own hooks")


@dataclass
class GlobalToolConfig:
    torch_memory: TorchMemoryToolConfig = field(default_factory=TorchMemoryToolConfig)
    memray: MemrayToolConfig = field(default_factory=MemrayToolConfig)
    precision_debugger: PrecisionDebuggerConfig = field(default_factory=PrecisionDebuggerConfig)


@dataclass
class GlobalProfilerConfig:
    """The `global_profiler` node."""

    tool: Optional[str] = None              # None (off) | torch | torch_memory | nsys | memray
    steps: Optional[list[int]] = None       # 1-based steps to profile; None or [] profiles none
    profile_continuous_steps: bool = False  # consecutive listed steps share one window
    save_path: Optional[str] = None         # null: <run output dir>/profile, so each run keeps its own
    finish_hook_cmd: Optional[str] = None   # shell command run once after the last window
    # verl runs the hook on each chosen rank (its save_path is node-local); plait runs it once, in the
    # driver, after every rank's artifacts are in the manifest: these two choose nothing here (a note says so)
    finish_hook_all_ranks: bool = False
    finish_hook_ranks: list[int] = field(default_factory=list)
    # verl moves artifacts that land outside save_path (Ray's nsight dir, rollout engines' per-replica
    # dirs) into it; plait writes every artifact under save_path by one naming function
    relocate_results: bool = False
    global_tool_config: GlobalToolConfig = field(default_factory=GlobalToolConfig)
    gpu_stall_diagnostics: GpuStallDiagnosticsConfig = field(default_factory=GpuStallDiagnosticsConfig)
    # plait's own: rewrite <output dir>/report (page and verdict, no merged traces) every N steps while the
    # run trains, in a process of its own at low priority, and once more at the end; 0: off
    # (`plait profile report --watch DIR` does it from outside the run)
    report_freq: int = 0
    # plait's own: write samples.jsonl (every sample's lifecycle, some 500 bytes per sample per step); false: not
    # written (a long run's disk), and the report's per-sample section is then empty
    samples: bool = True

    def __post_init__(self):
        check(self.tool != "precision_debugger", "tool", self.tool, PRECISION_DEBUGGER_WHY)
        check(self.tool != "npu", "tool", self.tool, "Ascend NPUs are not supported: plait runs on CPU and CUDA")
        check(self.tool is None or self.tool in TOOLS, "tool", self.tool,
              "expected null or one of " + ", ".join(TOOLS))
        check(self.steps is None or isinstance(self.steps, list), "steps", self.steps,
              "expected null or a list of 1-based step numbers")
        for i, step in enumerate(self.steps or []):
            check(_positive_int(step), f"steps[{i}]", step, "expected an integer step >= 1 (steps are 1-based)")
        check(self.save_path is None or (isinstance(self.save_path, str) and self.save_path != ""), "save_path",
              self.save_path, "expected null (the run's output dir/profile) or a non-empty path")
        for i, rank in enumerate(self.finish_hook_ranks):
            check(isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0, f"finish_hook_ranks[{i}]",
                  rank, "expected a rank >= 0")
        check(isinstance(self.report_freq, int) and not isinstance(self.report_freq, bool) and self.report_freq >= 0,
              "report_freq", self.report_freq, "expected an integer >= 0 (steps between live reports; 0: off)")
        check(isinstance(self.samples, bool), "samples", self.samples, "expected true or false (write samples.jsonl)")
        check(self.finish_hook_cmd is None or (isinstance(self.finish_hook_cmd, str)
                                               and self.finish_hook_cmd.strip() != ""),
              "finish_hook_cmd", self.finish_hook_cmd, "expected null or a non-empty shell command")


@dataclass
class TorchScheduleConfig:
    """verl's torch.profiler schedule over the update loop's mini-batches; off while active is 0.

    Stepped once per update mini-batch of the role that sets it (actor, critic): skip_first, then
    cycles of wait (not recorded), warmup (recorded, dropped) and active (kept), `repeat` times
    (0: until the window ends; in a continuous window 0 means one cycle, as in verl).
    """

    skip_first: int = 0
    wait: int = 0
    warmup: int = 0
    active: int = 0
    repeat: int = 0

    def __post_init__(self):
        for name in ("skip_first", "wait", "warmup", "active", "repeat"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool) and value >= 0, name, value,
                  "expected an integer >= 0")

    def torch_kwargs(self) -> Optional[dict]:
        """torch.profiler.schedule's keywords, or None when off (active 0)."""
        if self.active == 0:
            return None
        return dict(skip_first=self.skip_first, wait=self.wait, warmup=self.warmup, active=self.active,
                    repeat=self.repeat)


@dataclass
class TorchToolConfig:
    contents: list[str] = field(default_factory=list)  # memory, shapes, stack; cpu/cuda pick activities
    discrete: bool = False                             # one trace per stage instead of per window
    schedule: TorchScheduleConfig = field(default_factory=TorchScheduleConfig)
    profile_token_start: Optional[int] = None          # rollout: first response token to record (verl: vLLM/SGLang)
    profile_token_end: Optional[int] = None            # rollout: token index where recording stops (exclusive)

    def __post_init__(self):
        for i, item in enumerate(self.contents):
            check(item in TORCH_CONTENTS, f"contents[{i}]", item,
                  "expected one of " + ", ".join(TORCH_CONTENTS))
        for name in ("profile_token_start", "profile_token_end"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0), name,
                  value, "expected null or a token index >= 0")
        start, end = self.profile_token_start, self.profile_token_end
        check(start is None or end is None or end > start, "profile_token_end", end,
              f"must be greater than profile_token_start={start}")


@dataclass
class RoleToolConfig:
    torch: TorchToolConfig = field(default_factory=TorchToolConfig)
    precision_debugger: PrecisionDebuggerConfig = field(default_factory=PrecisionDebuggerConfig)


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


SCHEDULED_ROLES = ("actor", "critic")  # the roles with an update loop: their mini-batches step a schedule
TOKEN_ROLES = ("rollout",)              # the role that decodes tokens: profile_token_start/end apply to it


def no_effect_notes(cfg: GlobalProfilerConfig, roles: dict) -> list[str]:
    """One line per verl profiler key set away from its default that does nothing in plait, with why."""
    notes = []
    if cfg.finish_hook_all_ranks or cfg.finish_hook_ranks:
        notes.append("global_profiler.finish_hook_all_ranks / finish_hook_ranks have no effect: plait runs "
                     "finish_hook_cmd once, in the driver, after every rank's artifacts are listed in the "
                     "manifest (PLAIT_PROFILE_RANK=0)")
    if cfg.relocate_results:
        notes.append("global_profiler.relocate_results has no effect: plait writes every artifact under save_path "
                     "itself (an nsys report goes where `nsys profile -o` says)")
    if cfg.gpu_stall_diagnostics != GpuStallDiagnosticsConfig():
        notes.append(f"global_profiler.gpu_stall_diagnostics has no effect: {GPU_STALL_WHY}")
    debuggers = {"global_profiler.global_tool_config": cfg.global_tool_config.precision_debugger,
                 **{f"{ROLE_KEYS.get(r, r)}.profiler.tool_config": rc.tool_config.precision_debugger
                    for r, rc in roles.items()}}
    for key, node in debuggers.items():
        if node != PrecisionDebuggerConfig():
            notes.append(f"{key}.precision_debugger has no effect: it {PRECISION_DEBUGGER_WHY}")
    for role, rc in roles.items():
        torch_cfg, key = rc.tool_config.torch, f"{ROLE_KEYS.get(role, role)}.profiler.tool_config.torch"
        if torch_cfg.schedule.active and cfg.tool == "torch" and role not in SCHEDULED_ROLES:
            notes.append(f"{key}.schedule has no effect: it is stepped per update mini-batch, and {role} has no "
                         "update loop (set it on actor_rollout_ref.actor or critic)")
        elif torch_cfg.schedule.active and cfg.tool not in ("torch", None):
            notes.append(f"{key}.schedule has no effect with global_profiler.tool={cfg.tool}: it schedules the "
                         "torch tool's trace")
        if (torch_cfg.profile_token_start, torch_cfg.profile_token_end) == (None, None):
            continue
        if role not in TOKEN_ROLES:
            notes.append(f"{key}.profile_token_start / profile_token_end have no effect: only the rollout decodes "
                         "tokens (set them on actor_rollout_ref.rollout)")
        elif cfg.tool not in ("torch", None):
            notes.append(f"{key}.profile_token_start / profile_token_end have no effect with "
                         f"global_profiler.tool={cfg.tool}: they select the decode steps of the torch tool's trace")
    return notes
