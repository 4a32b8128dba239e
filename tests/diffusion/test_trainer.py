"""Diffusion mode end to end through `driver.build`: it learns, logs, resumes exactly and profiles."""

import gzip
import json
import os
import pickle

import pytest
import torch

from plait import driver
from plait.cli import main
from plait.config import load_config
from plait.configtree import ConfigError
from plait.profiler import read_manifest
from plait.trainers.lifecycle import read_metrics
from plait.workers.diffusion import DiffusionActor

TINY = ["trainer.mode=diffusion", "data.train_size=32", "data.train_batch_size=4", "data.val_size=8",
        "actor_rollout_ref.rollout.n=4", "trainer.total_training_steps=3", "trainer.test_freq=2",
        "trainer.logger=[]"]
STAGES = ["gen", "reward", "old_log_prob", "ref", "adv", "update_actor", "step"]
STEP_KEYS = ["critic/score/mean", "critic/rewards/mean", "critic/advantages/mean", "actor/pg_loss",
             "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_loss", "actor/grad_norm", "perf/throughput",
             "perf/time_per_step", "training/rollout_logprob_diff_mean", *[f"timing_s/{s}" for s in STAGES]]
VAL_KEY = "val-core/glyph_classifier/reward/mean"


def tiny_config(out_dir, pretrained_dir, *overrides):
    return load_config(None, [*TINY, f"trainer.default_local_dir={out_dir}",
                              f"diffusion.model_path={pretrained_dir}", *overrides])


def run(cfg):
    lifecycle = driver.build(cfg, progress=False)
    return lifecycle, lifecycle.run()


def test_steps_change_parameters_and_log_verl_metrics(tmp_path, pretrained_dir):
    lifecycle = driver.build(tiny_config(tmp_path, pretrained_dir), progress=False)
    actor = lifecycle.trainer.actor
    before = {k: v.clone() for k, v in actor.call(DiffusionActor.state_dict)["model"].items()}
    lifecycle.run()
    after = actor.call(DiffusionActor.state_dict)["model"]
    assert any(not torch.equal(before[k], after[k]) for k in before)
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # step 0: validation before training
    for record in records[1:]:
        assert all(key in record for key in STEP_KEYS), set(STEP_KEYS) - set(record)
        assert record["training/policy_version"] == record["step"]
        assert record["perf/total_num_tokens"] == 4 * 4 * 4  # samples x trained window steps
        assert record["training/rollout_logprob_diff_mean"] < 1e-5  # the actor agrees with its sampler
    assert VAL_KEY in records[0] and VAL_KEY in records[2] and VAL_KEY not in records[1]
    assert "val-aux/brightness/reward/mean" in records[2] and "timing_s/testing" in records[2]
    ckpt = tmp_path / "checkpoints" / "global_step_3"
    assert (ckpt / "actor" / "model_and_optimizer.pt").is_file()
    assert json.loads((ckpt / "trainer_state.json").read_text()) == {"step": 3, "version": 3}


def test_trainer_raises_the_heldout_reward(tmp_path, pretrained_dir):
    cfg = tiny_config(tmp_path, pretrained_dir, "data.train_size=640", "data.train_batch_size=16",
                      "actor_rollout_ref.rollout.n=8", "data.val_size=100", "trainer.total_training_steps=25",
                      "trainer.test_freq=25")
    run(cfg)
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    before, after = records[0][VAL_KEY], records[-1][VAL_KEY]
    print(f"held-out glyph_classifier reward {before:.3f} -> {after:.3f} in 25 steps")
    assert after > before + 0.05, (before, after)


def _strip(record):
    return {k: v for k, v in record.items() if not k.startswith(("timing", "perf/", "memory/"))}


def test_resume_reproduces_the_next_step_of_an_uninterrupted_run(tmp_path, pretrained_dir):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["trainer.save_freq=2", "trainer.test_freq=-1"]
    run(tiny_config(full, pretrained_dir, "trainer.total_training_steps=4", *common))
    run(tiny_config(part, pretrained_dir, "trainer.total_training_steps=2", *common))
    run(tiny_config(part, pretrained_dir, "trainer.total_training_steps=4", *common))
    a = read_metrics(os.path.join(full, "metrics.jsonl"))
    b = read_metrics(os.path.join(part, "metrics.jsonl"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert _strip(a[2]) == pytest.approx(_strip(b[2]), rel=1e-5, abs=1e-6)
    assert _strip(a[3]) == pytest.approx(_strip(b[3]), rel=1e-5, abs=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the tool records allocator history: see the gpu test")
def test_torch_memory_step1_artifact_and_manifest(tmp_path, pretrained_dir):
    save = tmp_path / "profile"
    run(tiny_config(tmp_path / "out", pretrained_dir, "trainer.total_training_steps=2", "trainer.test_freq=-1",
                    "global_profiler.tool=torch_memory", "global_profiler.steps=[1]",
                    f"global_profiler.save_path={save}", "actor_rollout_ref.actor.profiler.enable=true"))
    records = read_manifest(str(save))
    assert [(r["steps"], r["role"], r["tool"], r["path"], r["policy_version"], r["complete"]) for r in records] == [
        ([1, 1], "actor", "torch_memory", "step1/actor_rank0.pt.trace.json.gz", 0, True)]
    assert sorted(os.listdir(save)) == ["manifest.jsonl", "step1"]  # step 2 was not profiled
    with gzip.open(save / records[0]["path"]) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name") == "[memory]" and e["args"]["Bytes"] > 0 for e in events)
    assert {"actor/gen", "actor/old_log_prob", "actor/update_actor"} <= {e.get("name") for e in events}


@pytest.mark.gpu
def test_cuda_run_and_step1_allocator_snapshot(tmp_path, pretrained_dir):
    save = tmp_path / "profile"
    run(tiny_config(tmp_path / "out", pretrained_dir, "trainer.device=cuda", "trainer.total_training_steps=2",
                    "global_profiler.tool=torch_memory", "global_profiler.steps=[1]",
                    f"global_profiler.save_path={save}", "actor_rollout_ref.actor.profiler.enable=true"))
    [record] = read_manifest(str(save))
    assert (record["path"], record["steps"], record["complete"]) == ("step1/actor_rank0.pickle", [1, 1], True)
    with open(save / record["path"], "rb") as f:
        snapshot = pickle.load(f)
    assert any(e["action"] == "alloc" for trace in snapshot["device_traces"] for e in trace)
    assert "actor/update_actor" in str(snapshot["external_annotations"])
    last = read_metrics(os.path.join(tmp_path, "out", "metrics.jsonl"))[-1]
    assert last["perf/max_memory_allocated_gb"] > 0 and VAL_KEY in last
    assert last["training/rollout_logprob_diff_mean"] < 1e-3  # sampler and update agree on the GPU too


def test_cli_demo_config_pretrains_once_and_trains(tmp_path, capsys):
    assert main(["config", "show", "--config", "diffusion_demo"]) == 0
    assert "mode: diffusion" in capsys.readouterr().out
    tiny = [f"trainer.default_local_dir={tmp_path}", "trainer.total_training_steps=1", "trainer.test_freq=-1",
            "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "diffusion.pretrain_steps=3",
            "diffusion.model.width=16", "diffusion.model.depth=1", "trainer.logger=[]"]
    assert main(["train", "--no-progress", "--config", "diffusion_demo", *tiny]) == 0
    settings = json.loads((tmp_path / "demo_model" / "flow" / "settings.json").read_text())
    assert settings["steps"] == 3 and settings["model"]["width"] == 16
    assert [r["step"] for r in read_metrics(os.path.join(tmp_path, "metrics.jsonl"))] == [1]


@pytest.mark.parametrize("override, key", [("algorithm.adv_estimator=gae", "algorithm.adv_estimator"),
                                           ("diffusion.model_path=/nonexistent", "diffusion.model_path")])
def test_config_errors_name_the_key(tmp_path, pretrained_dir, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        driver.build(tiny_config(tmp_path, pretrained_dir, override), progress=False)
