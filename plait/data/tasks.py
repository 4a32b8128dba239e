"""Built-in verifiable tasks: short prompts with one exact answer, as rows in verl's format.

A row is `{"data_source", "prompt": [{"role": "user", "content"}], "ability",
"reward_model": {"style": "rule", "ground_truth"}, "extra_info": {"split", "index"}}`, so the
files written here and a verl user's own parquet files go through the same dataset and reward
code. The arithmetic and reverse prompts are a few characters ("12+7=") because the built-in model
reads characters; `gsm8k_synthetic` is short word problems for a real pretrained model
(word_problems.py; synthetic, in GSM8K's format, not GSM8K); `gsm8k_synthetic_tools` is the same
rows with a system line offering a calculator and an `agent_name` column (tool_agent).
`larger_shape`, `count_dots` and `geo3k_synthetic` draw a picture per question (vision_tasks.py):
their rows carry it in an `images` column, as verl's geo3k rows do.
A question's split is a hash of its text (and its images' pixels), so train and test never share
a question whatever the seeds and sizes.
"""

from __future__ import annotations

import hashlib
import io
import random
import string
from pathlib import Path
from typing import Callable, NamedTuple, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from plait.data.vision_tasks import GEO3K_SOURCE, Drawn, count_dots, geometry_problem, identity, larger_shape
from plait.data.word_problems import CALCULATOR_SYSTEM, word_problem

SPLITS = ("train", "test")  # verl's names; the test file is what `data.val_files` points to
TEST_SHARE = 8  # one question in TEST_SHARE belongs to the test split
# Small enough that a size-"s" model learns the sums within ~600 warm-start steps; with 0..99 it
# took two to three times as long (see warmstart.py).
MAX_OPERAND = 49


def arithmetic_question(rng: random.Random) -> tuple[str, str]:
    """'a+b=' with two operands in 0..MAX_OPERAND; the answer is the sum."""
    a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
    return f"{a}+{b}=", str(a + b)


def reverse_question(rng: random.Random) -> tuple[str, str]:
    """'rev abcd=' with 3 to 6 lowercase letters; the answer is the letters reversed."""
    word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6)))
    return f"rev {word}=", word[::-1]


class Task(NamedTuple):
    question: Callable[[random.Random], tuple]  # rng -> (prompt text, answer) or a vision_tasks.Drawn
    ability: str
    variant_of: Optional[str] = None  # serve that task's questions (same rows, same data_source and reward)
    system: Optional[str] = None      # a system message before the question
    agent_name: Optional[str] = None  # the agent loop each row runs (its agent_name column)
    data_source: Optional[str] = None  # the rows' data_source (and reward); default: the task's name


def split_of(question: str) -> str:
    """The split a question belongs to, fixed by its text alone (with images: vision_tasks.identity)."""
    digest = hashlib.sha256(question.encode()).digest()
    return "test" if int.from_bytes(digest[:8], "big") % TEST_SHARE == 0 else "train"


def make_task_rows(task: str, split: str, n: int, seed: int) -> list[dict]:
    """`n` distinct questions of `task` from `split`, in verl's row format; same seed, same rows."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; built-in tasks: {', '.join(TASKS)}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    spec = TASKS[task]
    source = spec.variant_of or task
    rng = random.Random(f"{source}/{split}/{seed}")
    head = [{"role": "system", "content": spec.system}] if spec.system else []
    rows, seen = [], set()
    for _ in range(100 * n):  # rejection sampling; the bound only stops an exhausted question space
        if len(rows) == n:
            break
        q = Drawn(*spec.question(rng))
        key = identity(q.text, q.images)
        if key in seen or split_of(key) != split:
            continue
        seen.add(key)
        rows.append({
            "data_source": spec.data_source or source,
            "prompt": [*head, {"role": "user", "content": q.text}],
            **({"images": [{"bytes": png(image), "path": None} for image in q.images]} if q.images else {}),
            "ability": spec.ability,
            "reward_model": {"style": "rule", "ground_truth": q.answer},
            "extra_info": {"split": split, "index": len(rows), **(q.extra or {})},
            **({"agent_name": spec.agent_name} if spec.agent_name else {}),
        })
    if len(rows) < n:
        raise ValueError(f"task {task!r} has too few distinct {split} questions: drew {len(rows)} "
                         f"of the {n} asked; ask for fewer")
    return rows


def png(image) -> bytes:
    """A PIL image as PNG bytes (what the `images` column of verl's rows holds)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# Parquet's type for the images column, spelled out: inferred, an all-None "path" would have no type.
IMAGES_TYPE = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))


def rows_table(rows: list[dict]) -> pa.Table:
    """Rows as a parquet table; an `images` column typed as the Hugging Face datasets Image feature writes it."""
    table = pa.Table.from_pylist(rows)
    if "images" in table.column_names:
        i = table.column_names.index("images")
        table = table.set_column(i, "images", pa.array([r["images"] for r in rows], type=IMAGES_TYPE))
    return table


def write_task_files(task: str, out_dir: str | Path, n_train: int, n_val: int,
                     seed: int = 0) -> tuple[str, str]:
    """Write `<task>_train.parquet` and `<task>_test.parquet` into `out_dir`; return both paths."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("test", n_val)):
        path = Path(out_dir) / f"{task}_{split}.parquet"
        pq.write_table(rows_table(make_task_rows(task, split, n, seed)), path)
        paths.append(str(path))
    return paths[0], paths[1]


TASKS = {
    "arithmetic": Task(arithmetic_question, ability="math"),
    "reverse": Task(reverse_question, ability="string"),
    # synthetic word problems in GSM8K's format (word_problems.py), scored with verl's GSM8K reward
    "gsm8k_synthetic": Task(word_problem, ability="math"),
    # the same problems (same rows, data_source and reward) offered a calculator: a system line and
    # agent_name=tool_agent (plait/agents/builtin_tools.py; the smollm2_gsm8k_tools preset)
    "gsm8k_synthetic_tools": Task(word_problem, ability="math", variant_of="gsm8k_synthetic",
                                  system=CALCULATOR_SYSTEM, agent_name="tool_agent"),
    # the same problems again, for an outside agent through the gateway (agent_name=openai_agent; the
    # smollm2_gsm8k_gateway preset, whose agent offers the calculator: plait/configs/agents/react_calculator.py)
    "gsm8k_synthetic_agent": Task(word_problem, ability="math", variant_of="gsm8k_synthetic",
                                  system=CALCULATOR_SYSTEM, agent_name="openai_agent"),
    # generated pictures (vision_tasks.py), for vision-language models: the VL demo's tasks
    "larger_shape": Task(larger_shape, ability="vision"),
    "count_dots": Task(count_dots, ability="vision"),
    # geometry3k-format rows on drawn figures (data_source hiyouga/geometry3k, verl's geo3k reward)
    "geo3k_synthetic": Task(geometry_problem, ability="math", data_source=GEO3K_SOURCE),
}
