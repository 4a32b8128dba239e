"""The profiler contract matrix: every trainer mode x every tool that runs here x step selections.

Each case is a real `driver.build(cfg).run()` of a LAST-step tiny run, profiled through verl's keys
only, and checks the whole contract from outside: the exact set of files under save_path, the
manifest records (steps, role, stage, rank, pid, tool, complete, policy_version = the version the
window started at), that every artifact loads and names the stages, that the finish hook ran
exactly once after the last window (it records how many manifest lines it saw), the one warning
for steps past the run, and that a reward raising in step 2 surfaces while its window closes.

A trainer mode joins by adding one `Mode` to MODES; a selection the mode rejects (`refused`)
must fail with a ConfigError before anything is built. Nothing mutable is shared between cases:
each run builds its own model, data, reward module and output folders under its tmp_path.
nsys needs CUDA, so here it is checked to be refused before any training work; on a GPU
machine bench/gpu_check.py covers it, and there torch_memory writes allocator snapshots (.pickle),
which this file loads too.
"""

import gzip
import json
import logging
import os
import pickle
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

try:
    import memray
except ImportError:  # the memray extra: its column of the matrix is left out
    memray = None

from plait import driver
from plait.data.images import IMAGE_REWARDS
from plait.configtree import ConfigError
from plait.profiler import read_manifest
from plait.trainers.lifecycle import read_metrics

torch.set_num_threads(1)
CUDA = torch.cuda.is_available()
LAST = 4  # every run is 4 steps: room for windows before, at and past the last step
ROLE_KEYS = {"actor": "actor_rollout_ref.actor", "rollout": "actor_rollout_ref.rollout",
             "ref": "actor_rollout_ref.ref", "critic": "critic"}
ROLE_ORDER = ("actor", "rollout", "ref", "critic")
# Runs once, after the last window: what it saw of the manifest proves when it ran.
HOOK = ('echo "$PLAIT_PROFILE_TOOL $PLAIT_PROFILE_ROLE $PLAIT_PROFILE_RANK $PLAIT_PROFILE_SAVE_PATH '
        '$(wc -l < "$PLAIT_PROFILE_SAVE_PATH/manifest.jsonl")" >> "$PLAIT_PROFILE_SAVE_PATH/../hook_ran"')
BEYOND = "beyond the run's last step"

# Custom rewards that fail during step 2. A reward module is loaded afresh per run, so its call
# counter starts at zero in every case; the test_freq=-1 runs validate only at the last step.
LM_REWARD_RAISES_IN_STEP_2 = '''
CALLS = []
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    CALLS.append(1)
    if len(CALLS) > 4 * 4:  # called once per response: 4 prompts x 4 samples make step 1
        raise RuntimeError("custom reward failed at step 2")
    return 0.0
'''
IMAGE_REWARD_RAISES_IN_STEP_2 = '''
import torch
CALLS = []
def compute_score(images, cond):
    CALLS.append(1)
    if len(CALLS) == 2:  # called once per step with the whole batch
        raise RuntimeError("custom reward failed at step 2")
    return torch.zeros(len(cond))
'''


@dataclass(frozen=True)
class Mode:
    """One trainer mode, as the matrix needs to know it."""

    name: str
    overrides: tuple[str, ...]              # on top of tests/conftest.py's tiny LM config
    stages: dict[str, tuple[str, ...]]      # role -> the stages it annotates in one training step
    pair: tuple[str, str]                   # two roles profiled together (ROLE_ORDER order)
    reward_raising_in_step_2: str           # source of a custom reward module (compute_score)
    before_reward: dict[str, tuple[str, ...]]  # role -> its stages that run before the reward
    # Roles sharing one process (one artifact per window, roles joined by "-"). The local backend
    # hosts every role in the driver; a mode that places roles apart lists its process groups.
    processes: tuple[tuple[str, ...], ...] = (ROLE_ORDER,)
    warm_up: Callable[[], object] = lambda: None  # once-per-process setup kept out of every window
    refused: tuple[str, ...] = ()  # Case names this mode rejects with a ConfigError before any work
    two_mini_batches: str = "actor_rollout_ref.actor.ppo_epochs=2"  # an update loop of two optimizer steps
    inapplicable: tuple[str, ...] = ()  # Case names that do not apply (no such role in this mode)
    only_cases: tuple[str, ...] = ()    # run only these Cases (a placement whose lifecycle another Mode covers)


def train_glyph_classifier():
    """The glyph_classifier reward trains its classifier at first call (cached per process); inside
    a window, that training made a trace of ~2M events. Validation calls it whatever the reward."""
    return IMAGE_REWARDS["glyph_classifier"](torch.zeros(1, 1, 8, 8), torch.zeros(1, dtype=torch.long))


MODES = [
    # One optimizer step and one forward per stage keeps the CPU memory traces small (half the events);
    # with one optimizer step per batch the actor takes pi_old from the update (no old_log_prob stage).
    Mode("sync", ("trainer.mode=sync", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16"),
         stages={"actor": ("update_actor",), "rollout": ("gen", "update_weights")},
         pair=("actor", "rollout"), reward_raising_in_step_2=LM_REWARD_RAISES_IN_STEP_2,
         before_reward={"rollout": ("gen",)}),
    # sync with the rollout on workers of its own: the lifecycle is sync's (covered above); here the two
    # knobs that act inside stages, whose step and rollout calls a placement could change.
    Mode("separated", ("trainer.mode=sync", "trainer.placement=separated", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                       "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16"),
         stages={"actor": ("update_actor",), "rollout": ("gen", "update_weights")},
         pair=("actor", "rollout"), reward_raising_in_step_2=LM_REWARD_RAISES_IN_STEP_2,
         before_reward={"rollout": ("gen",)}, only_cases=("2_schedule", "2_tokens")),
    # The async modes place the rollout apart (a thread on the local backend); in step 2 no stage
    # finishes before the reward (the rollout is generating the next batch), so the actor's window
    # is checked without stages there. One prompt per rollouter call keeps its `gen` inside windows.
    Mode("one_step_off", ("trainer.mode=one_step_off", "trainer.placement=separated",
                          "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16"),
         stages={"actor": ("update_actor",), "rollout": ("gen", "update_weights")},
         pair=("actor", "rollout"), reward_raising_in_step_2=LM_REWARD_RAISES_IN_STEP_2,
         before_reward={"actor": ()}, refused=("2_discrete",)),
    Mode("fully_async", ("trainer.mode=fully_async", "trainer.placement=separated", "async_training.gen_batch_size=1",
                         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                         "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16"),
         stages={"actor": ("update_actor",), "rollout": ("gen", "update_weights")},
         pair=("actor", "rollout"), reward_raising_in_step_2=LM_REWARD_RAISES_IN_STEP_2,
         before_reward={"actor": ()}, refused=("2_discrete",)),
    Mode("diffusion", ("trainer.mode=diffusion", "diffusion.model.width=16", "diffusion.model.depth=1",
                       "diffusion.pretrain_steps=3", "diffusion.actor.kl_loss_coef=0.01"),
         stages={"actor": ("gen", "old_log_prob", "update_actor"), "ref": ("ref",)},
         pair=("actor", "ref"), reward_raising_in_step_2=IMAGE_REWARD_RAISES_IN_STEP_2,
         before_reward={"actor": ("gen",)}, warm_up=train_glyph_classifier,
         two_mini_batches="diffusion.actor.ppo_epochs=2", inapplicable=("2_tokens",)),  # no token decoding
]


@dataclass(frozen=True)
class Case:
    """A step selection and what it must give: its windows (first, last) in order."""

    name: str
    steps: tuple[int, ...]
    continuous: bool
    windows: tuple[tuple[int, int], ...]
    roles: str = "actor"          # actor | pair | before_reward (the Mode's)
    discrete: bool = False
    warns: bool = False           # one line about steps past the run
    reward_raises: bool = False   # step 2's reward raises; the run stops there
    extra: tuple[str, ...] = ()   # more global_profiler keys
    memory_windows: tuple[tuple[int, int], ...] = ()  # the memory tools' windows (torch_memory, memray), when they differ
    present: tuple[str, ...] = ()  # range names every artifact must hold, instead of the stages run
    absent: tuple[str, ...] = ()   # range names no artifact may hold
    only: tuple[str, tuple[str, ...]] = ("", ())  # (prefix, allowed): names with this prefix, only these

    def windows_for(self, tool: str) -> tuple[tuple[int, int], ...]:
        return self.memory_windows if tool in MEMORY_TOOLS and self.memory_windows else self.windows

    def profiled(self, mode: Mode) -> tuple[str, ...]:
        return {"actor": ("actor",), "pair": mode.pair, "before_reward": tuple(mode.before_reward),
                "rollout": ("rollout",)}[self.roles]


CASES = [
    Case("step1", (1,), False, ((1, 1),)),
    Case("2-3_continuous", (2, 3), True, ((2, 3),), roles="pair"),
    Case("2-3_separate", (2, 3), False, ((2, 2), (3, 3))),
    Case("last", (LAST,), False, ((LAST, LAST),)),
    Case("last-1_to_last+1", (LAST - 1, LAST, LAST + 1), True, ((LAST - 1, LAST),), warns=True),
    Case("reward_raises_in_2", (2,), False, ((2, 2),), roles="before_reward", reward_raises=True),
    # discrete: one trace per stage (a torch knob); a window away from the last step's validation.
    Case("2_discrete", (2,), False, ((2, 2),), roles="pair", discrete=True),
    # verl 0.9's keys: one snapshot per 2 profiled steps (torch_memory and memray; it records step 2 too, as
    # verl's always-on history does); the hook-rank and relocation keys change nothing (the hook still
    # runs once, in the driver). The torch schedule and the token range have cases of their own below.
    Case("1,3_verl09_keys", (1, 3), False, ((1, 1), (3, 3)), memory_windows=((1, 3),), extra=(
        "global_profiler.global_tool_config.torch_memory.memory_snapshot_num_steps=2",
        "global_profiler.global_tool_config.memray.memory_snapshot_num_steps=2",
        "global_profiler.finish_hook_all_ranks=true", "global_profiler.finish_hook_ranks=[0]",
        "global_profiler.relocate_results=true")),
    # verl's torch schedule, stepped per update mini-batch: of two, wait=1 skips the first (and every stage
    # before it) and active=1 keeps the second; the update stage's own range spans both and is cut.
    Case("2_schedule", (2,), False, ((2, 2),), roles="pair", present=("actor/mini_batch1",),
         absent=("actor/mini_batch0", "actor/update_actor"), extra=(
             "actor_rollout_ref.actor.profiler.tool_config.torch.schedule.wait=1",
             "actor_rollout_ref.actor.profiler.tool_config.torch.schedule.active=1")),
    # the rollout's token range: of each generate call, only the forwards yielding response tokens 1 and 2
    Case("2_tokens", (2,), False, ((2, 2),), roles="rollout", present=("rollout/gen", "rollout/token1"),
         only=("rollout/token", ("rollout/token1", "rollout/token2")), extra=(
             "actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token_start=1",
             "actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token_end=3")),
]
TOOLS = ["torch", "torch_memory"] + (["memray"] if memray else [])
MEMORY_TOOLS = ("torch_memory", "memray")  # the tools memory_snapshot_num_steps groups windows for
# `discrete` is a knob of the torch tool only. Cut to keep the matrix near 90 s on the shared
# 2-core machine (uncut, the first two modes' 28 runs took 93 s): torch_memory (3-10 s a run
# here, its CPU artifact is a torch trace with every allocation) skips the selections whose kind
# of window another torch_memory case already has: "2-3_continuous" (a continuous two-step window,
# as in "last-1_to_last+1") and "last" (a window closing at the last step, likewise). Both still
# run with torch.
# The schedule and the token range are knobs of the torch tool (named as no effect for torch_memory).
# memray (host memory by call stack, one capture per window) skips the same selections (its 20 runs: 40 s here).
SKIP = {(tool, case) for tool in MEMORY_TOOLS
        for case in ("2-3_continuous", "last", "2_discrete", "2_schedule", "2_tokens")}
MATRIX = [pytest.param(mode, tool, case, id=f"{mode.name}-{tool}-{case.name}")
          for mode in MODES for tool in TOOLS for case in CASES
          if (tool, case.name) not in SKIP and case.name not in mode.inapplicable
          and (not mode.only_cases or case.name in mode.only_cases)]


def artifact_groups(mode: Mode, profiled: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The profiled roles of each process, in ROLE_ORDER: one shared artifact per group."""
    groups = [tuple(r for r in ROLE_ORDER if r in profiled and r in process) for process in mode.processes]
    return [g for g in groups if g]


def expected_records(mode: Mode, case: Case, tool: str) -> list[dict]:
    ext = {"torch_memory": "pickle" if CUDA else "pt.trace.json.gz", "memray": "memray.bin"}.get(tool, "pt.trace.json.gz")
    out = []
    for first, last in case.windows_for(tool):
        span = f"step{first}" if first == last else f"step{first}-{last}"
        common = {"steps": [first, last], "rank": 0, "tool": tool, "policy_version": first - 1,
                  "complete": not case.reward_raises}
        for group in artifact_groups(mode, case.profiled(mode)):
            if case.discrete:
                out += [{**common, "role": role, "stage": stage, "path": f"{span}/{role}_rank0_{stage}.{ext}"}
                        for role in group for stage in mode.stages[role]]
            else:
                name = "-".join(group)
                out.append({**common, "role": name, "stage": None, "path": f"{span}/{name}_rank0.{ext}"})
    return sorted(out, key=lambda r: r["path"])


def expected_stage_names(mode: Mode, case: Case, record: dict) -> set[str]:
    if case.present:
        return set(case.present)
    if record["stage"] is not None:
        return {f"{record['role']}/{record['stage']}"}
    done = mode.before_reward if case.reward_raises else mode.stages
    return {f"{role}/{stage}" for role in record["role"].split("-") for stage in done.get(role, ())}


def load_artifact(path: str) -> tuple[set[str], bool]:
    """(names of the ranges and annotations in it, whether it shows memory allocations); a memray
    capture has no ranges: its names are the functions on the stacks of its allocations."""
    if path.endswith(".memray.bin"):
        reader = memray.FileReader(path)
        records = list(reader.get_high_watermark_allocation_records())  # each with its stack
        reader.close()
        return {frame[0] for r in records for frame in r.stack_trace()}, any(r.size > 0 for r in records)
    if path.endswith(".pickle"):  # a CUDA allocator snapshot
        with open(path, "rb") as f:
            snapshot = pickle.load(f)
        allocs = any(e["action"] == "alloc" for trace in snapshot["device_traces"] for e in trace)
        return {a["name"] for a in snapshot.get("external_annotations", [])}, allocs
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    allocs = any(e.get("name") == "[memory]" and e["args"]["Bytes"] > 0 for e in events)
    return {e.get("name") for e in events}, allocs


def all_files(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def profile_overrides(mode: Mode, case: Case, tool: str, tmp_path) -> list[str]:
    out = [f"global_profiler.tool={tool}", f"global_profiler.steps={list(case.steps)}",
           f"global_profiler.profile_continuous_steps={str(case.continuous).lower()}",
           f"global_profiler.save_path={tmp_path / 'profile'}", f"global_profiler.finish_hook_cmd={HOOK}",
           *case.extra, *((mode.two_mini_batches,) if case.name == "2_schedule" else ())]
    for role in case.profiled(mode):
        out.append(f"{ROLE_KEYS[role]}.profiler.enable=true")
        if case.discrete:
            out.append(f"{ROLE_KEYS[role]}.profiler.tool_config.torch.discrete=true")
    if case.reward_raises:
        reward = tmp_path / "reward.py"
        reward.write_text(mode.reward_raising_in_step_2)
        out += [f"custom_reward_function.path={reward}", "custom_reward_function.name=compute_score",
                "reward.num_workers=1"]  # one worker process: its call count is the run's
    return out


@pytest.mark.parametrize("mode, tool, case", MATRIX)
def test_profiler_contract(mode, tool, case, tmp_path, tiny_config, caplog):
    save = tmp_path / "profile"
    mode.warm_up()
    overrides = [*mode.overrides, f"trainer.total_training_steps={LAST}", "trainer.test_freq=-1",
                 *profile_overrides(mode, case, tool, tmp_path)]
    if case.name in mode.refused:
        with pytest.raises(ConfigError):
            driver.run(tiny_config(tmp_path / "out", *overrides), progress=False)
        assert all_files(tmp_path / "out") == [] and not save.exists()  # nothing built or written
        return
    cfg = tiny_config(tmp_path / "out", *overrides)
    with caplog.at_level(logging.WARNING, logger="plait.profiler"):
        if case.reward_raises:
            with pytest.raises(RuntimeError, match="custom reward failed at step 2"):
                driver.build(cfg, progress=False).run()
        else:
            driver.build(cfg, progress=False).run()

    ran = [r["step"] for r in read_metrics(str(tmp_path / "out" / "metrics.jsonl"))]
    assert ran == ([1] if case.reward_raises else list(range(1, LAST + 1)))

    records = read_manifest(str(save))
    expected = expected_records(mode, case, tool)
    keys = ("steps", "role", "stage", "rank", "tool", "path", "policy_version", "complete")
    # a failed artifact has path null: sort so that the comparison, not the sort, reports it
    assert sorted(({k: r[k] for k in keys} for r in records), key=lambda r: str(r["path"])) == expected
    assert all(r["pid"] == os.getpid() and r["start_time"] <= r["end_time"] for r in records)
    assert [r["steps"] for r in records] == sorted(r["steps"] for r in records)  # windows in step order
    assert all_files(save) == sorted(["manifest.jsonl", *(r["path"] for r in expected)])

    for record in records:
        names, allocs = load_artifact(str(save / record["path"]))
        assert allocs or tool not in MEMORY_TOOLS, f"{record['path']} shows no allocations"
        if tool == "memray":  # no ranges: the stages are checked on the timeline and the report (test_memray.py)
            continue
        assert expected_stage_names(mode, case, record) <= names, (record["path"], sorted(n for n in names if "/" in n))
        assert not set(case.absent) & names, (record["path"], sorted(n for n in names if "/" in n))
        prefix, allowed = case.only
        assert {n for n in names if prefix and n.startswith(prefix)} <= set(allowed), (record["path"], sorted(names))

    assert (tmp_path / "hook_ran").read_text().split() == [tool, "driver", "0", str(save), str(len(expected))]
    beyond = [r.getMessage() for r in caplog.records if BEYOND in r.getMessage()]
    assert beyond == ([f"profiler: global_profiler.steps {LAST + 1} is {BEYOND} {LAST} and will not be profiled"]
                      if case.warns else [])


@pytest.mark.skipif(CUDA, reason="nsys runs where CUDA does; bench/gpu_check.py checks it there")
@pytest.mark.parametrize("mode", [pytest.param(m, id=m.name) for m in MODES])
def test_nsys_is_refused_before_any_training_work(mode, tmp_path, tiny_config):
    out, save = tmp_path / "out", tmp_path / "profile"
    cfg = tiny_config(out, *mode.overrides, "global_profiler.tool=nsys", "global_profiler.steps=[1]",
                      f"global_profiler.save_path={save}", f"global_profiler.finish_hook_cmd={HOOK}",
                      "actor_rollout_ref.actor.profiler.enable=true")
    with pytest.raises(ConfigError, match=r"global_profiler\.tool.*nsys needs CUDA"):
        driver.run(cfg, progress=False)
    # driver.run makes the output folder and locks it; nothing was built, trained, logged or profiled in it.
    assert os.listdir(out) == [".plait.lock"]
    assert not save.exists() and not (tmp_path / "hook_ran").exists()
