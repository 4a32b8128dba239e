"""Supervised warm start: a few hundred steps of answer-only next-token training on a built-in task.

GRPO learns only from groups whose rewards differ, and a freshly initialised tiny model almost
never answers "12+7=" right, so the demo first teaches it the answer format and some of the task,
leaving it well short of perfect so RL has room to improve it. Measured on 2 shared CPU cores,
one torch thread, size "s", arithmetic: the defaults (400 steps of 32) take about 10 s and leave
16-38 % greedy accuracy on the test split over three seeds; accuracy then climbs steeply
(38-86 % at 600 steps). The result is cached: `out_dir` keeps the settings (and a hash of the
starting model's files) it was trained with, and the same call again returns it without training.
Left out: LR schedules, packing, devices other than CPU.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import torch

from plait.data.tasks import make_task_rows
from plait.models import load_causal_lm, load_tokenizer

POOL = 1000  # distinct train questions the batches are drawn from
MARKER = "warmstart.json"


def sft_warmstart(model_dir: str | Path, task: str, out_dir: str | Path, steps: int = 400,
                  batch_size: int = 32, lr: float = 1e-3, seed: int = 0) -> str:
    """Train `model_dir` on `task`'s (prompt, answer + eos) pairs; save to `out_dir`, return it."""
    if not 0 < batch_size <= POOL:
        raise ValueError(f"batch_size={batch_size}: expected 1..{POOL}")
    settings = {"model": _fingerprint(Path(model_dir)), "task": task, "steps": steps,
                "batch_size": batch_size, "lr": lr, "seed": seed, "pool": POOL}
    marker = Path(out_dir) / MARKER
    if marker.is_file() and json.loads(marker.read_text())["settings"] == settings:
        return str(out_dir)

    tokenizer, model = load_tokenizer(model_dir), load_causal_lm(model_dir)
    examples = []
    for row in make_task_rows(task, "train", POOL, seed):
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                             tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer = tokenizer(row["reward_model"]["ground_truth"], add_special_tokens=False)
        examples.append((prompt, answer["input_ids"] + [tokenizer.eos_token_id]))

    pairs = [(prompt + answer, [0] * len(prompt) + [1] * len(answer)) for prompt, answer in examples]
    return train_and_save(model, tokenizer, pairs, steps, batch_size, lr, seed, Path(out_dir), settings)


def train_and_save(model, tokenizer, examples: list[tuple[list[int], list[int]]], steps: int, batch_size: int,
                   lr: float, seed: int, out_dir: Path, settings: dict) -> str:
    """`steps` AdamW steps on batches of (ids, loss mask) examples, then the model, tokenizer and the
    settings marker (written last: it marks the folder complete) saved to `out_dir`."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        input_ids, attention_mask, labels = collate(rng.sample(examples, min(batch_size, len(examples))),
                                                    tokenizer.pad_token_id)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    (out_dir / MARKER).write_text(json.dumps({"settings": settings, "losses": losses}))
    return str(out_dir)


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids; attention on every real token; labels -100 wherever the loss mask is 0."""
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id)                 # [batch, seq]
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)  # [batch, seq]
    labels = torch.full((len(examples), width), -100)                       # [batch, seq]
    for i, (ids, mask) in enumerate(examples):
        row = torch.tensor(ids)
        input_ids[i, :len(ids)], attention_mask[i, :len(ids)] = row, 1
        labels[i, :len(ids)] = torch.where(torch.tensor(mask, dtype=torch.bool), row, torch.tensor(-100))
    return input_ids, attention_mask, labels


def _fingerprint(model_dir: Path) -> str:
    """Hash of every file in the model directory: a rebuilt model invalidates the cache.
    Reads all weights, which is instant for the tiny models this is meant for."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
