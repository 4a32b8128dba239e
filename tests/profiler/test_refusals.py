"""Settings that cannot work are refused at start, naming the user's key; settings that do nothing
say so once. Nothing here trains: each check fires before any training work."""

import logging

import pytest
import torch

from plait import driver
from plait.configtree import ConfigError
from plait.profiler import GlobalProfilerConfig, RoleProfilerConfig, RoleToolConfig, TorchToolConfig, validate_environment
from plait.profiler.tools import make_tool


def test_a_role_the_run_lacks_is_profiled_nothing_with_one_warning(tmp_path, tiny_config, caplog):
    cfg = tiny_config(tmp_path, "global_profiler.tool=torch", "global_profiler.steps=[1]",
                      "critic.profiler.enable=true", "actor_rollout_ref.actor.profiler.enable=true")
    with caplog.at_level(logging.WARNING, logger="plait"):
        driver.preflight(cfg)
    roles = driver.role_profilers(cfg)
    assert roles["actor"].enable and not roles["critic"].enable
    assert ["critic.profiler.enable is true but this run has no critic role" in r.getMessage()
            for r in caplog.records] == [True]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA snapshots see every thread")
@pytest.mark.parametrize("mode", [["trainer.mode=one_step_off", "trainer.placement=separated"],
                                  ["trainer.v1.trainer_mode=colocate_async"]], ids=["one_step_off", "colocate_async"])
def test_cpu_torch_memory_of_a_local_async_rollout_is_refused(tmp_path, tiny_config, mode):
    """Every mode with a rollout thread (plait/modes.py): verl's V1 modes were missing from the check's own list."""
    cfg = tiny_config(tmp_path / "out", *mode,
                      "global_profiler.tool=torch_memory", "global_profiler.steps=[1]",
                      f"global_profiler.save_path={tmp_path}/profile", "actor_rollout_ref.rollout.profiler.enable=true")
    with pytest.raises(ConfigError, match="global_profiler.tool='torch_memory'.*trainer.backend=ray"):
        driver.build(cfg, progress=False)
    assert not (tmp_path / "out").exists() and not (tmp_path / "profile").exists()


def test_an_unwritable_save_path_is_refused_before_any_work(tmp_path, tiny_config):
    (tmp_path / "a_file").write_text("")
    cfg = tiny_config(tmp_path / "out", "global_profiler.tool=torch", "global_profiler.steps=[1]",
                      f"global_profiler.save_path={tmp_path}/a_file/profile", "actor_rollout_ref.actor.profiler.enable=true")
    with pytest.raises(ConfigError, match="global_profiler.save_path=.*cannot be written"):
        driver.build(cfg, progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("tool, steps, enable, said", [
    ("torch", [], True, "global_profiler.steps is []; nothing will be profiled"),
    ("torch", None, True, "global_profiler.steps is None; nothing will be profiled"),
    (None, None, True, "actor_rollout_ref.actor.profiler.enable is true but global_profiler.tool is null"),
])
def test_settings_that_do_nothing_warn_once(caplog, tmp_path, tool, steps, enable, said):
    cfg = GlobalProfilerConfig(tool=tool, steps=steps, save_path=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="plait.profiler"):
        validate_environment(cfg, {"actor": RoleProfilerConfig(enable=enable), "rollout": RoleProfilerConfig()})
    assert [said in r.getMessage() for r in caplog.records if "without CUDA" not in r.getMessage()] == [True]


def test_a_discrete_mismatch_names_both_roles(tmp_path):
    def node(discrete):
        return RoleProfilerConfig(enable=True, tool_config=RoleToolConfig(torch=TorchToolConfig(discrete=discrete)))
    cfg = GlobalProfilerConfig(tool="torch", steps=[1], save_path=str(tmp_path))
    with pytest.raises(ConfigError) as err:
        make_tool(cfg, {"actor": node(True), "rollout": node(False)})
    assert "actor_rollout_ref.actor.profiler.tool_config.torch.discrete" in str(err.value)
    assert "actor_rollout_ref.rollout.profiler.tool_config.torch.discrete" in str(err.value)


def test_a_tool_with_no_role_enabled_opens_no_window_and_says_nothing_of_one(tmp_path, tiny_config, capsys):
    """Preflight says nothing will be profiled; the run then opens no window: no "writing the traces" line, no
    profiler spans, no profile folder (it had said it was writing step 2's traces and counted a window)."""
    from plait.profiler.timeline import read_timeline
    cfg = tiny_config(tmp_path / "out", "global_profiler.tool=torch", "global_profiler.steps=[2]",
                      f"global_profiler.save_path={tmp_path}/profile", "trainer.total_training_steps=3")
    driver.build(cfg, progress=False).run()
    assert "writing the torch traces" not in capsys.readouterr().err
    assert not {"profiler_start", "profiler_stop"} & {s["stage"] for s in read_timeline(str(tmp_path / "out" / "timeline.jsonl"))}
    assert not (tmp_path / "profile").exists()
