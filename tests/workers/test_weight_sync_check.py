"""The weight-sync check: a sync that does not reach the engine stops the run at the first step, in one line
naming the role and the step (verl#7495, verl-omni#552: a LoRA adapter that never reached the rollout);
a working sync passes in every mode, with the probe's distance logged."""

import os

import pytest
import torch

from plait import driver
from plait.errors import RunError
from plait.trainers.lifecycle import read_metrics
from plait.workers.engine import ENGINES, EngineSpec
from plait.workers.rollout_engine import TransformersEngine, build as build_hf

torch.set_num_threads(1)
COMMON = ("trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.val_before_train=false")


class IgnoresLoads(TransformersEngine):
    """plait's engine with a weight load that silently does nothing."""

    def load_weights(self, state_dict, share=False):
        pass


class DropsAdapterTargets(TransformersEngine):
    """Loads every weight but those LoRA trains (the attention projections): the adapter never arrives."""

    def load_weights(self, state_dict, share=False):
        super().load_weights({k: v for k, v in state_dict.items() if "_proj" not in k}, share)


@pytest.fixture
def tiny_config(tiny_config, tmp_path):
    """The tiny run with a reward that varies within each group (the demo's random model scores 0 on its
    arithmetic): the update moves the policy from the first step."""
    (tmp_path / "length.py").write_text("def length(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return float(len(solution_str))\n")
    return lambda out, *overrides: tiny_config(out, f"custom_reward_function.path={tmp_path / 'length.py'}",
                                               "custom_reward_function.name=length", "reward.num_workers=0", *overrides)


def planted(monkeypatch, cls):
    def build(args):
        engine = build_hf(args)
        return cls(engine.model, engine.pad_token_id, engine.eos_token_ids)
    monkeypatch.setitem(ENGINES, "planted", EngineSpec(build=build, unavailable=lambda: None, images=lambda: None))


@pytest.mark.parametrize("cls, extra", [
    (IgnoresLoads, ()),
    (DropsAdapterTargets, ("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                           "actor_rollout_ref.model.target_modules=[q_proj,v_proj]")),
])
def test_a_sync_that_does_not_reach_the_engine_stops_the_run_at_the_first_step(tmp_path, tiny_config, monkeypatch, cls,
                                                                              extra):
    planted(monkeypatch, cls)
    lifecycle = driver.build(tiny_config(tmp_path, *COMMON, "actor_rollout_ref.rollout.name=planted", *extra),
                             progress=False)
    with pytest.raises(RunError) as err:
        lifecycle.run()
    line = str(err.value)
    assert line.startswith("weight sync of step 1: the rollout engine does not hold the actor's new weights") and \
        "\n" not in line, line
    assert "did not change at all" in line if cls is IgnoresLoads else True
    assert not os.path.exists(tmp_path / "metrics.jsonl") or read_metrics(tmp_path / "metrics.jsonl") == []


@pytest.mark.parametrize("mode", [("trainer.mode=sync",), ("trainer.mode=one_step_off", "trainer.placement=separated"),
                                  ("trainer.mode=fully_async", "trainer.placement=separated",
                                   "async_training.trigger_parameter_sync_step=2")])
def test_a_working_sync_passes_the_check_in_every_mode(tmp_path, tiny_config, mode):
    driver.build(tiny_config(tmp_path, *COMMON, *mode), progress=False).run()
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(0 <= r["training/weight_sync_probe_diff"] < 1e-3 and r["perf/weight_sync_check_s"] > 0 for r in records)


def test_the_check_can_be_switched_off(tmp_path, tiny_config, monkeypatch):
    planted(monkeypatch, IgnoresLoads)
    driver.build(tiny_config(tmp_path, *COMMON, "actor_rollout_ref.rollout.name=planted",
                             "trainer.check_weight_sync=false"), progress=False).run()
    assert "training/weight_sync_probe_diff" not in read_metrics(tmp_path / "metrics.jsonl")[-1]
