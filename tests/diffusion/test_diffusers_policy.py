"""A tiny diffusers SD3 transformer (built from a config, never downloaded) as the Flow-GRPO policy."""

import os

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("peft")

from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: E402

from plait import driver  # noqa: E402
from plait.config import load_config  # noqa: E402
from plait.configtree import ConfigError, build  # noqa: E402
from plait.data.images import condition_split  # noqa: E402
from plait.trainers.lifecycle import read_metrics  # noqa: E402
from plait.workers.diffusers_policy import (DiffusersVelocity, LoraConfig,  # noqa: E402
                                            create_tiny_diffusers_policy)
from plait.workers.diffusion import (DiffusionActor, DiffusionActorConfig, DiffusionRef, load_policy,  # noqa: E402
                                     sample_with_logprobs, step_logprob)

TINY = ["trainer.mode=diffusion", "data.train_size=16", "data.train_batch_size=4", "data.val_size=4",
        "actor_rollout_ref.rollout.n=4", "trainer.test_freq=-1", "trainer.logger=[]"]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    return create_tiny_diffusers_policy(tmp_path_factory.mktemp("sd3"), seed=0)


def tiny_config(out_dir, model_dir, *overrides):
    return load_config(None, [*TINY, f"trainer.default_local_dir={out_dir}", f"diffusion.model_path={model_dir}",
                              *overrides])


def test_folder_layout_and_seeded_creation(policy_dir, tmp_path):
    assert sorted(os.listdir(policy_dir)) == ["conditioning.pt", "plait_diffusers_policy.json", "transformer"]
    model = load_policy(policy_dir)
    assert isinstance(model, DiffusersVelocity) and model.cfg.num_classes == 10
    again = load_policy(create_tiny_diffusers_policy(tmp_path / "same", seed=0)).state_dict()
    other = load_policy(create_tiny_diffusers_policy(tmp_path / "other", seed=1)).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in model.state_dict().items())
    assert not all(torch.equal(v, other[k]) for k, v in model.state_dict().items())


def test_adapter_is_the_raw_transformer_and_samples_like_the_diffusers_scheduler(policy_dir):
    model, cond = load_policy(policy_dir), condition_split("val", 4)
    x, t = torch.randn(4, 1, 8, 8), torch.tensor([1.0, 0.7, 0.3, 0.05])
    with torch.no_grad():
        raw = model.transformer(hidden_states=x, timestep=1000 * t, encoder_hidden_states=model.tokens(cond)[:, None],
                                pooled_projections=model.pooled(cond), return_dict=False)[0]
        v = model(x, t, cond)  # [B, C, H, W]
    assert torch.equal(v, raw) and v.abs().mean() > 0.1

    # diffusers' own Euler loop with sigma = t (shift 1): same timesteps, same sign, same images.
    steps = 6
    traj = sample_with_logprobs(model, cond, steps, 0.0, torch.Generator().manual_seed(0))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    scheduler.set_timesteps(sigmas=torch.linspace(1, 0, steps + 1)[:-1].tolist())
    x = traj.latents[:, 0]  # the same starting noise
    with torch.no_grad():
        for timestep in scheduler.timesteps:
            noise_pred = model.transformer(hidden_states=x, timestep=timestep.expand(4),
                                           encoder_hidden_states=model.tokens(cond)[:, None],
                                           pooled_projections=model.pooled(cond), return_dict=False)[0]
            x = scheduler.step(noise_pred, timestep, x).prev_sample
    assert torch.allclose(traj.latents[:, -1], x, atol=1e-5)
    assert (traj.latents[:, -1] - traj.latents[:, 0]).abs().mean() > 0.1  # the velocity moved the sample


def test_sampler_logprobs_equal_step_logprob(policy_dir):
    model, cond = load_policy(policy_dir), condition_split("train", 6)
    traj = sample_with_logprobs(model, cond, 8, 0.7, torch.Generator().manual_seed(0), window=(1, 5))
    with torch.no_grad():
        for i in range(1, 5):
            t, t_prev = traj.timesteps[i].item(), traj.timesteps[i + 1].item()
            logp, _ = step_logprob(model, traj.latents[:, i], traj.latents[:, i + 1], t, t_prev, cond, 0.7)
            assert torch.allclose(logp, traj.log_probs[:, i], atol=1e-5)
    assert (traj.log_probs[:, 1:5] != 0).all() and (traj.log_probs[:, 5:] == 0).all()


def test_lora_config_and_actor(policy_dir, pretrained_dir, profiler):
    with pytest.raises(ConfigError, match="target_modules"):
        build(LoraConfig, {"enable": True, "target_modules": []})
    with pytest.raises(ValueError, match="diffusers"):
        load_policy(pretrained_dir, LoraConfig(enable=True))
    lora = LoraConfig(enable=True, r=4, alpha=8)
    actor = DiffusionActor(policy_dir, DiffusionActorConfig(sde_window_size=2, lr=1e-2), profiler, lora=lora)
    trainable = [n for n, p in actor.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable) and len(actor.params) == len(trainable)
    ref = DiffusionRef(policy_dir, profiler)
    assert not any("lora_" in n for n in ref.model.state_dict())
    traj = actor.generate(condition_split("train", 8), torch.Generator().manual_seed(0))
    # lora_B starts at zero: before any update the actor is exactly the base model, the reference.
    assert torch.allclose(ref.compute_means(traj), torch.stack(
        [step_logprob(actor.model, traj.latents[:, i], traj.latents[:, i + 1], traj.timesteps[i].item(),
                      traj.timesteps[i + 1].item(), traj.cond, traj.noise_level)[1] for i in range(*traj.window)], 1),
        atol=1e-6)


def _state(lifecycle):
    return {k: v.clone() for k, v in lifecycle.trainer.actor.call(DiffusionActor.state_dict)["model"].items()}


@pytest.mark.parametrize("lora", [False, True])
def test_driver_steps_change_parameters(tmp_path, policy_dir, lora):
    lifecycle = driver.build(tiny_config(tmp_path, policy_dir, "trainer.total_training_steps=2",
                                         f"diffusion.lora.enable={str(lora).lower()}", "diffusion.lora.r=4",
                                         "diffusion.actor.lr=1e-2"), progress=False)
    before = _state(lifecycle)
    lifecycle.run()
    after = _state(lifecycle)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    if lora:
        assert changed and all("lora_" in k for k in changed)  # base weights and class table untouched
        assert any("lora_B" in k for k in changed)
    else:
        assert any(k.startswith("transformer.transformer_blocks") for k in changed)
        assert "tokens.weight" in changed  # the class table trains too
    records = read_metrics(os.path.join(tmp_path, "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["training/rollout_logprob_diff_mean"] < 1e-5 and r["actor/kl_loss"] >= 0 for r in records)
    assert records[1]["actor/kl_loss"] > 0  # the ref (base model) and the updated actor differ


def test_lora_on_a_flow_model_folder_is_a_config_error(tmp_path, pretrained_dir):
    with pytest.raises(ConfigError, match=r"diffusion\.lora\.enable"):
        driver.build(tiny_config(tmp_path, pretrained_dir, "diffusion.lora.enable=true"), progress=False)


def test_lora_resume_reproduces_the_uninterrupted_run(tmp_path, policy_dir):
    full, part = tmp_path / "full", tmp_path / "part"
    common = ["trainer.save_freq=2", "diffusion.lora.enable=true", "diffusion.lora.r=4", "diffusion.actor.lr=1e-2"]
    for out, steps in ((full, 4), (part, 2), (part, 4)):
        driver.build(tiny_config(out, policy_dir, f"trainer.total_training_steps={steps}", *common),
                     progress=False).run()
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(("timing", "perf/", "memory/"))}  # noqa: E731
    a, b = read_metrics(os.path.join(full, "metrics.jsonl")), read_metrics(os.path.join(part, "metrics.jsonl"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert strip(a[3]) == pytest.approx(strip(b[3]), rel=1e-5, abs=1e-6)
    assert a[3]["actor/pg_loss"] != a[2]["actor/pg_loss"]
