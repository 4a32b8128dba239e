"""The VL demo's model and its format warm start (the `vl_demo` preset, docs/vlm.md "The VL demo").

- `vl_demo_model(out_dir, seed)`: a tiny Qwen2-VL built from a config (plait.models.create_tiny_vl_model:
  random weights, a one-block vision tower, the char tokenizer with Qwen's vision tokens), then a short
  supervised warm start that teaches the ANSWER FORMAT only: the task's train prompts, each with its own
  image, answered with a label drawn at random from the task's answers, independently of the image,
  then `<|im_end|>`. The labels carry no information about the pictures, so the model learns to say
  "r" or "b" (or a count) and stop, and nothing about which one is right: its accuracy stays at
  chance, and what GRPO adds afterwards is read from the images. Loss on the answer tokens only.
  (`true_steps` > 0 adds supervised steps on the true answers, the earlier demo's "priming", kept to
  reproduce docs/vlm.md's earlier probes; the preset's DEMO_WARMSTART has none.)
  The result is cached in `out_dir` (plait/data/warmstart.py's marker: the settings and a hash of the
  starting model's files), so a second run reuses it.
Left out: other tasks than the built-in image tasks, LR schedules, devices other than CPU.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import torch

from plait.data.warmstart import MARKER, _fingerprint

FORMAT_ANSWERS = {"larger_shape": ("r", "b"), "count_dots": ("1", "2", "3", "4")}
POOL = 2048  # distinct train pictures the warm-start batches are drawn from (at most; steps x batch_size)


def format_examples(processor, task: str, n: int, seed: int, labels: str = "random") -> list[dict]:
    """`n` train rows of `task` as {"ids", "mask", "inputs"}: the templated prompt with its image's tokens,
    then an answer and <|im_end|>; mask 1 on the answer tokens only. The answer is the row's own
    (`labels="true"`) or one of the task's drawn at random, independently of the image (`"random"`)."""
    from plait.data.dataset import image_messages
    from plait.data.tasks import make_task_rows
    from plait.models_vl import fetch_image
    rng = random.Random(f"vl_demo/format/{seed}")
    end = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for i, row in enumerate(make_task_rows(task, "train", n, seed)):
        images = [fetch_image(entry) for entry in row["images"]]
        inputs = processor.images(images)
        text = processor.apply_chat_template(image_messages(i, row["prompt"], len(images)), add_generation_prompt=True)
        prompt = processor.tokens(text, inputs)
        said = row["reward_model"]["ground_truth"] if labels == "true" else rng.choice(FORMAT_ANSWERS[task])
        answer = processor.tokenizer(said, add_special_tokens=False)["input_ids"] + [end]
        out.append({"ids": prompt + answer, "mask": [0] * len(prompt) + [1] * len(answer), "inputs": inputs})
    return out


def format_loss(model, batch: list[dict], pad_id: int) -> torch.Tensor:
    """Mean next-token loss of a batch of format examples (right-padded, rope positions as in training)."""
    from plait.models_vl import vl_inputs
    width = max(len(e["ids"]) for e in batch)
    ids = torch.full((len(batch), width), pad_id)                        # [batch, seq]
    attention = torch.zeros((len(batch), width), dtype=torch.long)       # [batch, seq]
    labels = torch.full((len(batch), width), -100)                       # [batch, seq]
    for b, e in enumerate(batch):
        row, n = torch.tensor(e["ids"]), len(e["ids"])
        ids[b, :n], attention[b, :n] = row, 1
        labels[b, :n] = torch.where(torch.tensor(e["mask"], dtype=torch.bool), row, torch.tensor(-100))
    extra = vl_inputs(model.config, [e["inputs"] for e in batch], ids, attention)
    return model(input_ids=ids, attention_mask=attention, labels=labels, **extra).loss


def format_warmstart(model_dir: str | Path, task: str, out_dir: str | Path, steps: int, batch_size: int,
                     lr: float, seed: int = 0, labels: str = "random") -> str:
    """`steps` AdamW steps of `batch_size` random-answer examples on `model_dir`; saved (with the tokenizer and
    image processor) to `out_dir`, which is returned. Cached: the same settings again return `out_dir`."""
    from plait.models import load_causal_lm
    from plait.models_vl import load_processor
    if task not in FORMAT_ANSWERS:
        raise ValueError(f"task {task!r} has no format warm start; tasks with one: {', '.join(FORMAT_ANSWERS)}")
    out_dir = Path(out_dir)
    settings = {"model": _fingerprint(Path(model_dir)), "task": task, "steps": steps, "batch_size": batch_size,
                "lr": lr, "seed": seed, "pool": POOL, "labels": labels}
    marker = out_dir / MARKER
    if marker.is_file() and json.loads(marker.read_text())["settings"] == settings:
        return str(out_dir)
    processor, model = load_processor(model_dir), load_causal_lm(model_dir)
    examples = format_examples(processor, task, min(POOL, steps * batch_size), seed, labels)
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        loss = format_loss(model, rng.sample(examples, min(batch_size, len(examples))), processor.tokenizer.pad_token_id)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
    model.save_pretrained(out_dir)
    processor.tokenizer.save_pretrained(out_dir)
    processor.image_processor.save_pretrained(out_dir)
    marker.write_text(json.dumps({"settings": settings, "losses": losses}))
    return str(out_dir)


def vl_demo_model(out_dir: str | Path, task: str = "larger_shape", steps: int = 60, batch_size: int = 16,
                  lr: float = 3e-3, seed: int = 0, labels: str = "random", true_steps: int = 0,
                  true_lr: float = 1e-3) -> str:
    """The tiny Qwen2-VL built from `seed` under `out_dir`/init, format-warm-started into `out_dir`/warmstart
    (`steps` at `lr` with `labels`), then, when `true_steps` > 0, that many steps on the true answers at
    `true_lr` (a fresh optimizer) into `out_dir`/primed."""
    from plait.models import create_tiny_vl_model
    init = Path(out_dir) / "init"
    if not (init / "config.json").is_file():
        create_tiny_vl_model(init, "qwen2_vl", seed=seed)
    path = format_warmstart(init, task, Path(out_dir) / "warmstart", steps, batch_size, lr, seed, labels)
    if true_steps == 0:
        return path
    return format_warmstart(path, task, Path(out_dir) / "primed", true_steps, batch_size, true_lr, seed, "true")


# The warm start of `actor_rollout_ref.model.path: tiny-qwen2-vl-demo` (the vl_demo preset): the format only,
# no true answers (true_steps 0); see docs/vlm.md "The VL demo".
DEMO_WARMSTART = dict(task="larger_shape", steps=60, batch_size=16, lr=3e-3, seed=0, labels="random", true_steps=0)


def vl_demo_dir(cache_dir: str | Path | None = None) -> str:
    """The built-in `tiny-qwen2-vl-demo`: vl_demo_model with DEMO_WARMSTART under `cache_dir` (default
    `$PLAIT_CACHE` or ~/.cache/plait), built on first use and reused after (the warm start's cache)."""
    root = Path(cache_dir or os.environ.get("PLAIT_CACHE") or Path.home() / ".cache" / "plait") / "tiny-qwen2-vl-demo"
    marker = root / ("primed" if DEMO_WARMSTART.get("true_steps") else "warmstart") / MARKER
    if not marker.is_file():
        print(f"plait: building tiny-qwen2-vl-demo in {root}: a tiny Qwen2-VL from a config, then the format warm "
              f"start ({DEMO_WARMSTART})", file=sys.stderr)
    return vl_demo_model(root, **DEMO_WARMSTART)
