"""Supervised warm start on generated tool transcripts (the `warmstart` config section).

For each problem of a task that has calculator transcripts (`gsm8k_synthetic_tools`), the worked
conversation of plait/agents/builtin_tools.py (a calculator call, the calculator's answer, the final
"#### N" line) is laid out exactly as the tool_agent loop lays out a trajectory
(`transcript_trajectory`), and trained with the two masks RL uses: every token is attended (prompt,
tool messages, chat-template glue), the loss is on the assistant's own tokens only (mask 1, each
turn's content and its end-of-turn token). The result is cached like the demo's warm start
(plait/data/warmstart.py): `out_dir` keeps the settings and a hash of the starting model's files,
and the same call again returns it without training.

Left out: LR schedules, packing, other tools' transcripts, devices other than CPU.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from plait.data.warmstart import MARKER, POOL, _fingerprint, train_and_save

# Tasks whose problems have generated tool transcripts: the worked arithmetic (the tools preset), or the
# format only, each operator drawn at random (the gateway preset: RL must learn which operation a story asks for).
TRANSCRIPT_TASKS = {"gsm8k_synthetic_tools": "worked", "gsm8k_synthetic_agent": "format"}


def transcript_examples(tokenizer, model_type: str | None, task: str, n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(ids, loss mask over ids) of `n` train problems' transcripts: mask 1 on assistant tokens only."""
    from plait.agents.builtin_tools import CalculatorTool, calculator_transcript, transcript_trajectory
    from plait.data.tasks import make_task_rows
    if task not in TRANSCRIPT_TASKS:
        raise ValueError(f"task {task!r} has no generated tool transcripts; tasks with them: {', '.join(TRANSCRIPT_TASKS)}")
    tools = [CalculatorTool({}, None).get_openai_tool_schema().model_dump(exclude_unset=True)]
    examples, rng = [], random.Random(seed) if TRANSCRIPT_TASKS[task] == "format" else None
    for row in make_task_rows(task, "train", n, seed):
        messages = calculator_transcript(row["prompt"][-1]["content"], row["reward_model"]["ground_truth"], rng)
        if messages is None:
            continue
        t = transcript_trajectory(tokenizer, [*row["prompt"][:-1], *messages[1:]], model_type, tools)
        examples.append((t.ids, [0] * t.prompt_len + t.mask))
    return examples


def transcript_warmstart(model_dir: str | Path, task: str, out_dir: str | Path, steps: int, batch_size: int,
                         lr: float, seed: int = 0) -> str:
    """Train `model_dir` for `steps` steps of `batch_size` transcripts (of up to steps x batch_size
    distinct problems, at most plait.data.warmstart.POOL); save to `out_dir`, return it."""
    from transformers import AutoConfig

    from plait.models import load_causal_lm, load_tokenizer
    pool = min(POOL, steps * batch_size)  # distinct problems; building one costs ~0.1 s of chat-template renders
    settings = {"model": _fingerprint(Path(model_dir)), "task": task, "steps": steps, "batch_size": batch_size,
                "lr": lr, "seed": seed, "pool": pool, "kind": "tool transcripts"}
    marker = Path(out_dir) / MARKER
    if marker.is_file() and json.loads(marker.read_text())["settings"] == settings:
        return str(out_dir)
    tokenizer, model = load_tokenizer(model_dir), load_causal_lm(model_dir)
    model_type = AutoConfig.from_pretrained(model_dir, local_files_only=True).model_type
    examples = transcript_examples(tokenizer, model_type, task, pool, seed)
    return train_and_save(model, tokenizer, examples, steps, batch_size, lr, seed, Path(out_dir), settings)
