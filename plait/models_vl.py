"""Vision-language policies: Qwen2-VL and Qwen2.5-VL, their processor, images and rope positions.

- `VLProcessor` / `load_processor`: a model folder's tokenizer and Qwen2-VL image processor, local files
  only, the PIL one (transformers' default needs torchvision, which plait does not depend on).
  plait/models.py `create_tiny_vl_model` builds the tests' tiny Qwen2-VL / Qwen2.5-VL with the tokens
  and chat template below.
- `fetch_image` decodes a row's image (PIL, {"bytes": ...}, {"path"/"image": ...}) and resizes it to a
  multiple of 2 x data.image_patch_size within its min_pixels / max_pixels, as verl's process_image.
- `rope_index`: the 3-axis rotary positions [3, B, L] (verl's get_rope_index for Qwen2-VL): a text
  token's three axes equal its 1-D position; an image's tokens take (t, h, w) grid offsets from the
  position after the text before it; the text after an image starts at that image's largest + 1.
- `vl_inputs`: the forward kwargs of a micro-batch's rows (pixel values in the row order the model
  sees them, grids, rope positions), padded or packed.
- `never_sampled` / `mask_logits`: the image and video pad tokens, which no engine samples and no
  training pass scores.
Only these two classes are trained; any other vision-language checkpoint is refused by name.
"""

from __future__ import annotations

import io
import json
import math
import os
import stat
from pathlib import Path

import torch
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

VL_CLASSES = {"qwen2_vl": Qwen2VLForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}
VL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# Qwen2-VL's chat format: string content as is; a list of parts, each image as vision_start, image_pad,
# vision_end (the processor expands the pad to the image's tokens), each text part as its text.
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS = 4 * 28 * 28, 16384 * 28 * 28  # qwen_vl_utils' image defaults


def is_vl_dir(path: str | Path) -> bool:
    """Whether the folder's config.json describes a vision-language model (it has a vision_config)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "vision_config" in config


def vl_refusal(path: str | Path) -> str | None:
    """Why the VL checkpoint at `path` cannot be trained here (its model type), or None."""
    config = json.loads((Path(path) / "config.json").read_text())
    kind = config.get("model_type")
    if kind in VL_CLASSES:
        return None
    return (f"a {kind} vision-language model: plait trains {' and '.join(VL_CLASSES)} vision-language models "
            "(others are refused until tested)")


def image_processor():
    """Qwen2-VL's image processor on PIL and numpy (transformers' default one needs torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(min_pixels=DEFAULT_MIN_PIXELS, max_pixels=DEFAULT_MAX_PIXELS)


class VLProcessor:
    """What Qwen's processor does for images: the chat template, each image's processor outputs, and its
    one image pad token expanded to the image's token count (grid cells / merge_size^2).

    Built from the folder's tokenizer and image processor (each loaded local-only). transformers' own
    Qwen2-VL processor cannot be loaded here: AutoProcessor also builds the video processor, which
    needs torchvision; plait takes images only (video rows are refused)."""

    def __init__(self, tokenizer, images):
        self.tokenizer, self.image_processor = tokenizer, images
        self.image_token = "<|image_pad|>"
        self.merge = images.merge_size

    def apply_chat_template(self, messages: list[dict], **kwargs) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    def images(self, images: list[Image.Image]) -> dict[str, torch.Tensor]:
        """{"pixel_values": [patches, 3*2*14*14], "image_grid_thw": [n_images, 3]}; {} for no images."""
        if not images:
            return {}
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}

    def tokens(self, text: str, inputs: dict[str, torch.Tensor]) -> list[int]:
        """Token ids of `text` (already templated) with each image pad expanded; the pads must match the images."""
        parts = text.split(self.image_token)
        grids = inputs.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))
        if len(parts) - 1 != len(grids):
            raise ValueError(f"the prompt has {len(parts) - 1} image placeholders and the row {len(grids)} images")
        counts = [int(g.prod()) // self.merge ** 2 for g in grids]
        text = parts[0] + "".join(self.image_token * c + part for c, part in zip(counts, parts[1:]))
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def load_processor(path: str | Path, tokenizer=None) -> VLProcessor:
    """The VL model folder's processor: its tokenizer (left-padded; or `tokenizer`, the one the trainer renders
    with, custom chat template included) and PIL image processor, local files only."""
    from transformers import AutoImageProcessor, AutoTokenizer
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, padding_side="left")
    images = AutoImageProcessor.from_pretrained(str(path), local_files_only=True, backend="pil")
    return VLProcessor(tokenizer, images)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, scaled (aspect kept) into [min_pixels, max_pixels]."""
    if max(height, width) > 200 * min(height, width):
        raise ValueError(f"an image of {width}x{height} has an aspect ratio over 200")
    h, w = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def fetch_image(entry, patch_size: int = 14, folder: Path | None = None) -> Image.Image:
    """A row's image as RGB, resized as verl's process_image does (to multiples of 2 x `patch_size` within the
    entry's min_pixels / max_pixels). `entry`: a PIL image, a path, or a dict with "bytes", "image" or "path"
    (and optionally min_pixels, max_pixels); a relative path is taken from `folder` (the data file's)."""
    spec = entry if isinstance(entry, dict) else {"image": entry}
    source = next((spec[k] for k in ("bytes", "image", "path") if spec.get(k) is not None), None)
    if source is None:
        raise ValueError(f"an image entry with no bytes, image or path (keys {sorted(spec)})")
    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    elif isinstance(source, str):
        path = Path(source.removeprefix("file://"))
        source = path if path.is_absolute() or folder is None else folder / path
        # a FIFO or a device would block the read forever (or never end): only a file is an image
        if os.path.exists(source) and not stat.S_ISREG(os.stat(source).st_mode):
            raise ValueError(f"{source} is not a regular file (a FIFO, device, socket or folder); an image path "
                             "must name an image file")
    if isinstance(source, Image.Image):
        image = source
    else:
        try:
            image = Image.open(source)
            image.load()
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            raise ValueError(f"an image does not decode ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    image = image.convert("RGB")
    h, w = smart_resize(image.height, image.width, 2 * patch_size, int(spec.get("min_pixels") or DEFAULT_MIN_PIXELS),
                        int(spec.get("max_pixels") or DEFAULT_MAX_PIXELS))
    return image.resize((w, h), Image.Resampling.BICUBIC)


def rope_index(input_ids: torch.Tensor, attention_mask: torch.Tensor, grids: list, config) -> torch.Tensor:
    """Multimodal rotary positions [3, batch, len] of rows `input_ids` [batch, len] (verl's get_rope_index):
    `grids[b]` is row b's image_grid_thw [n_images, 3] (None: a text row). Padding takes position 1, as in verl."""
    image_id, merge = config.image_token_id, config.vision_config.spatial_merge_size
    out = torch.ones(3, *input_ids.shape, dtype=torch.long, device=input_ids.device)
    for b in range(input_ids.shape[0]):
        real = attention_mask[b].bool()
        ids = input_ids[b][real].tolist()
        pieces, start, nxt = [], 0, 0                                         # nxt: the next text position
        for t, h, w in ([] if grids[b] is None else grids[b].tolist()):
            at = ids.index(image_id, start)                                   # this image's first token
            pieces.append(torch.arange(at - start).expand(3, -1) + nxt)
            gh, gw = h // merge, w // merge
            grid = torch.stack(torch.meshgrid(torch.zeros(t, dtype=torch.long), torch.arange(gh), torch.arange(gw),
                                              indexing="ij")).flatten(1)     # [3, t*gh*gw]: (0, row, col)
            pieces.append(grid + at - start + nxt)
            nxt, start = int(pieces[-1].max()) + 1, at + t * gh * gw
        pieces.append(torch.arange(len(ids) - start).expand(3, -1) + nxt)
        out[:, b, real] = torch.cat(pieces, 1).to(out.device)
    return out


def is_vl(config) -> bool:
    return config.model_type in VL_CLASSES


def never_sampled(config) -> list[int] | None:
    """Tokens a VL policy never samples: its image and video pad tokens. One in a response would take an image's
    features in every later forward (the model places them at each pad token), so the rollout engines give them
    no probability and the training passes score over the same vocabulary. None for a text model."""
    return [config.image_token_id, config.video_token_id] if is_vl(config) else None


def mask_logits(logits: torch.Tensor, banned: list[int] | None) -> torch.Tensor:
    """`logits` [..., vocab] with the `banned` tokens' set to -1e30: probability 0, and no inf or nan in the
    entropy or its gradient (0 x -1e30 is 0)."""
    if not banned:
        return logits
    return logits.index_fill(-1, torch.tensor(banned, device=logits.device), -1e30)


def sequence_logprobs(model, ids: list[int]) -> list[float]:
    """The log-prob of each token of `ids` after its prefix (len(ids) - 1 values) under `model` at temperature
    1, over the vocabulary the policy samples from: the weight-sync check's probe (plait/workers/weight_sync.py),
    computed the same way by the trainer's model and by an in-process engine's."""
    with torch.no_grad():
        device = next(model.parameters()).device
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, :-1].float()  # [len - 1, vocab]
        logp = torch.log_softmax(mask_logits(logits, never_sampled(model.config)), -1)
        return logp.gather(-1, torch.tensor(ids[1:], device=device)[:, None]).squeeze(-1).tolist()


def vl_inputs(config, rows: list[dict], input_ids: torch.Tensor, attention_mask: torch.Tensor, packed=None) -> dict:
    """Forward kwargs of a VL model for rows [batch, len] (left-padded prompt | response) whose processor
    outputs are `rows` (per row {"pixel_values", "image_grid_thw"} or {}): the pixel values of the rows with
    images, in the order their tokens reach the model, and the rope positions. `packed` (workers/packing.Packed):
    the rows as packing laid them out; positions then [4, rows, row_len], the first being the text positions
    that tell transformers where each packed sequence starts."""
    device = input_ids.device
    positions = rope_index(input_ids, attention_mask, [r.get("image_grid_thw") for r in rows], config)  # [3, batch, len]
    order = list(range(len(rows)))
    if packed is not None:
        text = packed.position_ids                                           # [rows, row_len]
        flat = text.flatten().expand(3, -1).clone()                          # a packed row's unused end: text positions
        flat[:, packed.target] = positions.flatten(1)[:, packed.source]
        positions = torch.cat([text[None], flat.view(3, *text.shape)])       # [4, rows, row_len]
        where = torch.empty(input_ids.numel(), dtype=torch.long, device=device)
        where[packed.source] = packed.target                                 # padded place -> packed place
        starts = [int(where[b * input_ids.shape[1] + int(attention_mask[b].argmax())]) for b in order]
        order = sorted(order, key=starts.__getitem__)
    out = {"position_ids": positions}
    with_images = [rows[b] for b in order if rows[b].get("pixel_values") is not None]
    if with_images:
        out["pixel_values"] = torch.cat([r["pixel_values"] for r in with_images]).to(device)
        out["image_grid_thw"] = torch.cat([r["image_grid_thw"] for r in with_images]).to(device)
    return out
