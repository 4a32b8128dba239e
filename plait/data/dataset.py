"""Prompt datasets: rows from parquet or JSONL files, tokenized once, served in seeded batches.

Rows follow verl's format (see tasks.py); `prompt` is a list of chat messages (rendered with the
tokenizer's chat template) or a plain string (used as is). Every prompt is tokenized when the
dataset is built, so a prompt that is too long fails (or is truncated, or filtered out, as
`data.truncation` and `data.filter_overlong_prompts` say) before training starts. Batches drop
the incomplete last one, as verl does. With a vision-language model's processor, a row's images
(`data.image_key`) fill the `<image>` placeholders of its messages (verl's format, see
`image_messages`); each is decoded and resized once here and travels with the prompt. Left out:
videos and audio (refused; with a text model images are refused too), tool schemas, streaming
datasets too large for memory, and padding (the rollout pads).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerBase

from plait.configtree import ConfigError, check
from plait.types import PromptBatch

def read_parquet(path: Path) -> list[dict]:
    try:
        return pq.read_table(path).to_pylist()
    except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"not a readable parquet file ({str(err).splitlines()[0]})") from None


def read_jsonl(path: Path) -> list[dict]:
    """One JSON object per non-blank line; a problem names its line number."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise ValueError(f"line {line} is not UTF-8 text "
                         f"(byte {data[err.start]:#x}); JSONL files must be UTF-8") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ValueError(f"line {n} is not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(row, dict):
            raise ValueError(f"line {n} is a JSON {type(row).__name__}, expected an object (a row)")
        rows.append(row)
    return rows


READERS = {".parquet": read_parquet, ".jsonl": read_jsonl}


def load_rows(path_or_paths: str | Path | Sequence[str | Path]) -> list[dict]:
    """All rows of one file or several, concatenated in order; the extension picks the reader."""
    paths = [path_or_paths] if isinstance(path_or_paths, (str, Path)) else list(path_or_paths)
    rows = []
    for path in paths:
        try:
            rows += read_rows(path)
        except ValueError as err:
            raise ValueError(f"{str(path)!r}: {err}") from None
    return rows


def read_rows(path: str | Path) -> list[dict]:
    """The rows of one file; a problem is a ValueError naming the line (JSONL) but not the file."""
    path = Path(path)
    if path.suffix not in READERS:
        raise ValueError(f"cannot read it: supported extensions are {', '.join(READERS)}")
    if not path.is_file():
        raise FileNotFoundError(f"no data file at {str(path)!r}")
    return READERS[path.suffix](path)


def read_column(path: str | Path, column: str) -> list:
    """One column of a data file, None where a row lacks it (parquet reads that column alone)."""
    path = Path(path)
    if path.suffix == ".parquet":
        try:
            if column not in pq.read_schema(path).names:
                return []
            return pq.read_table(path, columns=[column]).column(column).to_pylist()
        except (OSError, ValueError) as err:
            raise ValueError(f"not a readable parquet file ({str(err).splitlines()[0]})") from None
    return [row.get(column) for row in read_rows(path)]


def load_dataset(key: str, paths: Sequence[str], tokenizer: PreTrainedTokenizerBase, **options) -> "PromptDataset":
    """One dataset over the files of config key `key`; any problem with a file (unreadable, empty,
    a bad row) is a ConfigError naming the file and its line or row, before training starts."""
    items: list[PromptItem] = []
    filtered, shortest = 0, []
    for path in paths:
        try:
            rows = read_rows(path)
            if not rows:
                raise ValueError("the file holds no rows")
            part = PromptDataset(rows, tokenizer, first_index=len(items) + filtered, folder=Path(path).parent, **options)
            items, filtered = items + part.items, filtered + part.filtered
            shortest.append(part.shortest)
        except (KeyError, ValueError) as err:
            raise ConfigError(key, path, err.args[0]) from None
    if filtered and not items:
        raise ConfigError("data.filter_overlong_prompts", True, f"dropped every row of {key} ({filtered} prompts): "
                          f"the shortest prompt has {min(shortest)} tokens, over data.max_prompt_length="
                          f"{options.get('max_prompt_length', 512)}; raise the limit")
    dataset = PromptDataset([], tokenizer, **options)
    dataset.items, dataset.filtered = items, filtered
    return dataset


@dataclass(frozen=True)
class PromptItem:
    """One tokenized prompt and what its reward needs."""
    prompt_ids: list[int]
    prompt_text: str  # after the chat template, before any truncation
    data_source: str   # the row's `reward_fn_key` column (verl's data.reward_fn_key): picks the reward
    ground_truth: Any  # as the row stores it: a string, a list, a dict
    extra_info: dict   # the row's, plus "raw_prompt" (its messages) with return_raw_chat
    index: int
    agent_name: Optional[str] = None  # the row's agent_name column: the agent loop it runs (plait/agents)
    multi_modal: dict = field(default_factory=dict)  # {"images": [PIL RGB]} of a row with images; {}: text only


TRUNCATIONS = ("error", "left", "right", "middle")


def truncate(ids: list[int], max_len: int, side: str) -> list[int]:
    """Keep `max_len` tokens: the last ones ('left' cuts the start), the first ones ('right'), or
    the first and last halves ('middle', the extra token going to the end)."""
    if side == "left":
        return ids[-max_len:]
    if side == "right":
        return ids[:max_len]
    head = max_len // 2
    return ids[:head] + ids[len(ids) - (max_len - head):]


class PromptDataset:
    """Rows tokenized for generation. A prompt over `max_prompt_length` tokens is dropped with
    `filter_overlong_prompts` (`self.filtered` counts them), else `truncation` decides: 'error'
    refuses it, 'left', 'right' and 'middle' cut it (see `truncate`)."""

    def __init__(self, rows: Sequence[dict], tokenizer: PreTrainedTokenizerBase,
                 prompt_key: str = "prompt", max_prompt_length: int = 512,
                 truncation: str = "error", filter_overlong_prompts: bool = False,
                 return_raw_chat: bool = False, reward_fn_key: str = "data_source", first_index: int = 0,
                 media_keys: dict[str, str] | None = None, chat_template_kwargs: dict | None = None,
                 processor=None, image_patch_size: int = 14, folder: Path | None = None):
        """`processor` (plait/models_vl.VLProcessor): a vision-language model's; rows' images then go with their
        prompts. None: a text model, and a row holding media is refused."""
        check(max_prompt_length > 0, "max_prompt_length", max_prompt_length, "a positive integer")
        check(truncation in TRUNCATIONS, "truncation", truncation, f"one of {', '.join(TRUNCATIONS)}")
        media_keys = dict(media_keys or {})
        image_column = media_keys.pop("data.image_key", "images") if processor is not None else None
        for i, row in enumerate(rows):
            check_text_only(first_index + i, row, media_keys)
        items = [self._item(i, row, tokenizer, prompt_key, return_raw_chat, reward_fn_key, first_index,
                            chat_template_kwargs or {}) for i, row in enumerate(rows)]
        if image_column is not None:
            items = [self._with_images(it, i, row, image_column, prompt_key, processor, image_patch_size, folder,
                                       chat_template_kwargs or {}) for i, (it, row) in enumerate(zip(items, rows))]
        self.shortest = min((len(it.prompt_ids) for it in items), default=0)  # tokens; names the limit when all are dropped
        if filter_overlong_prompts:
            kept = [it for it in items if len(it.prompt_ids) <= max_prompt_length]
            self.filtered, items = len(items) - len(kept), kept
        else:
            self.filtered = 0
        self.items = [self._fit(it, max_prompt_length, truncation) for it in items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    @staticmethod
    def _item(i: int, row: dict, tokenizer: PreTrainedTokenizerBase, prompt_key: str,
              return_raw_chat: bool, reward_fn_key: str, first_index: int, chat_template_kwargs: dict) -> PromptItem:
        missing = [k for k in (prompt_key, reward_fn_key, "reward_model") if k not in row]
        if missing:
            raise KeyError(f"row {i} has no {', '.join(map(repr, missing))}; "
                           f"its keys are {', '.join(map(repr, row))}")
        reward_model = row["reward_model"]
        if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
            raise ValueError(f"row {i}: reward_model.ground_truth is missing or null; every row needs "
                             f"the answer its reward is scored against (reward_model: {reward_model!r})")
        prompt = row[prompt_key]
        for name, value in ((f"'{prompt_key}'", prompt), ("reward_model.ground_truth", reward_model["ground_truth"]),
                            (f"'{reward_fn_key}'", row[reward_fn_key])):
            bad = not_text(value)
            if bad:  # bytes would reach the prompt, or the reward's comparison, as their repr: b'...'
                raise ValueError(f"row {i}: {name} holds {bad}; text fields are UTF-8 strings")
        if isinstance(prompt, str):  # used as is, with the tokenizer's own specials (Llama's BOS)
            text, ids = prompt, tokenizer(prompt)["input_ids"]
        else:
            check_messages(i, prompt_key, prompt)
            if tokenizer.chat_template is None:
                raise ValueError(f"row {i}: '{prompt_key}' is a list of messages but the "
                                 "tokenizer has no chat template; give plain-string prompts")
            text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False,
                                                 **chat_template_kwargs)  # data.apply_chat_template_kwargs
            # The template already wrote any special tokens the model expects.
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        extra_info = dict(row.get("extra_info") or {})
        if return_raw_chat:
            extra_info["raw_prompt"] = prompt if isinstance(prompt, str) else list(prompt)
        return PromptItem(prompt_ids=ids, prompt_text=text, data_source=row[reward_fn_key],
                          ground_truth=reward_model["ground_truth"],
                          extra_info=extra_info, index=int(extra_info.get("index", first_index + i)),
                          agent_name=row.get("agent_name"))

    @staticmethod
    def _with_images(item: PromptItem, i: int, row: dict, column: str, prompt_key: str, processor,
                     patch_size: int, folder: Path | None, chat_template_kwargs: dict) -> PromptItem:
        """`item` with the row's images: placed at its `<image>` placeholders, decoded, resized, their tokens
        in the prompt (the processor expands each image's pad token to the image's token count)."""
        from plait.models_vl import fetch_image  # here: models_vl imports torch (seconds), text-only runs never need it
        entries = row.get(column)
        if entries in (None, [], ""):
            return item
        if not isinstance(entries, (list, tuple)):
            raise ValueError(f"row {i}: column {column!r} (data.image_key) holds {type(entries).__name__}; "
                             "expected a list of images")
        prompt = row[prompt_key]
        if isinstance(prompt, str):
            raise ValueError(f"row {i}: '{prompt_key}' is a plain string and the row has images; images go in "
                             "chat messages at <image> placeholders")
        images = []
        for j, entry in enumerate(entries):
            try:
                images.append(fetch_image(entry, patch_size, folder))
            except ValueError as err:
                raise ValueError(f"row {i}: image {j}: {err}") from None
        text = processor.apply_chat_template(image_messages(i, prompt, len(images)), add_generation_prompt=True,
                                             **chat_template_kwargs)
        try:
            ids = processor.tokens(text, processor.images(images))
        except ValueError as err:
            raise ValueError(f"row {i}: {err}") from None
        return dataclasses.replace(item, prompt_ids=ids, prompt_text=text, multi_modal={"images": images})

    @staticmethod
    def _fit(item: PromptItem, max_len: int, truncation: str) -> PromptItem:
        if len(item.prompt_ids) <= max_len:
            return item
        if item.multi_modal and truncation != "error":  # a cut would split an image's tokens from its pixels
            raise ValueError(f"row {item.index}: prompt with images is {len(item.prompt_ids)} tokens, longer than "
                             f"max_prompt_length={max_len}, and is not truncated; set data.max_prompt_length="
                             f"{len(item.prompt_ids)} or data.filter_overlong_prompts=true")
        if truncation == "error":
            raise ValueError(f"row {item.index}: prompt is {len(item.prompt_ids)} tokens, longer than "
                             f"max_prompt_length={max_len}; set data.max_prompt_length={len(item.prompt_ids)} or "
                             "data.truncation=left (or right, middle) or data.filter_overlong_prompts=true")
        return dataclasses.replace(item, prompt_ids=truncate(item.prompt_ids, max_len, truncation))


def check_text_only(i: int, row: dict, media_keys: dict[str, str]) -> None:
    """Row `i` holds no media in the columns `media_keys` names ({config key: column}): training on the text
    alone would drop them without a word. Images need a vision-language model (Qwen2-VL, Qwen2.5-VL); videos
    and audio are not implemented for any model."""
    for key, column in media_keys.items():
        value = row.get(column)
        if value not in (None, [], {}, ""):
            needs = ("a vision-language model (Qwen2-VL or Qwen2.5-VL) and actor_rollout_ref.model.path is a text "
                     "model" if key == "data.image_key" else "what plait does not implement (it trains on text and "
                     "images)")
            raise ValueError(f"row {i}: column {column!r} ({key}) holds {type(value).__name__} media, which needs "
                             f"{needs}; training would drop them: remove the column's values or the rows")


def image_messages(i: int, prompt: list, count: int) -> list[dict]:
    """Row `i`'s messages with each `<image>` placeholder of a string content turned into an image content part
    and the text around it into text parts (verl's RLHFDataset); the placeholders must number `count`."""
    out, seen = [], 0
    for message in prompt:
        content = message["content"]
        if isinstance(content, str):
            parts = [p for p in re.split("(<image>)", content) if p]
            seen += parts.count("<image>")
            content = [{"type": "image"} if p == "<image>" else {"type": "text", "text": p} for p in parts]
        out.append({**message, "content": content})
    if seen != count:
        raise ValueError(f"row {i}: the prompt has {seen} <image> placeholders and the row {count} images; "
                         "they must match")
    return out


def not_text(value: Any) -> str | None:
    """What in a prompt is not text: bytes (a binary parquet column: a chat template would write
    their repr, `b'...'`, into the prompt) or a string that is not valid Unicode (a lone surrogate
    from a JSON escape); None when it is all text."""
    if isinstance(value, (bytes, bytearray)):
        try:
            value.decode("utf-8")
            return f"bytes, not a string ({bytes(value)[:40]!r})"
        except UnicodeDecodeError as err:
            return f"bytes that are not UTF-8 (byte {value[err.start]:#x} at offset {err.start})"
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return f"a string that is not valid Unicode (code point {ord(value[err.start]):#x} at offset {err.start})"
        return None
    parts = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((bad for bad in map(not_text, parts) if bad), None)


def check_messages(i: int, prompt_key: str, prompt: Any) -> None:
    """A chat prompt is a list of {"role": str, "content": ...} messages; row `i` is named otherwise."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError(f"row {i}: '{prompt_key}' is {prompt!r:.80}; expected a string or a non-empty list "
                         "of chat messages ({'role': ..., 'content': ...})")
    for j, message in enumerate(prompt):
        missing = [k for k in ("role", "content") if not isinstance(message, dict) or message.get(k) is None]
        if missing:
            raise ValueError(f"row {i}: '{prompt_key}' message {j} has no {' or '.join(map(repr, missing))}: "
                             f"{message!r:.80}; a chat message is {{'role': ..., 'content': ...}}")


def iterate_batches(dataset: PromptDataset, batch_size: int, shuffle: bool = True,
                    seed: int = 0, epoch: int = 0) -> Iterator[list[PromptItem]]:
    """The full batches of one epoch; the order depends only on (seed, epoch)."""
    if len(dataset) < batch_size:
        raise ValueError(f"{len(dataset)} prompts make no full batch of {batch_size}; "
                         "lower data.train_batch_size or add prompts")
    order = list(range(len(dataset)))
    if shuffle:
        random.Random(f"{seed}/{epoch}").shuffle(order)
    for start in range(0, len(order) - batch_size + 1, batch_size):
        yield [dataset[i] for i in order[start:start + batch_size]]


def prompt_batch(items) -> PromptBatch:
    """Dataset items as one PromptBatch (the rollout's input)."""
    media = [it.multi_modal for it in items]
    return PromptBatch(prompt_ids=[it.prompt_ids for it in items], data_sources=[it.data_source for it in items],
                       ground_truths=[it.ground_truth for it in items], extra_infos=[it.extra_info for it in items],
                       indices=[it.index for it in items], agent_names=[it.agent_name for it in items],
                       multi_modal=media if any(media) else [])
