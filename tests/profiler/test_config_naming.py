"""Config validation, the environment check, artifact names, the manifest, and the pure helpers."""

import logging
import os
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from plait.configtree import ConfigError, build
from plait.profiler import (GlobalProfilerConfig, RoleProfilerConfig, append_manifest, artifact_path,
                            read_manifest, validate_environment)
from plait.profiler.naming import sanitise
from plait.profiler.tools.torch import memory_counters
from plait.profiler.tools.torch_memory import trim_frames

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")


@pytest.mark.parametrize("data, key", [
    ({"steps": [0]}, "global_profiler.steps[0]"),
    ({"steps": [3, -1]}, "global_profiler.steps[1]"),
    ({"steps": [1.5]}, "global_profiler.steps"),  # type errors name the list and its value
    ({"steps": ["2"]}, "global_profiler.steps"),
    ({"steps": [True]}, "global_profiler.steps"),
    ({"tool": "npu"}, "global_profiler.tool"),
    ({"save_path": ""}, "global_profiler.save_path"),
    ({"finish_hook_cmd": "  "}, "global_profiler.finish_hook_cmd"),
    ({"global_tool_config": {"torch_memory": {"stack_depth": 0}}},
     "global_profiler.global_tool_config.torch_memory.stack_depth"),
    ({"global_tool_config": {"torch_memory": {"trace_alloc_max_entries": -5}}},
     "global_profiler.global_tool_config.torch_memory.trace_alloc_max_entries"),
    ({"stepz": [1]}, "global_profiler.stepz"),
])
def test_global_config_errors_name_the_key(data, key):
    with pytest.raises(ConfigError) as err:
        build(GlobalProfilerConfig, data, "global_profiler")
    assert err.value.key == key
    assert repr(err.value.value) in str(err.value)


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match="steps"):
        GlobalProfilerConfig(tool="torch", steps=[2, 2.5])
    assert build(GlobalProfilerConfig, {"steps": [2.0, 3]}).steps == [2, 3]


@pytest.mark.parametrize("data, key", [
    ({"tool_config": {"torch": {"contents": ["memory", "flops"]}}}, "p.tool_config.torch.contents[1]"),
    ({"all_ranks": True, "ranks": [1]}, "p.ranks"),
    ({"ranks": [-1]}, "p.ranks[0]"),
])
def test_role_config_errors(data, key):
    with pytest.raises(ConfigError) as err:
        build(RoleProfilerConfig, data, "p")
    assert err.value.key == key


def test_rank_selection():
    assert [RoleProfilerConfig(enable=True).selects(r) for r in range(3)] == [True, False, False]
    assert [RoleProfilerConfig(enable=True, ranks=[1, 2]).selects(r) for r in range(3)] == [False, True, True]
    assert all(RoleProfilerConfig(enable=True, all_ranks=True).selects(r) for r in range(3))
    assert not RoleProfilerConfig(enable=False, all_ranks=True).selects(0)


@no_cuda
def test_nsys_is_refused_without_cuda():
    with pytest.raises(ConfigError, match="nsys needs CUDA") as err:
        validate_environment(GlobalProfilerConfig(tool="nsys", steps=[1]))
    assert err.value.key == "global_profiler.tool"


@no_cuda
def test_torch_cuda_contents_refused_without_cuda():
    roles = {"actor": build(RoleProfilerConfig, {"enable": True, "tool_config": {"torch": {"contents": ["cuda"]}}})}
    with pytest.raises(ConfigError) as err:
        validate_environment(GlobalProfilerConfig(tool="torch"), roles)
    assert err.value.key == "actor_rollout_ref.actor.profiler.tool_config.torch.contents"
    roles["actor"].enable = False  # a disabled role's contents do not matter
    validate_environment(GlobalProfilerConfig(tool="torch"), roles)


@no_cuda
def test_torch_memory_on_cpu_says_what_it_writes(caplog):
    with caplog.at_level(logging.WARNING, logger="plait.profiler"):
        validate_environment(GlobalProfilerConfig(tool="torch_memory", steps=[1]))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "CPU memory events" in lines[0] and "stack_depth" in lines[0]


def test_tool_without_any_enabled_role_is_said(caplog):
    with caplog.at_level(logging.WARNING, logger="plait.profiler"):
        validate_environment(GlobalProfilerConfig(tool="torch", steps=[1]), {"actor": RoleProfilerConfig()})
    assert ["no role has profiler.enable" in r.getMessage() for r in caplog.records] == [True]


def test_save_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="existing file"):
        validate_environment(GlobalProfilerConfig(tool="torch", save_path=str(tmp_path / "f")))
    validate_environment(GlobalProfilerConfig(tool=None, save_path=str(tmp_path / "f")))  # off: no check


def test_artifact_path_layout():
    assert artifact_path("out", 3, 3, "actor", 0, ext="pt.trace.json.gz") == "out/step3/actor_rank0.pt.trace.json.gz"
    assert artifact_path("out", 2, 4, "actor-ref", 7, ext="pickle") == "out/step2-4/actor-ref_rank7.pickle"
    assert (artifact_path("out", 5, 5, "critic", 1, ext="pt.trace.json.gz", stage="update_critic")
            == "out/step5/critic_rank1_update_critic.pt.trace.json.gz")
    assert artifact_path("out", 1, 1, "a/../b", 0, ext="x", stage="../../etc/passwd") == \
        "out/step1/a___b_rank0_____etc_passwd.x"


@given(st.text(min_size=1, max_size=40))
def test_sanitised_names_cannot_escape_the_step_folder(name):
    safe = sanitise(name)
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", safe) and ".." not in safe and not safe.startswith(".")
    path = artifact_path("save", 1, 2, name, 0, ext="pickle", stage=name)
    assert os.path.dirname(path) == os.path.join("save", "step1-2")


def test_manifest_appends_lines_with_fixed_keys(tmp_path):
    record = {"steps": [2, 3], "role": "actor", "stage": None, "rank": 0, "pid": 1, "tool": "torch",
              "path": "step2-3/actor_rank0.pt.trace.json.gz", "start_time": 1.0, "end_time": 2.0,
              "policy_version": 1, "complete": True}
    append_manifest(str(tmp_path), [record])
    append_manifest(str(tmp_path), [])
    other = dict(record, path="step4/actor_rank0.pt.trace.json.gz")
    append_manifest(str(tmp_path), [other])
    assert read_manifest(str(tmp_path)) == [record, other]
    append_manifest(str(tmp_path), [dict(record, complete=False)])  # one record per path: the newer wins
    assert read_manifest(str(tmp_path)) == [other, dict(record, complete=False, resumed=True)]
    with pytest.raises(ValueError, match="keys"):
        append_manifest(str(tmp_path), [{"steps": [1, 1]}])


def test_trim_frames_keeps_the_innermost_frames():
    frames = [{"filename": f"f{i}.py", "line": i, "name": f"fn{i}"} for i in range(10)]
    snapshot = {"segments": [{"blocks": [{"size": 512, "frames": list(frames)}, {"size": 0, "state": "inactive"}]}],
                "device_traces": [[{"action": "alloc", "size": 512, "frames": list(frames)}]]}
    trimmed = trim_frames(snapshot, 3)
    assert trimmed["segments"][0]["blocks"][0]["frames"] == frames[:3]
    assert trimmed["device_traces"][0][0]["frames"] == frames[:3]
    assert "frames" not in trimmed["segments"][0]["blocks"][1]


def test_memory_counters_follow_total_allocated_per_device():
    events = [{"name": "[memory]", "pid": 1, "ts": 10.0, "args": {"Device Type": 0, "Device Id": -1, "Total Allocated": 64}},
              {"name": "aten::mm", "pid": 1, "ts": 11.0, "args": {}},
              {"name": "[memory]", "pid": 1, "ts": 12.0, "args": {"Device Type": 1, "Device Id": 0, "Total Allocated": 32}}]
    assert memory_counters(events) == [
        {"ph": "C", "name": "memory allocated (cpu)", "pid": 1, "ts": 10.0, "args": {"bytes": 64}},
        {"ph": "C", "name": "memory allocated (cuda:0)", "pid": 1, "ts": 12.0, "args": {"bytes": 32}}]


def test_trim_frames_counts_python_frames_only():
    cpp = {"filename": "c10/core/alloc.cpp", "line": 0, "name": "malloc"}
    py = [{"filename": f"f{i}.py", "line": i, "name": f"fn{i}"} for i in range(4)]
    frames = [cpp, cpp, py[0], cpp, py[1], py[2], py[3]]
    snapshot = {"segments": [], "device_traces": [[{"action": "alloc", "frames": list(frames)}]]}
    assert trim_frames(snapshot, 2)["device_traces"][0][0]["frames"] == frames[:5]


VERL_09_KEYS = ["global_profiler.global_tool_config.torch_memory.memory_snapshot_num_steps=2",
                "global_profiler.global_tool_config.torch_memory.context=alloc",
                "global_profiler.global_tool_config.torch_memory.stacks=python",
                "global_profiler.global_tool_config.torch_memory.kw_args={clear_history: false}",
                "global_profiler.finish_hook_all_ranks=true", "global_profiler.finish_hook_ranks=[0]",
                "global_profiler.relocate_results=true",
                "global_profiler.global_tool_config.precision_debugger.config_path=/tmp/msprobe.json",
                "actor_rollout_ref.actor.profiler.tool_config.torch.schedule.active=2",
                "actor_rollout_ref.actor.profiler.tool_config.torch.schedule.skip_first=1",
                "actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token_start=2",
                "actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token_end=8"]


def test_verl_09_profiler_keys_load_with_their_values():
    from plait.config import load_config
    cfg = load_config(None, VERL_09_KEYS)
    mem = cfg.global_profiler.global_tool_config.torch_memory
    assert (mem.memory_snapshot_num_steps, mem.context, mem.stacks, mem.kw_args) == (2, "alloc", "python",
                                                                                     {"clear_history": False})
    g = cfg.global_profiler
    assert (g.finish_hook_all_ranks, g.finish_hook_ranks, g.relocate_results) == (True, [0], True)
    assert cfg.actor_rollout_ref.actor.profiler.tool_config.torch.schedule.active == 2
    t = cfg.actor_rollout_ref.rollout.profiler.tool_config.torch
    assert (t.profile_token_start, t.profile_token_end) == (2, 8)


@pytest.mark.parametrize("override, match", [
    ("global_profiler.global_tool_config.torch_memory.memory_snapshot_num_steps=0", "positive"),
    ("global_profiler.global_tool_config.torch_memory.context=everything", "alloc, state, all"),
    ("global_profiler.global_tool_config.torch_memory.stacks=cpp", "python, all"),
    ("global_profiler.global_tool_config.torch_memory.kw_args={max_entries: 5}", "clear_history"),
    ("actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token_end=0", "greater than"),
    ("actor_rollout_ref.actor.profiler.tool_config.torch.schedule.wait=-1", ">= 0"),
    ("global_profiler.tool=precision_debugger", "msprobe"),
])
def test_bad_verl_09_profiler_values_name_the_key(override, match):
    from plait.config import load_config
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override, *(["actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token_start=3"]
                                       if "token_end" in override else [])])


def test_keys_without_effect_here_say_so_once_each(caplog):
    from plait.config import load_config
    from plait.driver import role_profilers
    cfg = load_config(None, ["global_profiler.tool=torch", "global_profiler.steps=[1]",
                             "actor_rollout_ref.actor.profiler.enable=true", *VERL_09_KEYS])
    with caplog.at_level("WARNING"):
        validate_environment(cfg.global_profiler, role_profilers(cfg))
    text = caplog.text
    for key in ("finish_hook_all_ranks", "relocate_results", "global_tool_config.precision_debugger"):
        assert text.count(key) == 1, key
    # the actor's schedule and the rollout's token range take effect (test_schedule_tokens.py): no note
    assert "schedule" not in text and "profile_token_start" not in text


def test_schedule_and_token_range_where_they_cannot_act_say_so(caplog):
    from plait.config import load_config
    from plait.driver import role_profilers
    cfg = load_config(None, ["global_profiler.tool=torch", "global_profiler.steps=[1]",
                             "actor_rollout_ref.ref.profiler.tool_config.torch.schedule.active=1",
                             "actor_rollout_ref.actor.profiler.tool_config.torch.profile_token_end=4",
                             "actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token_end=4"])
    with caplog.at_level("WARNING"):
        validate_environment(cfg.global_profiler, role_profilers(cfg))
    lines = [r.getMessage() for r in caplog.records if "no effect" in r.getMessage()]
    assert any("actor_rollout_ref.ref.profiler.tool_config.torch.schedule has no effect" in m and "no update loop" in m
               for m in lines)
    assert any(m.startswith("profiler: actor_rollout_ref.actor.profiler.tool_config.torch.profile_token_start") and
               "only the rollout decodes" in m for m in lines)
    # on the rollout they act, with either engine (vLLM's delay_iterations / max_iterations)
    assert not any(m.startswith("profiler: actor_rollout_ref.rollout.profiler.tool_config.torch.profile_token")
                   for m in lines)


def test_memory_snapshot_num_steps_groups_windows():
    from plait.profiler.schedule import Window, plan
    assert plan([1, 3, 5], 10, False, per_window=2).windows == (Window(1, 3), Window(5, 5))
    assert plan([1, 2, 4, 5], 10, True, per_window=2).windows == (Window(1, 5),)
    assert plan([1, 3, 5], 10, False).windows == (Window(1, 1), Window(3, 3), Window(5, 5))


def test_gpu_stall_diagnostics_is_accepted_and_named_once_as_having_no_effect(caplog):
    from plait.config import load_config
    from plait.driver import role_profilers
    keys = ["global_profiler.gpu_stall_diagnostics.enable=true", "global_profiler.gpu_stall_diagnostics.sample_interval_s=0.5",
            "global_profiler.gpu_stall_diagnostics.zero_utilization_threshold=2.0"]
    cfg = load_config(None, keys)
    assert (cfg.global_profiler.gpu_stall_diagnostics.enable, cfg.global_profiler.gpu_stall_diagnostics.sample_interval_s) == (True, 0.5)
    with caplog.at_level("WARNING"):
        validate_environment(cfg.global_profiler, role_profilers(cfg))
    lines = [r.getMessage() for r in caplog.records if "gpu_stall_diagnostics" in r.getMessage()]
    assert len(lines) == 1 and "has no effect" in lines[0] and "NVML" in lines[0] and "without a GPU" in lines[0]
    caplog.clear()
    with caplog.at_level("WARNING"):  # verl's defaults, as a copied verl YAML sets them: nothing to say
        validate_environment(load_config(None, ["global_profiler.gpu_stall_diagnostics.enable=false"]).global_profiler, {})
    assert "gpu_stall" not in caplog.text
    with pytest.raises(ConfigError, match=r"sample_interval_s.*\[0.2, 0.5\]"):  # what verl refuses is refused
        load_config(None, ["global_profiler.gpu_stall_diagnostics.sample_interval_s=1.0"])


def test_the_rl_insight_logger_is_accepted_and_named_at_start(capsys):
    from plait.config import load_config
    cfg = load_config(None, ["trainer.logger=[console,rl_insight]"])
    assert cfg.trainer.logger == ["console", "rl_insight"]
    said = [line for line in capsys.readouterr().err.splitlines() if "rl_insight" in line]
    assert len(said) == 1 and said[0].startswith("plait: trainer.logger=rl_insight has no effect: ")
    assert "RL_INSIGHT_SERVER_URL" in said[0] and "metrics.jsonl" in said[0]
    load_config(None, ["trainer.logger=[console]"])
    assert "rl_insight" not in capsys.readouterr().err
