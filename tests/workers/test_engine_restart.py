"""Rollout engine health: an engine whose process dies (EngineDied) is restarted once per step with the
current weights, its call re-issued, and counted (`rollout/engine_restarts`); a second death in the same
step ends the run in one line. Here a planted engine dies on chosen generate calls, in every mode on the
local backend; the real deaths (vLLM's engine core killed, the rollout's Ray worker killed) are in
tests/trainers/test_engine_restart_e2e.py."""

import pytest
import torch

from plait import driver
from plait.errors import EngineDied, EngineFailed
from plait.trainers.lifecycle import read_metrics
from plait.workers.engine import ENGINES, EngineSpec
from plait.workers.rollout_engine import TransformersEngine, build as build_hf

torch.set_num_threads(1)
COMMON = ("trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.val_before_train=false")
MODES = {"sync": ("trainer.mode=sync",), "one_step_off": ("trainer.mode=one_step_off", "trainer.placement=separated"),
         "fully_async": ("trainer.mode=fully_async", "trainer.placement=separated"),
         "colocate_async": ("trainer.v1.trainer_mode=colocate_async",),
         "separate_async": ("trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=2")}


class Deaths:
    """Which generate calls (counted over every engine built) die, and how many engines were built."""

    def __init__(self, calls):
        self.calls, self.count, self.built = set(calls), 0, 0


def planted(monkeypatch, deaths: Deaths):
    class Dying(TransformersEngine):
        def generate(self, *args, **kwargs):
            deaths.count += 1
            if deaths.count in deaths.calls:
                raise EngineDied("the engine process was killed (planted)")
            return super().generate(*args, **kwargs)

    def build(args):
        deaths.built += 1
        engine = build_hf(args)
        return Dying(engine.model, engine.pad_token_id, engine.eos_token_ids)
    monkeypatch.setitem(ENGINES, "dying", EngineSpec(build=build, unavailable=lambda: None, images=lambda: None))


@pytest.mark.parametrize("mode", MODES)
def test_a_dead_engine_is_restarted_with_the_current_weights_and_the_run_completes(tmp_path, tiny_config, monkeypatch,
                                                                                   capfd, mode):
    deaths = Deaths({2})  # the second generate: step 2's batch (sync) or the one generated ahead
    planted(monkeypatch, deaths)
    driver.build(tiny_config(tmp_path, *COMMON, *MODES[mode], "actor_rollout_ref.rollout.name=dying"), progress=False).run()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert sum(r["rollout/engine_restarts"] for r in records) == 1 and deaths.built == 2
    assert all("training/weight_sync_probe_diff" in r for r in records)  # the new engine took the weights
    err = capfd.readouterr().err
    assert err.count("plait: warning: the rollout engine died in step ") == 1
    assert "restarting it with the current weights (policy version " in err and "the call it died in is re-issued" in err


def test_a_second_death_in_the_same_step_ends_the_run_in_one_line(tmp_path, tiny_config, monkeypatch):
    planted(monkeypatch, Deaths({2, 3}))
    lifecycle = driver.build(tiny_config(tmp_path, *COMMON, "actor_rollout_ref.rollout.name=dying"), progress=False)
    with pytest.raises(EngineFailed) as err:
        lifecycle.run()
    assert str(err.value) == ("the rollout engine failed again in step 2, after a restart in the same step: "
                              "the engine process was killed (planted)")
    assert err.value.recoverable  # trainer.max_restarts resumes after it
