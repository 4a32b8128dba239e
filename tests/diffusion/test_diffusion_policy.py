"""The flow model, the SDE sampler's log-probs and the policy workers, on a real pre-trained model."""

import json
import math

import pytest
import torch
from torch import nn

from plait.configtree import ConfigError, build
from plait.data.images import condition_split
from plait.workers.diffusion import (DiffusionActor, DiffusionActorConfig, DiffusionModelConfig, DiffusionRef,
                                     pretrain_flow_model, sample_with_logprobs, sde_std,
                                     step_logprob)


def test_configs_validate():
    with pytest.raises(ConfigError, match="depth"):
        DiffusionModelConfig(depth=0)
    with pytest.raises(ConfigError, match="sde_window_range"):
        build(DiffusionActorConfig, {"sde_window_size": 4, "sde_window_range": [0, 3]})
    cfg = build(DiffusionActorConfig, {"sde_window_range": [2, 8]})
    assert cfg.sde_window_range == (2, 8)


def test_sampler_logprobs_match_direct_gaussian_evaluation(model):
    cond = condition_split("val", 6)
    noise_level, steps = 0.7, 10
    generator = torch.Generator().manual_seed(0)
    traj = sample_with_logprobs(model, cond, steps, noise_level, generator, window=(2, 5))
    assert traj.latents.shape == (6, steps + 1, 1, 8, 8) and traj.log_probs.shape == (6, steps)
    with torch.no_grad():
        for i in range(steps):
            t, t_prev = traj.timesteps[i].item(), traj.timesteps[i + 1].item()
            x, x_prev = traj.latents[:, i], traj.latents[:, i + 1]
            v = model(x, torch.full((6,), t), cond)
            dt = t_prev - t
            if not 2 <= i < 5:  # ODE step, no log-prob
                assert torch.allclose(x_prev, x + v * dt, atol=1e-6)
                assert (traj.log_probs[:, i] == 0).all()
                continue
            sigma = noise_level * math.sqrt(t / (1 - t))
            mean = x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * dt
            gaussian = torch.distributions.Normal(mean, sigma * math.sqrt(-dt))
            direct = gaussian.log_prob(x_prev).mean(dim=(1, 2, 3))  # [B]
            assert torch.allclose(traj.log_probs[:, i], direct, atol=1e-5)
            again, _ = step_logprob(model, x, x_prev, t, t_prev, cond, noise_level)
            assert torch.allclose(traj.log_probs[:, i], again, atol=1e-5)
            assert not torch.allclose(x_prev, mean, atol=1e-3)  # the step really was noisy


def test_first_step_std_is_noise_level():
    assert sde_std(1.0, 0.9, 0.7)[1] == pytest.approx(0.7)
    sigma, std = sde_std(0.5, 0.4, 0.7)
    assert sigma == pytest.approx(0.7) and std == pytest.approx(0.7 * math.sqrt(0.1))


class _PointData(nn.Module):
    """Exact velocity when all data is the point 0: x_t = t * eps, so v = x_t / t."""

    cfg = DiffusionModelConfig(image_size=8)

    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(()))

    def forward(self, x, t, cond):
        return x / t[:, None, None, None]


def test_sde_keeps_the_flow_marginals():
    """With the exact velocity, SDE samples have std ~t at every t (a wrong drift sign diverges)."""
    traj = sample_with_logprobs(_PointData(), torch.zeros(2000, dtype=torch.long), 20, 0.7,
                                torch.Generator().manual_seed(0))
    stds = traj.latents.flatten(2).std(dim=(0, 2))  # [T+1]
    assert (stds - traj.timesteps).abs().max() < 0.08, stds


def test_ode_mode_is_deterministic(model):
    cond = condition_split("val", 8)
    a = sample_with_logprobs(model, cond, 10, 0.0, torch.Generator().manual_seed(3))
    b = sample_with_logprobs(model, cond, 10, 0.0, torch.Generator().manual_seed(3))
    assert torch.equal(a.latents, b.latents) and a.window == (0, 0) and (a.log_probs == 0).all()
    sde = [sample_with_logprobs(model, cond, 10, 0.7, torch.Generator().manual_seed(s)) for s in (3, 3, 4)]
    assert torch.equal(sde[0].latents, sde[1].latents) and not torch.equal(sde[0].latents, sde[2].latents)
    assert torch.equal(sde[0].latents[:, 0], a.latents[:, 0])  # same seed, same starting noise


def test_update_changes_parameters_and_logprobs(pretrained_dir, profiler):
    cfg = DiffusionActorConfig(sde_window_size=3, sde_window_range=(0, 10), lr=1e-3, kl_loss_coef=0.0)
    actor = DiffusionActor(pretrained_dir, cfg, profiler)
    model = actor.model
    cond = condition_split("train", 8)
    traj = actor.generate(cond, torch.Generator().manual_seed(0))
    assert traj.window[1] - traj.window[0] == 3
    old_logp = actor.compute_logprobs(traj)  # [B, K]
    assert torch.allclose(old_logp, traj.window_log_probs, atol=1e-5)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = actor.update(traj, torch.linspace(-1, 1, 8), old_logp)
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert not torch.allclose(actor.compute_logprobs(traj), old_logp, atol=1e-5)
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/pg_clipfrac"] == 0.0
    assert profiler.stages == ["gen", "old_log_prob", "update_actor", "old_log_prob"]


def test_kl_to_reference(pretrained_dir, profiler):
    ref = DiffusionRef(pretrained_dir, profiler)
    actor = DiffusionActor(pretrained_dir, DiffusionActorConfig(sde_window_size=2, kl_loss_coef=0.1, lr=1e-3),
                           profiler)
    cond, generator = condition_split("train", 8), torch.Generator().manual_seed(0)
    traj = actor.generate(cond, generator)
    with pytest.raises(ValueError, match="ref_mean"):
        actor.update(traj, torch.linspace(-1, 1, 8), traj.window_log_probs)
    first = actor.update(traj, torch.linspace(-1, 1, 8), traj.window_log_probs, ref.compute_means(traj))
    assert first["actor/kl_loss"] == 0.0  # policy still equals the reference
    traj = actor.generate(cond, generator)
    ref_mean = ref.compute_means(traj)  # [B, K, C, H, W]
    assert ref_mean.shape == (8, 2, 1, 8, 8) and not ref_mean.requires_grad
    second = actor.update(traj, torch.linspace(-1, 1, 8), traj.window_log_probs, ref_mean)
    assert second["actor/kl_loss"] > 0
    assert "ref" in profiler.stages


def test_checkpoint_round_trip(pretrained_dir, profiler, tmp_path):
    actor = DiffusionActor(pretrained_dir, DiffusionActorConfig(lr=1e-3, kl_loss_coef=0.0), profiler)
    traj = actor.generate(condition_split("train", 8), torch.Generator().manual_seed(0))
    actor.update(traj, torch.linspace(-1, 1, 8), traj.window_log_probs)
    fresh = DiffusionActor(pretrained_dir, DiffusionActorConfig(lr=1e-3), profiler)
    assert not torch.allclose(fresh.compute_logprobs(traj), actor.compute_logprobs(traj))
    actor.save_checkpoint(str(tmp_path / "actor"))
    fresh.load_checkpoint(str(tmp_path / "actor"))
    assert torch.equal(fresh.compute_logprobs(traj), actor.compute_logprobs(traj))
    assert fresh.optim.state_dict()["state"]  # Adam moments came along


def test_pretrain_is_cached(pretrained_dir, pretrain_settings, tmp_path):
    settings = json.loads((pretrained_dir / "settings.json").read_text())
    assert settings["steps"] == pretrain_settings["steps"] and settings["model"]["width"] == 128
    mtime = (pretrained_dir / "model.pt").stat().st_mtime_ns
    assert pretrain_flow_model(out_dir=pretrained_dir, **pretrain_settings) == pretrained_dir
    assert (pretrained_dir / "model.pt").stat().st_mtime_ns == mtime  # loaded, not retrained
    small = dict(pretrain_settings, steps=2, cfg=DiffusionModelConfig(width=16, depth=1))
    pretrain_flow_model(out_dir=tmp_path, **small)
    first = (tmp_path / "model.pt").stat().st_mtime_ns
    pretrain_flow_model(out_dir=tmp_path, **dict(small, seed=1))  # other settings: trains again
    assert (tmp_path / "model.pt").stat().st_mtime_ns != first
    assert json.loads((tmp_path / "settings.json").read_text())["seed"] == 1
