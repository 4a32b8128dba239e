"""A diffusers flow-matching transformer as plait's diffusion policy, with optional LoRA (peft).

`DiffusersVelocity` wraps an `SD3Transformer2DModel` behind the seam the sampler and the workers
use: `model(x [B,C,H,W], t [B], cond [B] class ids) -> v [B,C,H,W]`, with `.cfg.image_size`,
`.cfg.channels`, `.cfg.num_classes`. Conventions (checked against FlowMatchEulerDiscreteScheduler
in tests/diffusion/test_diffusers_policy.py):
  - plait's x_t = (1 - t) x0 + t eps is the scheduler's `scale_noise` with sigma = t;
  - the transformer's timestep input is 1000 * t (the scheduler's num_train_timesteps * sigma);
  - its output is the velocity eps - x0 that the scheduler steps with x + (sigma_next - sigma) * v,
    i.e. plait's v with the same sign: no conversion besides the timestep scale.
The transformer works directly on x: the "latent" is the image itself (8x8x1 glyphs by default),
so there is no VAE. Conditions are class ids; a learned table per class gives the transformer's
text inputs (encoder_hidden_states [B, seq_len, joint_attention_dim] and pooled_projections
[B, pooled_projection_dim]), so there is no text encoder either.

A policy folder (`save_diffusers_policy`, `create_tiny_diffusers_policy`):
    plait_diffusers_policy.json   DiffusersPolicyConfig; written last, it marks the folder
    transformer/                  SD3Transformer2DModel.save_pretrained (config.json, safetensors)
    conditioning.pt               the class table's state dict
Not here: whole text-to-image pipelines with text encoders, VAE and classifier-free guidance
(plait/workers/diffusion_pipeline.py), other transformer classes (Flux's takes packed latents and
image ids), and the step loop and sampler (plait/workers/diffusion.py). diffusers and peft are imported only when a folder is loaded or
created, so plait runs without them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from plait.configtree import check
from plait.safeload import load_tensors
from plait.workers.diffusion_config import LoraConfig  # noqa: F401  (its config node, torch-free)

POLICY_FILE = "plait_diffusers_policy.json"
TIMESTEP_SCALE = 1000.0
"""diffusers' flow-matching transformers take sigma * num_train_timesteps (1000) as the timestep."""


@dataclass
class DiffusersPolicyConfig:
    """What the adapter adds to the transformer's own config.json."""

    image_size: int = 8
    channels: int = 1
    num_classes: int = 10
    seq_len: int = 1
    """Condition tokens per class fed as encoder_hidden_states."""

    def __post_init__(self):
        check(self.image_size >= 1, "image_size", self.image_size, "an integer >= 1")
        check(self.channels >= 1, "channels", self.channels, "an integer >= 1")
        check(self.num_classes >= 1, "num_classes", self.num_classes, "an integer >= 1")
        check(self.seq_len >= 1, "seq_len", self.seq_len, "an integer >= 1")


class DiffusersVelocity(nn.Module):
    """v(x_t, t, class) from a diffusers SD3 transformer and a learned per-class conditioning table."""

    def __init__(self, transformer: nn.Module, cfg: DiffusersPolicyConfig):
        super().__init__()
        tc = transformer.config
        check(tc.in_channels == cfg.channels and tc.out_channels == cfg.channels, "transformer.in/out_channels",
              [tc.in_channels, tc.out_channels], f"both {cfg.channels}: the transformer works on the image itself")
        self.transformer, self.cfg = transformer, cfg
        self.tokens = nn.Embedding(cfg.num_classes, cfg.seq_len * tc.joint_attention_dim)
        self.pooled = nn.Embedding(cfg.num_classes, tc.pooled_projection_dim)

    def forward(self, x: Tensor, t: Tensor, cond: Tensor) -> Tensor:
        tokens = self.tokens(cond).view(len(cond), self.cfg.seq_len, -1)  # [B, seq_len, joint_attention_dim]
        return self.transformer(hidden_states=x, timestep=TIMESTEP_SCALE * t, encoder_hidden_states=tokens,
                                pooled_projections=self.pooled(cond), return_dict=False)[0]  # [B, C, H, W]


def is_diffusers_policy(path: str | Path) -> bool:
    return (Path(path) / POLICY_FILE).is_file()


def diffusers_policy_config(path: str | Path) -> DiffusersPolicyConfig:
    return DiffusersPolicyConfig(**json.loads((Path(path) / POLICY_FILE).read_text()))


def save_diffusers_policy(model: DiffusersVelocity, path: str | Path) -> Path:
    """Write `model` as a policy folder (see the module docstring); returns `path`."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / POLICY_FILE).unlink(missing_ok=True)  # a crash below must not leave a marker beside old weights
    model.transformer.save_pretrained(out / "transformer")
    torch.save({"tokens": model.tokens.state_dict(), "pooled": model.pooled.state_dict()}, out / "conditioning.pt")
    (out / POLICY_FILE).write_text(json.dumps(dataclasses.asdict(model.cfg), indent=1))
    return out


def load_diffusers_policy(path: str | Path, lora: LoraConfig | None = None) -> DiffusersVelocity:
    """The policy in folder `path` (local files only, CPU, float32); `lora.enable` adds trainable adapters
    and freezes everything else, the class table included."""
    from diffusers import SD3Transformer2DModel  # optional dependency: only for diffusers folders

    path = Path(path)
    transformer = SD3Transformer2DModel.from_pretrained(path / "transformer", local_files_only=True)
    model = DiffusersVelocity(transformer, diffusers_policy_config(path))
    table = load_tensors(str(path / "conditioning.pt"), map_location="cpu")
    model.tokens.load_state_dict(table["tokens"])
    model.pooled.load_state_dict(table["pooled"])
    if lora is not None and lora.enable:
        model.requires_grad_(False)
        add_lora(transformer, lora)
    return model


def add_lora(transformer: nn.Module, lora: LoraConfig) -> None:
    """Trainable peft adapters on `lora.target_modules` of a diffusers transformer (its other weights
    untouched). lora_B starts at zero, so the adapted model starts exactly at the base; lora_A is
    random from a fixed seed, so every load (a resumed run's too) starts alike."""
    import peft  # optional dependency

    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformer.add_adapter(peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, target_modules=list(lora.target_modules)))


def create_tiny_diffusers_policy(path: str | Path, seed: int = 0, num_classes: int = 10, image_size: int = 8,
                                 channels: int = 1, patch_size: int = 2, num_layers: int = 2, head_dim: int = 8,
                                 heads: int = 2, seq_len: int = 1) -> Path:
    """A randomly initialised SD3 transformer (about 22k parameters with the defaults) as a policy
    folder, for tests and demos: built from a config, never downloaded; the same seed gives the same
    weights."""
    from diffusers import SD3Transformer2DModel  # optional dependency

    width = heads * head_dim
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        transformer = SD3Transformer2DModel(
            sample_size=image_size, patch_size=patch_size, in_channels=channels, out_channels=channels,
            num_layers=num_layers, attention_head_dim=head_dim, num_attention_heads=heads,
            joint_attention_dim=width, caption_projection_dim=width, pooled_projection_dim=width,
            pos_embed_max_size=image_size // patch_size)
        model = DiffusersVelocity(transformer, DiffusersPolicyConfig(image_size, channels, num_classes, seq_len))
    return save_diffusers_policy(model, path)
