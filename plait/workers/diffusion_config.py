"""The diffusion trainer's config nodes (`diffusion.*`), apart from the torch code they configure.

plait.config reads them to build and check the tree, so they import no torch: a config error is
reported before torch loads. The workers (diffusion.py, diffusers_policy.py, diffusion_pipeline.py)
re-export them under their old names; the image reward tables in plait/data/images.py assert that
they implement exactly the names listed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from plait.configtree import check

NUM_GLYPHS = 10  # the built-in glyph set's size (plait/data/images.py draws them)
IMAGE_REWARD_NAMES = ("glyph_classifier", "glyph_template", "brightness", "contrast")
PROMPT_IMAGE_REWARD_NAMES = ("jpeg_compressibility", "jpeg_incompressibility")


@dataclass
class LoraConfig:
    """`diffusion.lora`: peft LoRA on the diffusers transformer; only the adapters train."""

    enable: bool = False
    r: int = 8
    alpha: float = 16.0
    target_modules: list[str] = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    """Module names (suffixes) inside the transformer; the default is every attention projection
    of the image stream."""

    def __post_init__(self):
        check(self.r >= 1, "r", self.r, "an integer >= 1")
        check(self.alpha > 0, "alpha", self.alpha, "a number > 0")
        check(len(self.target_modules) > 0, "target_modules", self.target_modules, "a non-empty list of module names")


@dataclass
class PipelineConfig:
    """`diffusion.pipeline`: how a pipeline folder (diffusion.model_path) samples and where its parts live."""

    guidance_scale: float = 4.5
    """Classifier-free guidance g; <= 1 runs the conditional branch only (no negative prompt)."""
    negative_prompt: str = ""
    resolution: int | None = None
    """Image side in pixels; null: the transformer's sample_size x the VAE's scale factor."""
    max_sequence_length: int = 128
    """T5 tokens per prompt (SD3's third text encoder)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Of the frozen parts (text encoders, VAE, the transformer's base weights under LoRA); what
    trains stays float32."""
    offload: bool = False
    """Keep the text encoders and the VAE on the CPU and move each to the device only while it runs."""

    def __post_init__(self):
        check(self.guidance_scale >= 0, "guidance_scale", self.guidance_scale, "a number >= 0")
        check(self.resolution is None or self.resolution >= 8, "resolution", self.resolution, "null or an integer >= 8")
        check(self.max_sequence_length >= 1, "max_sequence_length", self.max_sequence_length, "an integer >= 1")


@dataclass
class DiffusionModelConfig:
    image_size: int = 8
    """Side of the square image, in pixels."""
    channels: int = 1
    width: int = 128
    """Hidden width of the MLP blocks."""
    depth: int = 2
    """Number of residual blocks."""
    num_classes: int = NUM_GLYPHS
    """Number of condition labels."""

    def __post_init__(self):
        check(self.image_size >= 4, "image_size", self.image_size, "an integer >= 4")
        check(self.channels >= 1, "channels", self.channels, "an integer >= 1")
        check(self.width >= 8, "width", self.width, "an integer >= 8")
        check(self.depth >= 1, "depth", self.depth, "an integer >= 1")
        check(self.num_classes >= 1, "num_classes", self.num_classes, "an integer >= 1")


@dataclass
class DiffusionActorConfig:
    """Sampler and Flow-GRPO update settings; verl's key names where verl has the knob.

    The defaults are the built-in demo's (8x8 glyphs, classifier reward), tuned on CPU.
    """

    num_inference_steps: int = 10
    noise_level: float = 1.0
    """Scales sigma_t; 0 would make the sampler deterministic (no log-probs)."""
    sde_window_size: int = 4
    """Trained (stochastic) denoising steps per sample; 0 makes every step stochastic and trained."""
    sde_window_range: tuple[int, int] = (0, 10)
    """The window lies inside steps [lo, hi); its start is drawn per batch."""
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_ratio: float = 1e-4
    adv_clip_max: float = 5.0
    kl_loss_coef: float = 0.01
    """Weight of the KL to the reference means; > 0 needs ref_mean in update() (the trainer then
    runs the ref role)."""
    ppo_epochs: int = 1

    def __post_init__(self):
        self.sde_window_range = tuple(self.sde_window_range)
        check(len(self.sde_window_range) == 2, "sde_window_range", list(self.sde_window_range),
              "[lo, hi]: two step indices")
        steps, size, (lo, hi) = self.num_inference_steps, self.sde_window_size, self.sde_window_range
        check(steps >= 1, "num_inference_steps", steps, "an integer >= 1")
        check(self.noise_level > 0, "noise_level", self.noise_level, "a number > 0")
        check(0 <= size <= steps, "sde_window_size", size, f"an integer in [0, num_inference_steps={steps}]")
        check(size == 0 or 0 <= lo and hi <= steps and hi - lo >= size, "sde_window_range",
              list(self.sde_window_range), f"[lo, hi] with 0 <= lo, hi <= {steps}, hi - lo >= {size}")
        check(self.lr > 0, "lr", self.lr, "a number > 0")
        check(self.grad_clip > 0, "grad_clip", self.grad_clip, "a number > 0")
        check(self.clip_ratio > 0, "clip_ratio", self.clip_ratio, "a number > 0")
        check(self.adv_clip_max > 0, "adv_clip_max", self.adv_clip_max, "a number > 0")
        check(self.kl_loss_coef >= 0, "kl_loss_coef", self.kl_loss_coef, "a number >= 0")
        check(self.ppo_epochs >= 1, "ppo_epochs", self.ppo_epochs, "an integer >= 1")


@dataclass
class DiffusionConfig:
    """The `diffusion` node, read with trainer.mode=diffusion: the policy, its pre-training, the reward.

    The batch and schedule come from the shared keys: data.train_batch_size conditions x
    actor_rollout_ref.rollout.n samples per step, data.train_size / data.val_size conditions,
    trainer.*; profiling from actor_rollout_ref.{actor,ref}.profiler (roles "actor" and "ref").
    The LM update keys (actor_rollout_ref.actor.optim, clip_ratio, ...) do not apply: the
    Flow-GRPO update's own are under `actor`, because its clip range and lr live on another scale.
    """

    model_path: Optional[str] = None
    """A folder saved by pretrain_flow_model, or a diffusers policy folder
    (plait/workers/diffusers_policy.py); null: the built-in glyph model, pre-trained once and
    cached in <output_dir>/demo_model/flow."""
    model: DiffusionModelConfig = field(default_factory=DiffusionModelConfig)
    """The built-in model's architecture (a model_path folder records its own)."""
    pretrain_steps: int = 50
    pretrain_batch_size: int = 128
    pretrain_lr: float = 2e-3
    reward: str = "glyph_classifier"
    """A name in plait.data.images.IMAGE_REWARDS (class-conditioned models) or, for a pipeline,
    PROMPT_IMAGE_REWARDS or clip_score; custom_reward_function.path replaces it."""
    reward_model_path: Optional[str] = None
    """The local CLIP folder reward=clip_score scores with."""
    actor: DiffusionActorConfig = field(default_factory=DiffusionActorConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA on a diffusers model_path's transformer (enable: false trains every parameter)."""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """Guidance, negative prompt, resolution, dtype and offload of a pipeline model_path
    (plait/workers/diffusion_pipeline.py); prompts come from data.train_files / data.val_files."""

    def __post_init__(self):
        check(self.pretrain_steps >= 0, "pretrain_steps", self.pretrain_steps, "an integer >= 0")
        check(self.pretrain_batch_size >= 1, "pretrain_batch_size", self.pretrain_batch_size, "an integer >= 1")
        check(self.pretrain_lr > 0, "pretrain_lr", self.pretrain_lr, "a number > 0")
        names = [*IMAGE_REWARD_NAMES, *PROMPT_IMAGE_REWARD_NAMES, "clip_score"]
        check(self.reward in names, "reward", self.reward, f"one of {', '.join(names)}")
        check(self.reward != "clip_score" or self.reward_model_path is not None, "reward_model_path",
              self.reward_model_path, "a local CLIP model folder (reward=clip_score)")
