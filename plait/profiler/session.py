"""The worker side: one ProfilerSession per process, one RoleProfiler handle per hosted role.

    driver (StepProfiler) ──start(first, last, version)──▶ ProfilerSession ──open──▶ tool
    worker stage:  with self.profiler.annotate("update_actor"): ...   (a range, or nothing)
    driver ◀──records── stop(complete) ──close──▶ tool writes artifacts via the window

Roles hosted by one process share one collection, so a window gives one artifact per process,
named after the process's profiled roles in the order actor, rollout, ref, critic
("actor-ref_rank0"); in a separated placement each role has its own process and artifact.
A role is profiled on rank 0 unless its `ranks` or `all_ranks` say otherwise. Between windows
`annotate` is one boolean check returning a shared no-op context manager: no record_function,
no NVTX, no allocator history. A failing tool is reported once and its artifact marked
incomplete; it never raises into training. The manifest is written by the driver, not here.

Two verl knobs reach inside a stage: an update loop wraps each mini-batch in `mini_batch(i)` (a
range, and one step of the torch schedule of a role that sets one), and the rollout's decode loop
calls the gate `decode_steps()` gives once per forward, so that only the decode steps in
`profile_token_start..profile_token_end` are recorded (RecordFunction is switched off on that
thread for the others; other threads keep recording).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import torch

from plait.profiler.config import (ROLE_KEYS, ROLE_ORDER, SCHEDULED_ROLES, TOKEN_ROLES, GlobalProfilerConfig,
                                   RoleProfilerConfig)
from plait.profiler.naming import artifact_path, oom_path, temp_name
from plait.profiler.timeline import NULL_SPAN, RANK_SPANS
from plait.allocator import give_back_freed_memory
from plait.profiler.tools import make_tool

log = logging.getLogger("plait.profiler")

NULL_RANGE = NULL_SPAN  # what annotate returns outside a window (and off a Ray worker): one shared no-op
ENGINE_TOOLS = ("torch", "torch_memory", "nsys")  # tools an engine in its own process can stand in for (RoleProfiler.attach)


@dataclass
class Artifact:
    role: str
    stage: Optional[str]
    path: Optional[str]        # relative to save_path; None when nothing was written
    start_time: float
    end_time: float
    complete: bool


class OpenWindow:
    """One open window's artifact sink: names each file and records what was written."""

    def __init__(self, save_path: str, first: int, last: int, version: int, name: str, rank: int,
                 on_error: Callable[[str, BaseException], None]):
        self.save_path, self.first, self.last, self.version = save_path, first, last, version
        self.name, self.rank = name, rank
        self.on_error = on_error
        self.start_time = time.time()
        self.artifacts: list[Artifact] = []
        self._stage_counts: dict[tuple[str, str], int] = {}

    def save(self, role: str, ext: str, write: Callable[[str], None], stage: Optional[str] = None,
             start_time: Optional[float] = None) -> None:
        """Write one artifact with `write(path)`; a failure is reported and recorded as incomplete."""
        if stage is not None:  # a stage repeated within a window gets -2, -3, ...
            n = self._stage_counts[(role, stage)] = self._stage_counts.get((role, stage), 0) + 1
            stage = stage if n == 1 else f"{stage}-{n}"
        path = artifact_path(self.save_path, self.first, self.last, role, self.rank, ext=ext, stage=stage)
        tmp = temp_name(path)  # a kill mid-write leaves no unreadable file under the artifact's name
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            write(tmp)
            os.replace(tmp, path)
        except Exception as err:
            self.on_error("writing an artifact", err)
            if os.path.exists(tmp):
                os.remove(tmp)
            self.add(role, stage, None, start_time, complete=False)
            return
        self.add(role, stage, path, start_time)

    def add(self, role: str, stage: Optional[str] = None, path: Optional[str] = None,
            start_time: Optional[float] = None, complete: bool = True) -> None:
        rel = None if path is None else os.path.relpath(path, self.save_path)
        self.artifacts.append(Artifact(role, stage, rel, start_time or self.start_time, time.time(), complete))


class ProfilerSession:
    def __init__(self, cfg: GlobalProfilerConfig, roles: Mapping[str, RoleProfilerConfig], rank: int,
                 world_size: int = 1):
        for role, rc in roles.items():
            missing = [r for r in rc.ranks if r >= world_size]
            if missing and rank == 0:  # a verl script shrunk to fewer workers: say so once, profile the rest
                log.warning("profiler: %s.profiler.ranks=%s: rank(s) %s do not exist at world size %d; "
                            "profiling %s", ROLE_KEYS.get(role, role), rc.ranks, missing, world_size,
                            [r for r in rc.ranks if r < world_size] or "no rank of this role")
        self.cfg, self.rank = cfg, rank
        order = sorted(roles, key=lambda r: ROLE_ORDER.index(r) if r in ROLE_ORDER else len(ROLE_ORDER))
        profiled = [r for r in order if roles[r].selects(rank)]
        self.name = "-".join(profiled)  # the shared artifact's role name, "" if none
        self.tool = make_tool(cfg, {r: roles[r] for r in profiled}) if cfg.tool and profiled else None
        self._handles = {r: RoleProfiler(self, r, r in profiled, roles[r]) for r in roles}
        self._window: Optional[OpenWindow] = None
        self._recording = False  # window open and tool collecting: the one flag annotate reads
        self._warned: set[str] = set()
        self._pending: list[dict] = []  # records of OOM dumps taken outside windows, until stop()
        self._attached: list = []  # engines' own profilers (RoleProfiler.attach), opened and closed with the tool
        if cfg.tool == "torch_memory" and self.tool is not None:
            from plait.profiler.tools.torch_memory import _OomObserver
            if torch.cuda.is_available():
                _OomObserver.attach()
            _OomObserver.outside = self.dump_oom

    def for_role(self, role: str) -> "RoleProfiler":
        if role not in self._handles:
            raise ValueError(f"role {role!r} is not hosted by this process ({', '.join(self._handles)})")
        return self._handles[role]

    @property
    def active(self) -> bool:
        return self._window is not None

    def start(self, first_step: int, last_step: int, version: int) -> None:
        """Open a window; a no-op when no hosted role is profiled on this rank or tool is None."""
        if self.tool is None:
            return
        if self._window is not None:
            self._warn("start", f"window for steps {first_step}-{last_step} asked to open while "
                                f"steps {self._window.first}-{self._window.last} are open; ignored")
            return
        self._window = OpenWindow(self.cfg.save_path, first_step, last_step, version, self.name,
                                  self.rank, self._fail)
        try:
            self.tool.open(self._window)
            self._recording = True
        except Exception as err:
            self._fail("starting", err)
            self._window.add(self.name, complete=False)
        for extra in self._attached:
            try:
                extra.open(self._window)
            except Exception as err:
                self._fail("starting an engine's profiler", err)

    def dump_oom(self) -> None:
        """A CUDA out-of-memory error outside any window: snapshot + allocator summary, recorded."""
        from plait.profiler.tools.torch_memory import write_oom_dump
        if self._window is not None:
            return  # the window's own dump covers it
        n = len(self._pending) + 1
        snapshot = oom_path(self.cfg.save_path, self.name, self.rank, n, ext="pickle")
        summary = oom_path(self.cfg.save_path, self.name, self.rank, n, ext="txt")
        now = time.time()
        try:
            os.makedirs(os.path.dirname(snapshot), exist_ok=True)
            write_oom_dump(snapshot, summary, self.cfg.global_tool_config.torch_memory.stack_depth)
            paths, complete = [snapshot, summary], True
        except Exception as err:
            self._fail("dumping at out-of-memory", err)
            paths, complete = [None], False
        self._pending += [{"steps": None, "role": self.name, "stage": "oom", "rank": self.rank, "pid": os.getpid(),
                           "tool": self.cfg.tool, "path": p and os.path.relpath(p, self.cfg.save_path),
                           "start_time": now, "end_time": time.time(), "policy_version": None,
                           "complete": complete} for p in paths]

    def stop(self, complete: bool = True) -> list[dict]:
        """Close the window, write its artifacts and return their manifest records (and those of
        out-of-memory dumps taken since the last stop)."""
        window, self._window = self._window, None
        pending, self._pending = self._pending, []
        if window is None:
            return pending
        for extra in self._attached:
            try:
                extra.close()
            except Exception as err:
                self._fail("stopping an engine's profiler", err)
                window.add(self.name, complete=False)
        if self._recording:
            self._recording = False
            try:
                self.tool.close()
            except Exception as err:
                self._fail("stopping", err)
                window.add(self.name, complete=False)
            give_back_freed_memory()  # the window's own memory is not the run's from here on
        return [{"steps": [window.first, window.last], "role": a.role, "stage": a.stage,
                 "rank": self.rank, "pid": os.getpid(), "tool": self.cfg.tool, "path": a.path,
                 "start_time": a.start_time, "end_time": a.end_time,
                 "policy_version": window.version, "complete": complete and a.complete}
                for a in window.artifacts] + pending

    # ProfileTarget: the local backend hands the session itself to the driver.
    start_profile = start
    stop_profile = stop

    def _fail(self, what: str, err: BaseException) -> None:
        self._warn(f"{what}:{type(err).__name__}",
                   f"{self.cfg.tool} failed {what}: {type(err).__name__}: {err}; training "
                   "continues, the artifact is marked incomplete")

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("profiler (%s, rank %d): %s", self.name, self.rank, message)


class RoleProfiler:
    """The handle a worker keeps as `self.profiler`."""

    def __init__(self, session: ProfilerSession, role: str, profiled: bool, cfg: RoleProfilerConfig):
        self._session, self.role, self.profiled = session, role, profiled
        torch_cfg, tool = cfg.tool_config.torch, session.cfg.tool
        # Only a role with an update loop steps a schedule, only the rollout gates decode steps (config.py
        # names the rest as having no effect), and only for the torch tool.
        self._steps = profiled and tool == "torch" and role in SCHEDULED_ROLES and torch_cfg.schedule.active > 0
        tokens = (torch_cfg.profile_token_start, torch_cfg.profile_token_end)
        self._tokens = tokens if profiled and tool == "torch" and role in TOKEN_ROLES and tokens != (None, None) else None

    @property
    def token_range(self) -> tuple[int | None, int | None] | None:
        """The rollout's profile_token_start / profile_token_end where they act here (torch tool, profiled
        rollout), else None: an engine recording itself in its own process is given them (vLLM's
        delay_iterations / max_iterations)."""
        return self._tokens

    @property
    def follows_engine(self) -> bool:
        """Whether `attach` takes a tool: this role is profiled on this rank with a tool an engine's own
        profiler has a counterpart for (torch, torch_memory, nsys: see workers/vllm_engine.py)."""
        return self.engine_tool is not None

    @property
    def engine_tool(self) -> str | None:
        """The tool name an engine recording itself follows, or None when this role is not profiled here."""
        tool = self._session.cfg.tool
        return tool if self.profiled and self._session.tool is not None and tool in ENGINE_TOOLS else None

    def attach(self, tool) -> None:
        """Open and close `tool` (open(window) / close(), writing through window.save) with this role's
        windows: an engine that records itself in a process of its own (vLLM's engine core)."""
        if self.follows_engine:
            self._session._attached.append(tool)

    def annotate(self, stage: str, scheduled: bool = False):
        """A context manager around one stage: the tool's range inside a window, else a no-op.
        `scheduled`: the stage's loop wraps its mini-batches in `mini_batch` (update_actor, update_critic)."""
        if not self._session._recording:
            return RANK_SPANS.stage(self.role, stage)  # a no-op but in a Ray worker: its span of the step
        return _Stage(self._session, self.role, stage, self.profiled, scheduled)

    def mini_batch(self, index: int):
        """Around one update mini-batch: a range `<role>/mini_batch<i>`, and then one step of this role's
        torch schedule (verl steps it once per mini-batch of the update loop)."""
        if not self._session._recording:
            return NULL_RANGE
        return _MiniBatch(self._session, self.role, index, self._steps)

    def decode_steps(self):
        """A context manager giving the gate a decode loop calls as gate(i) before the forward that yields
        response token i (0: the prefill), or None when nothing is to be left out."""
        if not self._session._recording or self._tokens is None:
            return NULL_RANGE
        return TokenGate(self.role, *self._tokens)


class _Stage:
    """Enters the tool's stage range; a tool error is reported, the stage runs exactly once."""

    def __init__(self, session: ProfilerSession, role: str, stage: str, own_file: bool, scheduled: bool = False):
        self.session, self.role, self.stage, self.own_file, self.scheduled = session, role, stage, own_file, scheduled
        self.cm = None
        self.span = RANK_SPANS.stage(role, stage)

    def __enter__(self):
        self.span.__enter__()
        try:
            cm = self.session.tool.stage(self.role, self.stage, self.own_file, self.scheduled)
            cm.__enter__()
            self.cm = cm
        except Exception as err:
            self.session._fail("entering a stage", err)

    def __exit__(self, *exc) -> bool:
        if self.cm is not None:
            try:
                self.cm.__exit__(*exc)
            except Exception as err:
                self.session._fail("leaving a stage", err)
        self.span.__exit__(*exc)
        return False  # never swallow the stage's own error


class _MiniBatch(_Stage):
    """A mini-batch range inside the update stage (never a file of its own), then a schedule step."""

    def __init__(self, session: ProfilerSession, role: str, index: int, steps: bool):
        super().__init__(session, role, f"mini_batch{index}", own_file=False)
        self.steps = steps
        self.span = NULL_RANGE  # a range in the trace only: the rank's span is its stage

    def __exit__(self, *exc) -> bool:
        super().__exit__(*exc)
        if self.steps:
            try:
                self.session.tool.step()
            except Exception as err:
                self.session._fail("stepping the schedule", err)
        return False


class TokenGate:
    """Records only the decode steps start <= i < end (None: open-ended) of a decode loop on this thread,
    each as a range `<role>/token<i>`. Outside them RecordFunction is off on this thread, so the collector
    gets no op, range or stage of it there; CUDA kernels are still seen by CUPTI on a GPU."""

    def __init__(self, role: str, start: Optional[int], end: Optional[int]):
        self.role, self.start, self.end = role, start or 0, end
        self._on, self._range = True, None

    def __enter__(self) -> "TokenGate":
        return self

    def __call__(self, index: int) -> None:
        self._close_range()
        on = self.start <= index and (self.end is None or index < self.end)
        if on != self._on:
            torch._C._autograd._enable_record_function(on)  # thread-local: other threads keep recording
            self._on = on
        if on:
            self._range = torch.profiler.record_function(f"{self.role}/token{index}")
            self._range.__enter__()

    def _close_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def __exit__(self, *exc) -> bool:
        self._close_range()
        if not self._on:
            torch._C._autograd._enable_record_function(True)
            self._on = True
        return False
