"""A diffusers text-to-image flow-matching pipeline (SD3 family) as plait's Flow-GRPO policy.

`PipelinePolicy` puts a whole pipeline folder behind the seam the sampler and the workers use,
`model(x [B,C,h,w] latents, t [B], cond: PromptEmbeds) -> v`, with classifier-free guidance inside:
the unconditional (negative-prompt) and conditional branches run as one batch of 2B and the
velocity the SDE steps with is the guided one, v = v_u + g (v_c - v_u). The sampler's Gaussian
transitions, their log-probs and the KL are therefore those of the guided velocity, which is how
Flow-GRPO defines them. Only the transformer is a registered submodule: it is what trains (or
carries the LoRA adapters), what `.to(device)` moves and what a checkpoint holds. The text
encoders and the VAE are frozen, kept in `PipelineConfig.dtype` and, with `offload`, parked on the
CPU between uses. Prompts are encoded with the pipeline's own `encode_prompt`; each unique prompt
of a batch once (a group's `rollout.n` samples share it), the negative prompt once per run, and
prompts passed with `cache=True` (validation) once per run. `decode` turns final latents into
images in [0, 1] for the rewards.

Time: t is diffusers' sigma (the transformer gets 1000 t). The sampler's grid is the pipeline's:
uniform s mapped by the scheduler's shift (3.0 for SD3), t = shift s / (1 + (shift - 1) s), so the
SDE takes SD3's non-uniform steps (`cfg.shift`, read by the actor).

Supported: `StableDiffusion3Pipeline` folders (SD3, SD3.5; `text_encoder_3` may be absent, the
pipeline then feeds zeros for the T5 part). Not here: Flux (packed latents, image ids and a
distilled guidance input instead of CFG), UNet pipelines (SD 1.x/2.x/XL predict noise, not a
flow velocity), image-to-image, and the step loop (plait/trainers/diffusion.py).
`create_tiny_sd3_pipeline` builds a tiny random SD3 pipeline from configs, tokenizers included,
for tests and demos; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from plait.configtree import check
from plait.workers.diffusers_policy import TIMESTEP_SCALE, LoraConfig, add_lora
from plait.workers.diffusion_config import PipelineConfig  # noqa: F401  (its config node, torch-free)

SUPPORTED = ("StableDiffusion3Pipeline",)
UNSUPPORTED = {
    "FluxPipeline": "Flux packs latents into tokens, takes image ids and a distilled guidance input instead of CFG",
    "StableDiffusionPipeline": "a UNet that predicts noise, not a flow-matching velocity",
    "StableDiffusionXLPipeline": "a UNet that predicts noise, not a flow-matching velocity",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class PromptEmbeds:
    """Text conditioning of B samples, both CFG branches; what the sampler passes to the model as `cond`."""

    embeds: Tensor  # [B, S, D] encoder_hidden_states
    pooled: Tensor  # [B, P] pooled_projections
    neg_embeds: Tensor  # [B, S, D]
    neg_pooled: Tensor  # [B, P]

    def __len__(self) -> int:
        return self.embeds.shape[0]

    def to(self, device) -> PromptEmbeds:
        return PromptEmbeds(*(t.to(device) for t in (self.embeds, self.pooled, self.neg_embeds, self.neg_pooled)))


@dataclass
class PipelinePolicyConfig:
    """What the sampler reads from `model.cfg` (the latent shape) and the scheduler's time shift."""

    image_size: int  # latent side
    channels: int  # latent channels
    shift: float


def pipeline_class(path: str | Path) -> str | None:
    """The `_class_name` in `path/model_index.json`, or None when the folder is not a diffusers pipeline."""
    index = Path(path) / "model_index.json"
    return json.loads(index.read_text())["_class_name"] if index.is_file() else None


def check_pipeline_folder(path: str | Path) -> None:
    """Raise ValueError saying why `path` is not a pipeline folder plait can train."""
    name = pipeline_class(path)
    if name is None:
        raise ValueError(f"{path} has no model_index.json: not a diffusers pipeline folder")
    if name not in SUPPORTED:
        why = UNSUPPORTED.get(name, "not a flow-matching text-to-image pipeline plait knows")
        raise ValueError(f"{path} holds a {name}: {why}; supported: {', '.join(SUPPORTED)}")
    missing = [part for part in ("transformer", "vae", "scheduler", "text_encoder", "tokenizer")
               if not (Path(path) / part).is_dir()]
    if missing:
        raise ValueError(f"{path} ({name}) lacks {', '.join(missing)}")


class PipelinePolicy(nn.Module):
    """Guided velocity v(x_t, t, prompts) of a pipeline's transformer; encodes prompts and decodes latents."""

    def __init__(self, pipe, cfg: PipelineConfig, device: str):
        super().__init__()
        self.transformer = pipe.transformer
        self.pipe, self.settings, self.device = pipe, cfg, torch.device(device)  # pipe: a plain attribute
        side = cfg.resolution or pipe.transformer.config.sample_size * pipe.vae_scale_factor
        check(side % pipe.vae_scale_factor == 0, "resolution", side, f"a multiple of {pipe.vae_scale_factor}")
        self.cfg = PipelinePolicyConfig(side // pipe.vae_scale_factor, pipe.transformer.config.in_channels,
                                        pipe.scheduler.config.shift)
        self.cache: dict[str, tuple[Tensor, Tensor]] = {}
        self.negative = self._encode([cfg.negative_prompt])  # ([1, S, D], [1, P])

    @property
    def guided(self) -> bool:
        return self.settings.guidance_scale > 1  # diffusers' rule: guidance at or below 1 is off

    def forward(self, x: Tensor, t: Tensor, cond: PromptEmbeds) -> Tensor:
        embeds, pooled = cond.embeds, cond.pooled
        if self.guided:  # one batch for both branches: [uncond; cond]
            x, t = torch.cat([x, x]), torch.cat([t, t])
            embeds, pooled = torch.cat([cond.neg_embeds, embeds]), torch.cat([cond.neg_pooled, pooled])
        v = self.transformer(hidden_states=x.to(self.transformer.dtype), timestep=TIMESTEP_SCALE * t,
                             encoder_hidden_states=embeds, pooled_projections=pooled,
                             return_dict=False)[0].float()  # [B or 2B, C, h, w]
        if self.guided:
            v_uncond, v_cond = v.chunk(2)
            v = v_uncond + self.settings.guidance_scale * (v_cond - v_uncond)
        return v  # [B, C, h, w]

    @torch.no_grad()
    def encode(self, prompts: list[str], cache: bool = False) -> PromptEmbeds:
        """Embeddings of `prompts` (repeats encoded once) with the negative prompt's beside them."""
        unique = list(dict.fromkeys(prompts))
        todo = [p for p in unique if p not in self.cache]
        fresh = dict(zip(todo, zip(*self._encode(todo)))) if todo else {}
        if cache:
            self.cache |= fresh
        table = self.cache | fresh
        position = {p: i for i, p in enumerate(unique)}
        index = [position[p] for p in prompts]
        embeds = torch.stack([table[p][0] for p in unique])[index]  # [B, S, D]
        pooled = torch.stack([table[p][1] for p in unique])[index]  # [B, P]
        neg_embeds, neg_pooled = self.negative
        return PromptEmbeds(embeds, pooled, neg_embeds.expand(len(prompts), -1, -1), neg_pooled.expand(len(prompts), -1))

    def _encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        encoders = [self.pipe.text_encoder, self.pipe.text_encoder_2, self.pipe.text_encoder_3]
        with torch.no_grad(), self._on_device(*[e for e in encoders if e is not None]):
            embeds, _, pooled, _ = self.pipe.encode_prompt(
                prompts, None, None, device=self.device, do_classifier_free_guidance=False,
                max_sequence_length=self.settings.max_sequence_length)
        dtype = self.transformer.dtype
        return embeds.to(self.device, dtype), pooled.to(self.device, dtype)  # [N, S, D], [N, P]

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """Images [B, 3, H, W] in [0, 1] from final latents [B, C, h, w]."""
        vae = self.pipe.vae
        with self._on_device(vae):
            x = latents / vae.config.scaling_factor + vae.config.shift_factor
            images = vae.decode(x.to(self.device, vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)

    @contextlib.contextmanager
    def _on_device(self, *modules: nn.Module):
        """With `offload`, the frozen `modules` visit the device only for the block."""
        if not self.settings.offload or self.device.type == "cpu":
            yield
            return
        for m in modules:
            m.to(self.device)
        try:
            yield
        finally:
            for m in modules:
                m.to("cpu")


def load_pipeline_policy(path: str | Path, cfg: PipelineConfig, lora: LoraConfig | None = None,
                         device: str = "cpu") -> PipelinePolicy:
    """The pipeline in folder `path` (local files only): frozen parts in cfg.dtype on `device` (CPU with
    offload), the transformer trainable in float32, or frozen in cfg.dtype under float32 LoRA adapters."""
    from diffusers import DiffusionPipeline  # optional dependency: only for pipeline folders

    check_pipeline_folder(path)
    index = json.loads((Path(path) / "model_index.json").read_text())
    # Components saved as [null, null] (an absent T5) must be named, or from_pretrained refuses the folder.
    absent = {name: None for name, entry in index.items() if entry == [None, None]}
    dtype = DTYPES[cfg.dtype]
    pipe = DiffusionPipeline.from_pretrained(path, local_files_only=True, dtype=dtype, **absent)
    pipe.set_progress_bar_config(disable=True)
    frozen = [pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]
    for module in frozen:
        if module is not None:
            module.requires_grad_(False).eval().to("cpu" if cfg.offload else device)
    if lora is not None and lora.enable:
        pipe.transformer.requires_grad_(False)
        add_lora(pipe.transformer, lora)
        for p in pipe.transformer.parameters():
            if p.requires_grad:
                p.data = p.data.float()  # adapters train in float32 over the frozen base
    else:
        pipe.transformer.float()
    pipe.transformer.to(device)
    return PipelinePolicy(pipe, cfg, device)


def create_tiny_sd3_pipeline(path: str | Path, seed: int = 0, resolution: int = 32) -> Path:
    """A random SD3 pipeline small enough for CPU tests (about 66k parameters, 23k in the transformer), saved
    with save_pretrained.

    Two tiny CLIP text encoders whose tokenizer is byte-level with no merges (one token per
    character, built here), no T5 (text_encoder_3=None), a 2-level VAE (scale factor 2) and a
    2-layer transformer; the scheduler has SD3's shift 3. The same seed gives the same weights.
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from tokenizers import pre_tokenizers
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
        vocab[char + "</w>"] = len(vocab)  # CLIP's BPE marks a word's last symbol
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)
    text = CLIPTextConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, projection_dim=16, max_position_embeddings=77,
                          bos_token_id=0, eos_token_id=1, pad_token_id=1)
    latent = resolution // 2
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        pipe = StableDiffusion3Pipeline(
            transformer=SD3Transformer2DModel(
                sample_size=latent, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
                pooled_projection_dim=32, pos_embed_max_size=latent // 2),  # joint = 2 CLIPs x 16; pooled likewise
            vae=AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(8, 8), layers_per_block=1,
                              down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                              latent_channels=4, norm_num_groups=4, sample_size=resolution, use_quant_conv=False,
                              use_post_quant_conv=False, scaling_factor=1.5, shift_factor=0.06),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
            text_encoder=CLIPTextModelWithProjection(text), tokenizer=tokenizer,
            text_encoder_2=CLIPTextModelWithProjection(text), tokenizer_2=tokenizer,
            text_encoder_3=None, tokenizer_3=None)
    pipe.save_pretrained(path)
    return Path(path)
