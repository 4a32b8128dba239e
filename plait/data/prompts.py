"""Prompt files for text-to-image training: parquet or JSONL rows with `prompt` and optional metadata.

Each row's prompt column (data.prompt_key, `prompt` by default) must be a plain string; every other
column of the row is its metadata, handed to the reward beside the image. Not here: tokenization
(the pipeline's text encoders do it) and chat templates (LM prompts: plait/data/dataset.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from plait.data.dataset import load_rows


@dataclass(frozen=True)
class PromptRow:
    prompt: str
    metadata: dict


def load_prompts(paths: str | Path | Sequence[str | Path], prompt_key: str = "prompt") -> list[PromptRow]:
    """All rows of the files, in order; a row without a string `prompt_key` is a ValueError naming it."""
    out = []
    for i, row in enumerate(load_rows(paths)):
        prompt = row.get(prompt_key)
        if not isinstance(prompt, str):
            raise ValueError(f"prompt row {i} has no string {prompt_key!r} column: {row!r}"[:300])
        out.append(PromptRow(prompt, {k: v for k, v in row.items() if k != prompt_key}))
    return out
