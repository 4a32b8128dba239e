"""Procedural glyph images, their condition sets, and image reward functions.

The built-in diffusion task: ten classes of simple glyphs (bars, diagonals, a square, a plus, a
cross, a checkerboard, a disk, corner blocks) drawn in code at any size, jittered by a one-pixel
shift, ink intensity and pixel noise, so the data is a distribution and nothing is downloaded.
Pixels live in [-1, 1] (background -1, ink up to +1); a condition is a class label.

Rewards are plain callables `reward(images [B, C, H, W], cond [B]) -> [B]` float:
`glyph_classifier` (verifiable: a small fixed classifier's probability of the requested class),
`glyph_template` (verifiable: closeness to the class's clean glyph), `brightness` and `contrast`
(rule rewards).

Rewards over a text-to-image pipeline's images take the prompts instead:
`reward(images [B, C, H, W] in [0, 1], prompts: list[str], metadata: list[dict]) -> [B]`.
Built in: `jpeg_compressibility` / `jpeg_incompressibility` (minus / plus the JPEG size in kB at
quality 95, as in DDPO and Flow-GRPO's ablations; no model) and `clip_score(model_path)`, the
cosine similarity of a local CLIP model's image and text embeddings. Not here: the flow model and
its pre-training (plait/workers/diffusion.py).
"""

from __future__ import annotations

import functools
import io
from typing import Callable, Literal

import torch
from torch import Tensor, nn

# Each glyph is a predicate on pixel-centre coordinates u (column), v (row) in [-1, 1].
_GLYPHS = [
    lambda u, v: v.abs() < 0.25,  # horizontal bar
    lambda u, v: u.abs() < 0.25,  # vertical bar
    lambda u, v: (u - v).abs() < 0.2,  # diagonal
    lambda u, v: (u + v).abs() < 0.2,  # anti-diagonal
    lambda u, v: (torch.maximum(u.abs(), v.abs()) - 0.65).abs() < 0.15,  # square outline
    lambda u, v: ((u.abs() < 0.2) & (v.abs() < 0.75)) | ((v.abs() < 0.2) & (u.abs() < 0.75)),  # plus
    lambda u, v: ((u - v).abs() < 0.2) | ((u + v).abs() < 0.2),  # cross
    lambda u, v: (torch.floor((u + 1) * 2) + torch.floor((v + 1) * 2)) % 2 == 0,  # checkerboard
    lambda u, v: u**2 + v**2 < 0.5,  # disk
    lambda u, v: (u.abs() > 0.5) & (v.abs() > 0.5),  # corner blocks
]
NUM_GLYPHS = len(_GLYPHS)  # torch-free, for config: workers/diffusion_config.py (tests/diffusion/test_images.py: equal)
_SPLIT_SEEDS = {"train": 0, "val": 1}


def render_glyphs(labels: Tensor, size: int, channels: int = 1,
                  generator: torch.Generator | None = None, jitter: bool = True) -> Tensor:
    """Draw glyph `labels[i]` at `size`x`size`; with `jitter`, a random shift, ink and noise."""
    batch = labels.shape[0]
    centres = (torch.arange(size, dtype=torch.float32) + 0.5) / size * 2 - 1  # [size]
    v, u = torch.meshgrid(centres, centres, indexing="ij")  # [size, size] each
    ink = torch.ones(batch, 1, 1)  # [B, 1, 1]
    noise = torch.zeros(batch, size, size)  # [B, size, size]
    if jitter:
        # Shifting the coordinates (not rolling pixels) keeps glyphs from wrapping round the edge.
        shift = torch.randint(-1, 2, (batch, 2, 1, 1), generator=generator) * (2.0 / size)
        u, v = u - shift[:, 0], v - shift[:, 1]  # [B, size, size] each
        ink = 0.7 + 0.3 * torch.rand(batch, 1, 1, generator=generator)
        noise = 0.05 * torch.randn(batch, size, size, generator=generator)
    else:
        u, v = u.expand(batch, size, size), v.expand(batch, size, size)
    masks = torch.stack([g(u, v) for g in _GLYPHS], dim=1)  # [B, classes, size, size]
    mask = masks[torch.arange(batch), labels].float()  # [B, size, size]
    image = (-1 + 2 * ink * mask + noise).clamp(-1, 1)  # [B, size, size]
    return image[:, None].expand(batch, channels, size, size).contiguous()  # [B, C, size, size]


def condition_split(split: Literal["train", "val"], size: int, num_classes: int = NUM_GLYPHS) -> Tensor:
    """A fixed set of `size` class labels, balanced over classes and shuffled by the split's seed.

    Held-out ("val") conditions are the same classes drawn under another seed: the class set is
    small, so held-out here means unseen label order and (with the sampler's seed) unseen noise.
    """
    generator = torch.Generator().manual_seed(_SPLIT_SEEDS[split])
    labels = torch.arange(size) % num_classes  # [size]
    return labels[torch.randperm(size, generator=generator)]


def glyph_template(images: Tensor, cond: Tensor) -> Tensor:
    """1 - mean squared distance to the clean glyph of the requested class, scaled to [0, 1]."""
    templates = render_glyphs(cond.cpu(), images.shape[-1], images.shape[1], jitter=False).to(images.device)
    return 1 - ((images.clamp(-1, 1) - templates) ** 2).mean(dim=(1, 2, 3)) / 4


def glyph_classifier(images: Tensor, cond: Tensor) -> Tensor:
    """Probability a fixed glyph classifier gives the requested class."""
    classifier = _classifier(images.shape[-1]).to(images.device)  # moves the cached module once
    with torch.no_grad():
        logits = classifier(images.clamp(-1, 1).mean(dim=1).flatten(1))  # [B, classes]
    return logits.softmax(-1).gather(1, cond[:, None]).squeeze(1)


def brightness(images: Tensor, cond: Tensor) -> Tensor:
    """Mean pixel value mapped to [0, 1]; ignores the condition."""
    return (images.clamp(-1, 1).mean(dim=(1, 2, 3)) + 1) / 2


def contrast(images: Tensor, cond: Tensor) -> Tensor:
    """Pixel standard deviation mapped to [0, 1] (a half-black, half-white image scores 1)."""
    return images.clamp(-1, 1).flatten(1).std(dim=1, unbiased=False)


@functools.lru_cache(maxsize=None)
def _classifier(size: int) -> nn.Module:
    """Train (once per process and size, about a second) an MLP on jittered, extra-noisy glyphs.

    Extra input noise keeps its probabilities graded on imperfect samples instead of saturating,
    so the reward has a slope for RL to climb. Seeded and run under a forked RNG: the same
    classifier in every process, and the caller's random stream untouched.
    """
    with torch.random.fork_rng(), torch.enable_grad():
        torch.manual_seed(1234)
        generator = torch.Generator().manual_seed(1234)
        model = nn.Sequential(nn.Linear(size * size, 128), nn.ReLU(), nn.Linear(128, NUM_GLYPHS))
        optim = torch.optim.Adam(model.parameters(), lr=3e-3)
        for _ in range(300):
            labels = torch.randint(0, NUM_GLYPHS, (256,), generator=generator)
            images = render_glyphs(labels, size, generator=generator)  # [256, 1, size, size]
            images = images + 0.5 * torch.randn(images.shape, generator=generator)
            loss = nn.functional.cross_entropy(model(images.flatten(1)), labels)
            optim.zero_grad()
            loss.backward()
            optim.step()
    return model.eval().requires_grad_(False)


IMAGE_REWARDS = {
    "glyph_classifier": glyph_classifier,
    "glyph_template": glyph_template,
    "brightness": brightness,
    "contrast": contrast,
}  # diffusion_config.py lists the names config accepts


# --- rewards over prompted images (text-to-image pipelines) ------------------------------------

def jpeg_kb(images: Tensor) -> Tensor:
    """Size in kB of each image [B, C, H, W] in [0, 1] saved as a quality-95 JPEG.  # [B]"""
    from PIL import Image

    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()  # [B, C, H, W]
    sizes = []
    for image in pixels:
        buffer = io.BytesIO()
        array = image[0].numpy() if image.shape[0] == 1 else image.permute(1, 2, 0).numpy()
        Image.fromarray(array).save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes)


def jpeg_compressibility(images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
    """Minus the JPEG size in kB: smoother, simpler images score higher."""
    return -jpeg_kb(images)


def jpeg_incompressibility(images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
    """The JPEG size in kB: busier, more detailed images score higher."""
    return jpeg_kb(images)


def clip_score(model_path: str) -> Callable[[Tensor, list[str], list[dict]], Tensor]:
    """A reward: cosine similarity of image and prompt under the CLIP model in folder `model_path`
    (CLIPModel, its tokenizer and image processor, loaded from local files only)."""
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

    model = CLIPModel.from_pretrained(model_path, local_files_only=True).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    processor = CLIPImageProcessor.from_pretrained(model_path, local_files_only=True)
    size = model.config.vision_config.image_size
    mean = torch.tensor(processor.image_mean)[:, None, None]  # [3, 1, 1]
    std = torch.tensor(processor.image_std)[:, None, None]  # [3, 1, 1]

    @torch.no_grad()
    def score(images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        model.to(images.device)
        pixels = nn.functional.interpolate(images.float(), size=(size, size), mode="bicubic", align_corners=False)
        pixels = (pixels.clamp(0, 1).expand(-1, 3, -1, -1) - mean.to(images.device)) / std.to(images.device)
        text = tokenizer(prompts, padding=True, truncation=True, return_tensors="pt").to(images.device)
        # transformers 5 returns the projected embeddings as the outputs' pooler_output
        image_emb = model.get_image_features(pixel_values=pixels).pooler_output  # [B, E]
        text_emb = model.get_text_features(**text).pooler_output  # [B, E]
        return nn.functional.cosine_similarity(image_emb, text_emb, dim=-1).cpu()

    return score


PROMPT_IMAGE_REWARDS = {
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
}  # diffusion_config.py lists these too
"""Prompt-image rewards that need no model; `clip_score` is built from diffusion.reward_model_path."""
