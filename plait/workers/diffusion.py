"""The diffusion policy: a small conditional flow-matching model, its SDE sampler, and workers.

Flow matching (rectified flow). Data x0, noise eps ~ N(0, I), x_t = (1 - t) x0 + t eps for t in
[0, 1]; the model predicts the velocity v(x_t, t, c) = E[eps - x0 | x_t, c]. Sampling integrates
dx/dt = v from t = 1 (noise) down to t = 0 (image) over `num_steps` uniform steps.

Flow-GRPO needs a stochastic sampler with tractable per-step densities. Since x_t = x0 + t(eps - x0)
gives E[eps | x_t] = x_t + (1 - t) v, the score is s = -(x_t + (1 - t) v) / t, and the reverse-time
SDE with diffusion sigma_t that keeps the ODE's marginals is
    dx = [v + sigma_t^2 / (2t) (x + (1 - t) v)] dt + sigma_t dW,   dt < 0.
An Euler-Maruyama step from t to t_prev (dt = t_prev - t < 0) is therefore Gaussian:
    x_prev ~ N(mean, std^2),  mean = x + [v + sigma_t^2 / (2t) (x + (1 - t) v)] dt,
                              std  = sigma_t sqrt(-dt),
with sigma_t = noise_level * sqrt(t / (1 - t)); at t = 1 the (1 - t) is replaced by -dt (so the
first step's std is exactly noise_level). noise_level = 0 is the deterministic ODE (evaluation).
A step's log-prob is the Gaussian log-density of x_prev averaged (not summed) over latent dims,
so it does not grow with the image size; Flow-GRPO's tiny clip range and the KL on means
(plait/algorithms/flow_grpo.py) are per-dimension on the same scale.

Training window: only the steps [start, start + sde_window_size) are stochastic and trained; the
others run as ODE. The window start is drawn per batch from `sde_window_range`, so early (coarse
layout) and later steps both get trained while each update costs K << T model passes.

Here: DiffusionModelConfig, FlowModel, pretrain_flow_model / load_flow_model, load_policy (a
FlowModel folder, a diffusers policy, plait/workers/diffusers_policy.py, or a text-to-image
pipeline, plait/workers/diffusion_pipeline.py), the sampler and step_logprob, Trajectory, the
workers DiffusionActor (rollout + update, colocated; with a pipeline it also encodes prompts and
decodes images; with LoRA it is its own reference, adapters off) and DiffusionRef (a frozen copy's
means for the KL of a full fine-tune), and DiffusionConfig, the `diffusion` node of the config
tree. Not here: the step loop (plait/trainers/diffusion.py), advantages and losses
(plait/algorithms/flow_grpo.py), conditions and rewards (plait/data/images.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from plait.algorithms.flow_grpo import flow_grpo_loss, mean_kl
from plait.configtree import check
from plait.data.images import NUM_GLYPHS, render_glyphs
from plait.safeload import load_tensors
from plait.workers.diffusion_config import DiffusionActorConfig, DiffusionConfig, DiffusionModelConfig  # noqa: F401
from plait.workers.diffusers_policy import (DiffusersPolicyConfig, LoraConfig, diffusers_policy_config,
                                            is_diffusers_policy, load_diffusers_policy)
from plait.workers.diffusion_pipeline import (PipelineConfig, PipelinePolicy, PromptEmbeds, load_pipeline_policy,
                                              pipeline_class)


class _Block(nn.Module):
    """Pre-norm residual MLP block whose norm is scaled and shifted by the (time, label) embedding."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width, elementwise_affine=False)
        self.modulation = nn.Linear(width, 2 * width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.SiLU(), nn.Linear(2 * width, width))

    def forward(self, h: Tensor, emb: Tensor) -> Tensor:
        scale, shift = self.modulation(emb).chunk(2, dim=-1)  # [B, width] each
        return h + self.mlp(self.norm(h) * (1 + scale) + shift)


class FlowModel(nn.Module):
    """Velocity predictor v(x_t, t, label): an MLP over flattened pixels with adaLN-style conditioning."""

    def __init__(self, cfg: DiffusionModelConfig):
        super().__init__()
        self.cfg = cfg
        pixels = cfg.channels * cfg.image_size**2
        self.inp = nn.Linear(pixels, cfg.width)
        self.time = nn.Sequential(nn.Linear(cfg.width, cfg.width), nn.SiLU(), nn.Linear(cfg.width, cfg.width))
        self.label = nn.Embedding(cfg.num_classes, cfg.width)
        self.blocks = nn.ModuleList(_Block(cfg.width) for _ in range(cfg.depth))
        self.out = nn.Sequential(nn.LayerNorm(cfg.width), nn.Linear(cfg.width, pixels))

    def forward(self, x: Tensor, t: Tensor, cond: Tensor) -> Tensor:
        half = self.cfg.width // 2
        freqs = torch.exp(-math.log(1e4) * torch.arange(half, device=x.device) / half)  # [half]
        angles = 1000 * t[:, None] * freqs  # [B, half]
        t_feat = torch.cat([angles.sin(), angles.cos()], dim=-1)  # [B, 2*half]
        t_feat = nn.functional.pad(t_feat, (0, self.cfg.width - 2 * half))  # [B, width] for odd widths
        emb = self.time(t_feat) + self.label(cond)  # [B, width]
        h = self.inp(x.flatten(1))  # [B, width]
        for block in self.blocks:
            h = block(h, emb)
        return self.out(h).view_as(x)  # [B, C, H, W]


def pretrain_flow_model(cfg: DiffusionModelConfig, steps: int, batch_size: int, lr: float, seed: int,
                        out_dir: str | Path) -> Path:
    """Flow-matching pre-training on procedural glyphs; returns `out_dir` holding the model.

    Cached: `out_dir/settings.json` records every argument and is written last, so a second call
    with the same settings loads nothing and trains nothing. A few hundred steps give recognisable
    but imperfect samples, which leaves room for RL.
    """
    out = Path(out_dir)
    settings = {"model": dataclasses.asdict(cfg), "steps": steps, "batch_size": batch_size, "lr": lr,
                "seed": seed}
    settings_file = out / "settings.json"
    if settings_file.exists() and json.loads(settings_file.read_text()) == settings:
        return out
    check(cfg.num_classes <= NUM_GLYPHS, "num_classes", cfg.num_classes,
          f"at most {NUM_GLYPHS}: pre-training draws one procedural glyph per class")
    out.mkdir(parents=True, exist_ok=True)
    settings_file.unlink(missing_ok=True)  # a crash below must not leave old settings beside a new model
    with torch.random.fork_rng():
        torch.manual_seed(seed)  # parameter init
        model = FlowModel(cfg)
    generator = torch.Generator().manual_seed(seed)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        labels = torch.randint(0, cfg.num_classes, (batch_size,), generator=generator)  # [B]
        x0 = render_glyphs(labels, cfg.image_size, cfg.channels, generator)  # [B, C, H, W]
        eps = torch.randn(x0.shape, generator=generator)  # [B, C, H, W]
        t = torch.rand(batch_size, generator=generator)  # [B]
        x_t = (1 - t[:, None, None, None]) * x0 + t[:, None, None, None] * eps
        loss = ((model(x_t, t, labels) - (eps - x0)) ** 2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
    torch.save(model.state_dict(), out / "model.pt")
    settings_file.write_text(json.dumps(settings, indent=1))
    return out


def flow_model_config(path: str | Path) -> DiffusionModelConfig:
    """The architecture recorded beside the model `pretrain_flow_model` saved in `path`."""
    return DiffusionModelConfig(**json.loads((Path(path) / "settings.json").read_text())["model"])


def load_flow_model(path: str | Path) -> FlowModel:
    """The model `pretrain_flow_model` saved in `path` (CPU, float32)."""
    model = FlowModel(flow_model_config(path))
    model.load_state_dict(load_tensors(str(Path(path) / "model.pt"), map_location="cpu"))
    return model


def policy_config(path: str | Path) -> DiffusionModelConfig | DiffusersPolicyConfig:
    """The image shape and number of classes (and more, per kind) recorded in a policy folder."""
    return diffusers_policy_config(path) if is_diffusers_policy(path) else flow_model_config(path)


def load_policy(path: str | Path, lora: LoraConfig | None = None, pipeline: PipelineConfig | None = None,
                device: str = "cpu") -> nn.Module:
    """The velocity model in `path`: a diffusers pipeline folder (model_index.json), a diffusers policy
    folder (with LoRA if `lora.enable`) or plait's FlowModel."""
    if pipeline_class(path) is not None:
        return load_pipeline_policy(path, pipeline or PipelineConfig(), lora, device)
    if is_diffusers_policy(path):
        return load_diffusers_policy(path, lora)
    if lora is not None and lora.enable:
        raise ValueError(f"LoRA needs a diffusers policy folder; {path} holds a FlowModel")
    return load_flow_model(path)


# --- the SDE sampler -------------------------------------------------------------------------

@dataclass
class Trajectory:
    """One batch of sampled trajectories: what rollout hands to the update."""

    latents: Tensor  # [B, T+1, C, H, W]; latents[:, 0] is the noise at t = 1, latents[:, T] the image
    log_probs: Tensor  # [B, T]; log-prob of step i's transition, 0 where step i ran as ODE
    timesteps: Tensor  # [T+1]; from 1 down to 0
    cond: Tensor | PromptEmbeds  # [B] class ids, or a pipeline's prompt embeddings
    window: tuple[int, int]  # steps [start, end) that ran as SDE; (0, 0) for ODE sampling
    noise_level: float
    decoded: Tensor | None = None  # [B, 3, H, W] in [0, 1]: a pipeline's VAE output; None: the latents are the images

    @property
    def images(self) -> Tensor:
        if self.decoded is not None:
            return self.decoded
        return self.latents[:, -1].clamp(-1, 1)  # [B, C, H, W]

    @property
    def window_log_probs(self) -> Tensor:
        return self.log_probs[:, self.window[0]:self.window[1]]  # [B, K]


def sde_std(t: float, t_prev: float, noise_level: float) -> tuple[float, float]:
    """(sigma_t, transition std sigma_t * sqrt(-dt)) of the step from t to t_prev < t."""
    dt = t_prev - t
    sigma = noise_level * math.sqrt(t / (1 - t if t < 1 else -dt))  # 1 - t is 0 at t = 1: use -dt there
    return sigma, sigma * math.sqrt(-dt)


def _transition(model: nn.Module, x: Tensor, t: float, t_prev: float, cond: Tensor,
                noise_level: float) -> tuple[Tensor, float]:
    """Mean and std of x_prev given x at t; std 0 is the ODE step."""
    v = model(x, torch.full((x.shape[0],), t, device=x.device), cond)  # [B, C, H, W]
    dt = t_prev - t
    if noise_level == 0:
        return x + v * dt, 0.0
    sigma, std = sde_std(t, t_prev, noise_level)
    return x + (v + sigma**2 / (2 * t) * (x + (1 - t) * v)) * dt, std


def _gaussian_logprob(x: Tensor, mean: Tensor, std: float) -> Tensor:
    """log N(x; mean, std^2) averaged over the latent dims.  # [B]"""
    logp = -((x - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return logp.flatten(1).mean(1)


@torch.no_grad()
def sample_with_logprobs(model: nn.Module, cond: Tensor | PromptEmbeds, num_steps: int, noise_level: float,
                         generator: torch.Generator, window: tuple[int, int] | None = None,
                         shift: float = 1.0) -> Trajectory:
    """Sample images for conditions `cond` (B of them); steps in `window` (all if None) are SDE steps.

    `model` is any velocity module v(x, t, cond) with `.cfg.image_size` and `.cfg.channels`
    (FlowModel, DiffusersVelocity, PipelinePolicy). The time grid is uniform in s, mapped to
    t = shift s / (1 + (shift - 1) s) (diffusers' time shift; 1 keeps it uniform).

    `generator` is a CPU generator; it draws the initial noise first, so ODE and SDE runs with
    equally seeded generators start from the same noise. noise_level = 0 samples the ODE.
    """
    cfg = model.cfg
    device = next(model.parameters()).device
    shape = (len(cond), cfg.channels, cfg.image_size, cfg.image_size)
    cond = cond.to(device)
    x = torch.randn(shape, generator=generator).to(device)  # [B, C, H, W]
    s = torch.linspace(1, 0, num_steps + 1, dtype=torch.float64)  # [T+1]
    timesteps = (shift * s / (1 + (shift - 1) * s)).float()  # [T+1]
    start, end = (0, num_steps) if window is None else window
    if noise_level == 0:
        start = end = 0
    latents, log_probs = [x], torch.zeros(shape[0], num_steps, device=device)  # [B, T]
    for i in range(num_steps):
        t, t_prev = timesteps[i].item(), timesteps[i + 1].item()
        sde = start <= i < end
        mean, std = _transition(model, x, t, t_prev, cond, noise_level if sde else 0.0)
        x = mean
        if sde:
            x = mean + std * torch.randn(shape, generator=generator).to(device)
            log_probs[:, i] = _gaussian_logprob(x, mean, std)
        latents.append(x)
    return Trajectory(torch.stack(latents, dim=1), log_probs, timesteps, cond, (start, end), noise_level)


def step_logprob(model: nn.Module, x_t: Tensor, x_prev: Tensor, t: float, t_prev: float, cond: Tensor,
                 noise_level: float) -> tuple[Tensor, Tensor]:
    """Log-prob [B] of the recorded SDE transition x_t -> x_prev under `model`, and its mean.

    Differentiable: the update calls it with gradients on. Same arithmetic as the sampler, so for
    the same parameters it returns the sampler's log-probs.
    """
    mean, std = _transition(model, x_t, t, t_prev, cond, noise_level)  # [B, C, H, W]
    return _gaussian_logprob(x_prev, mean, std), mean


# --- workers -----------------------------------------------------------------------------------

class DiffusionActor:
    """Policy worker: samples trajectories with log-probs and runs the Flow-GRPO update.

    Built from a model folder (`backend.spawn("actor", DiffusionActor, path, cfg, device=...)`),
    so a backend can construct it wherever the role lives. Stages are annotated with verl's
    names (gen, old_log_prob, update_actor) on the `profiler` handle the session gives the role.
    """

    def __init__(self, model_path: str | Path, cfg: DiffusionActorConfig, profiler, device: str = "cpu",
                 lora: LoraConfig | None = None, pipeline: PipelineConfig | None = None):
        self.model = load_policy(model_path, lora, pipeline, device).to(device)
        # A pipeline encodes prompts and decodes latents around the sampler; None: conditions are class ids.
        self.pipeline = self.model if isinstance(self.model, PipelinePolicy) else None
        self.cfg, self.profiler = cfg, profiler
        # With LoRA only the adapters require grad; the optimizer (and a checkpoint) holds nothing else.
        self.trainable = {name for name, p in self.model.named_parameters() if p.requires_grad}
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optim = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)

    def generate(self, cond: Tensor | list[str], generator: torch.Generator, ode: bool = False) -> Trajectory:
        """SDE rollout with a window drawn from `generator`; `ode` samples deterministically (validation).

        `cond`: class ids [B], or B prompts for a pipeline (encoded here; cached when `ode`, since
        validation prompts repeat, and decoded by the VAE into `Trajectory.decoded`)."""
        with self.profiler.annotate("gen"):
            cfg, shift = self.cfg, 1.0
            if self.pipeline is not None:  # encode and decode get their own ranges: memory peaks show per part
                with self.profiler.annotate("encode"):
                    cond, shift = self.pipeline.encode(cond, cache=ode), self.pipeline.cfg.shift
            window, noise_level = None, cfg.noise_level
            if ode:
                noise_level = 0.0
            elif cfg.sde_window_size > 0:
                lo, hi = cfg.sde_window_range
                start = lo + int(torch.randint(hi - lo - cfg.sde_window_size + 1, (1,), generator=generator))
                window = (start, start + cfg.sde_window_size)
            traj = sample_with_logprobs(self.model, cond, cfg.num_inference_steps, noise_level, generator, window,
                                        shift)
            if self.pipeline is not None:
                with self.profiler.annotate("decode"):
                    traj.decoded = self.pipeline.decode(traj.latents[:, -1])
            return traj

    def compute_logprobs(self, traj: Trajectory) -> Tensor:
        """Log-probs [B, K] of the window's transitions under the current parameters."""
        with self.profiler.annotate("old_log_prob"), torch.no_grad():
            return torch.stack([logp for logp, _ in _window_steps(self.model, traj)], dim=1)

    def compute_ref_means(self, traj: Trajectory) -> Tensor:
        """With LoRA the reference is this model with its adapters off (no second copy): its means
        [B, K, C, H, W] of the window's transitions, as DiffusionRef.compute_means."""
        with self.profiler.annotate("ref"), torch.no_grad():
            self.model.transformer.disable_adapters()
            try:
                return torch.stack([mean for _, mean in _window_steps(self.model, traj)], dim=1)
            finally:
                self.model.transformer.enable_adapters()

    def update(self, traj: Trajectory, advantages: Tensor, old_logp: Tensor,
               ref_mean: Tensor | None = None) -> dict[str, float]:
        """`ppo_epochs` optimizer steps on the window; ref_mean [B, K, C, H, W] adds the KL term."""
        with self.profiler.annotate("update_actor", scheduled=True):
            cfg = self.cfg
            if cfg.kl_loss_coef > 0 and ref_mean is None:
                raise ValueError("kl_loss_coef > 0 needs ref_mean from DiffusionRef.compute_means")
            k_steps = traj.window[1] - traj.window[0]
            if k_steps == 0:
                raise ValueError("the trajectory has no SDE steps to train (sampled with ode=True?)")
            totals = {"pg_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "kl_loss": 0.0}
            for epoch in range(cfg.ppo_epochs):  # one optimizer step each: the schedule's mini-batch
                with self.profiler.mini_batch(epoch):
                    self.optim.zero_grad()
                    # One backward per denoising step keeps only one step's graph alive.
                    for k, (logp, mean) in enumerate(_window_steps(self.model, traj)):
                        loss, metrics = flow_grpo_loss(logp[:, None], old_logp[:, k:k + 1], advantages,
                                                       cfg.clip_ratio, cfg.adv_clip_max)
                        if ref_mean is not None:
                            i = traj.window[0] + k
                            _, std = sde_std(traj.timesteps[i].item(), traj.timesteps[i + 1].item(),
                                             traj.noise_level)
                            kl = mean_kl(mean, ref_mean[:, k], std).mean()
                            loss = loss + cfg.kl_loss_coef * kl
                            metrics["kl_loss"] = kl.item()
                        (loss / k_steps).backward()
                        for key, value in metrics.items():
                            totals[key] += value / (k_steps * cfg.ppo_epochs)
                    grad_norm = nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
                    self.optim.step()
            out = {f"actor/{key}": value for key, value in totals.items()}
            return out | {"actor/grad_norm": grad_norm.item(), "actor/lr": self.optim.param_groups[0]["lr"]}

    def state_dict(self) -> dict:
        """What trains (the adapters under LoRA, else every parameter) and the optimizer; frozen weights
        come from model_path again on load."""
        model = {k: v for k, v in self.model.state_dict().items() if k in self.trainable}
        return {"model": model, "optimizer": self.optim.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        if unexpected or self.trainable & set(missing):
            raise ValueError(f"checkpoint does not match the model: unexpected {unexpected[:5]}, "
                             f"missing {sorted(self.trainable & set(missing))[:5]}")
        self.optim.load_state_dict(state["optimizer"])

    def save_checkpoint(self, path: str) -> None:
        """Model and optimizer into folder `path` (the worker writes its own files, wherever it runs)."""
        os.makedirs(path, exist_ok=True)
        torch.save(self.state_dict(), os.path.join(path, "model_and_optimizer.pt"))

    def load_checkpoint(self, path: str) -> None:
        device = next(self.model.parameters()).device
        self.load_state_dict(load_tensors(os.path.join(path, "model_and_optimizer.pt"), map_location=device))


class DiffusionRef:
    """Frozen copy of the initial policy: its predicted means on recorded transitions, for the KL.

    Only for full fine-tuning, where a copy is the only way to keep the initial weights; with LoRA
    the actor is its own reference (DiffusionActor.compute_ref_means, adapters off).
    """

    def __init__(self, model_path: str | Path, profiler, device: str = "cpu", pipeline: PipelineConfig | None = None):
        self.model = load_policy(model_path, None, pipeline, device).to(device).requires_grad_(False)
        self.profiler = profiler

    def compute_means(self, traj: Trajectory) -> Tensor:
        """Reference means [B, K, C, H, W] of the window's transitions."""
        with self.profiler.annotate("ref"), torch.no_grad():
            return torch.stack([mean for _, mean in _window_steps(self.model, traj)], dim=1)


def _window_steps(model: nn.Module, traj: Trajectory):
    """(log-prob [B], mean [B, C, H, W]) of each window step of `traj` under `model`, in order."""
    for i in range(*traj.window):
        t, t_prev = traj.timesteps[i].item(), traj.timesteps[i + 1].item()
        yield step_logprob(model, traj.latents[:, i], traj.latents[:, i + 1], t, t_prev, traj.cond,
                           traj.noise_level)
