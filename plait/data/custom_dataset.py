"""verl's `data.custom_cls`: a user's dataset class, built as verl's trainer builds it, its items read as rows.

With `data.custom_cls.path` set, verl 0.9.1 makes the training and the validation set with
`cls(data_files=<the files>, tokenizer=..., processor=..., config=<the data section>, max_samples=-1)`; its
agent loops then generate from each item's `raw_prompt` (the chat messages) and its reward reads the item's
data source (`data.reward_fn_key`), `reward_model.ground_truth` and `extra_info`. Here the class is loaded
from the user's file (or `pkg://module.path`), checked to be a torch Dataset and built the same way once, before
any model loads; every item becomes a row of verl's format, which plait/data/dataset.py tokenizes, filters,
truncates and batches exactly as it does a file's rows. Images inside the messages (verl's `{"type": "image"}`
parts) become the row's images at `<image>` placeholders.

Refused, one line naming the class, the item and the field: an item that is not a dict or has no `raw_prompt`,
tensors other than verl's placeholder (`dummy_tensor`: plait generates from the messages, as verl 0.9's agent
loops do), precomputed multimodal inputs, and video or audio parts. Left out: datasets without a length
(every item is read at start), verl's samplers and data generators (data.sampler, data.datagen).
"""

from __future__ import annotations

import importlib
import os
import sys
import time
from pathlib import Path
from typing import Any

from plait.configtree import ConfigError, raise_all, to_dict
from plait.data.dataset import PromptDataset
from plait.data.rewards import import_user_file, missing_module, unscored_sources
from plait.safeload import first_line

PATH_KEY, NAME_KEY = "data.custom_cls.path", "data.custom_cls.name"
PLACEHOLDER = "dummy_tensor"  # verl's RLHFDataset adds it only so that its DataProto has a tensor batch
PRECOMPUTED = ("multi_modal_data", "multi_modal_inputs")


def load_dataset_class(path: str, name: str) -> type:
    """The class `name` of the user's file `path` (or of module M for `pkg://M`, verl's other form), which
    must subclass torch.utils.data.Dataset as verl requires. Its imports resolve against the working
    directory too: verl's scripts run its trainer with `python -m` from the folder their files import from
    (`from recipe.retool...`)."""
    from torch.utils.data import Dataset
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    if path.startswith("pkg://"):
        module_name = path.removeprefix("pkg://").replace("/", ".")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            raise ConfigError(PATH_KEY, path, f"importing it failed: {missing_module(err)}") from None
        except Exception as err:  # noqa: BLE001 - the user's module-level code; one line, not a traceback
            raise ConfigError(PATH_KEY, path, f"importing it failed: {type(err).__name__}: {first_line(err)}") from None
    else:
        file = path.removeprefix("file://")
        if not Path(file).is_file():
            raise ConfigError(PATH_KEY, path, "no such file (a Python file defining the dataset class, or pkg://module)")
        module = import_user_file(PATH_KEY, file, f"plait_custom_dataset_{Path(file).stem}")
    cls = vars(module).get(name)
    if not isinstance(cls, type):
        found = [k for k, v in vars(module).items()  # the file's own, not those it imports
                 if isinstance(v, type) and issubclass(v, Dataset) and v.__module__ == module.__name__]
        raise ConfigError(NAME_KEY, name, f"{path!r} defines no class {name!r}; its Dataset classes: "
                                          f"{', '.join(found) or 'none'}")
    if not issubclass(cls, Dataset):
        raise ConfigError(NAME_KEY, name, f"{cls.__name__} in {path!r} is not a torch.utils.data.Dataset subclass; "
                                          "verl builds data.custom_cls only from one")
    return cls


def load_custom_dataset(cfg, key: str, files: list[str], tokenizer, hf_processor=None, **options) -> PromptDataset:
    """The prompts of the files of config key `key` (data.train_files or data.val_files) as the user's
    class reads them; `hf_processor`: transformers' processor of a vision-language model (what verl passes
    the class), None for a text model. `options`: PromptDataset's."""
    c = cfg.data.custom_cls
    cls = load_dataset_class(c.path, c.name)
    try:
        dataset = cls(data_files=list(files), tokenizer=tokenizer, processor=hf_processor, config=data_section(cfg),
                      max_samples=-1)
        count = len(dataset)
    except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's class; one line, not a traceback (nor exit 0)
        raise ConfigError(NAME_KEY, c.name, f"building {cls.__name__} over {key}={list(files)} failed: "
                                            f"{type(err).__name__}: {first_line(err)}") from None
    d = cfg.data
    rows = []
    for i, item in enumerate(read_items(cls.__name__, dataset, count)):
        rows.append(verl_row(cls.__name__, i, item, d.prompt_key, d.reward_fn_key, d.image_key))
    if not rows:
        raise ConfigError(NAME_KEY, c.name, f"{cls.__name__} over {key}={list(files)} holds no items")
    if not (cfg.reward.custom_reward_function.path or cfg.reward.reward_model.enable):  # as for data files, at start
        raise_all(unscored_sources(key, f"{cls.__name__}'s items", d.reward_fn_key, [r.get(d.reward_fn_key) for r in rows],
                                   [r.get("reward_model") for r in rows], cfg.reward.sandbox_fusion.url))
    try:
        data = PromptDataset(rows, tokenizer, **options)
    except (KeyError, ValueError) as err:
        raise ConfigError(NAME_KEY, c.name, f"{cls.__name__}'s items over {key}: {err.args[0]}") from None
    if not data.items:
        raise ConfigError("data.filter_overlong_prompts", True, f"dropped every item of {cls.__name__} over {key} "
                                                                f"({data.filtered} prompts); raise data.max_prompt_length")
    return data


def read_items(name: str, dataset, count: int):
    """Every item, in order: all are read at start (plait keeps the tokenized prompts in memory). The items'
    memory so far is projected onto `count` at each power of two; a length that would not fit in the memory
    this machine has free is refused there (a len() of 10^9 grew to GiBs without a word), and a read that
    runs long says where it is every PROGRESS_S seconds."""
    import psutil
    start, said = time.monotonic(), time.monotonic()
    before = psutil.Process().memory_info().rss
    for i in range(count):
        yield read_item(name, dataset, i)
        done = i + 1
        if done >= 1024 and done & (done - 1) == 0 and done < count:
            grown = max(psutil.Process().memory_info().rss - before, 0)
            need, free = grown / done * count, psutil.virtual_memory().available
            if need > 0.8 * free:
                raise ConfigError(NAME_KEY, name, f"len() of {name} is {count}: its first {done} items took "
                                  f"{grown / 2**20:.0f} MiB, so all would need ~{need / 2**30:.1f} GiB and "
                                  f"{free / 2**30:.1f} GiB are free (every item is read and kept at start); "
                                  "give the class fewer items")
        if time.monotonic() - said > PROGRESS_S:
            said = time.monotonic()
            print(f"plait: data.custom_cls: read {done} of {count} items of {name} in {said - start:.0f} s",
                  file=sys.stderr)


PROGRESS_S = 10.0


def read_item(name: str, dataset, i: int) -> Any:
    try:
        return dataset[i]
    except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's __getitem__ (sys.exit(0): not a clean exit)
        raise ConfigError(NAME_KEY, name, f"{name}[{i}] failed: {type(err).__name__}: {first_line(err)}") from None


def data_section(cfg):
    """verl's `config` argument: the data section (an OmegaConf DictConfig where omegaconf is installed, as
    verl passes it; a dict otherwise: both answer `config.get(key, default)`)."""
    section = to_dict(cfg.data)
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return section
    return OmegaConf.create(section)


def verl_row(name: str, i: int, item: Any, prompt_key: str, reward_fn_key: str, image_key: str) -> dict:
    """Item `i` of class `name` as a row of verl's format: the messages under `prompt_key`, the images
    of their image parts under `image_key`, tools_kwargs / interaction_kwargs in extra_info (where plait's
    agent loops read them)."""
    import torch
    where = f"{name}[{i}]"
    if not isinstance(item, dict):
        raise ConfigError(NAME_KEY, name, f"{where} is a {type(item).__name__}; verl's trainer takes dict items "
                                          "(raw_prompt, data_source, reward_model, extra_info, ...)")
    if "raw_prompt" not in item:
        raise ConfigError(NAME_KEY, name, f"{where} has no 'raw_prompt' (its keys: {', '.join(map(str, item))}); "
                                          "verl 0.9's agent loops generate from those chat messages, so does plait")
    for field, value in item.items():
        if (isinstance(value, torch.Tensor) and field != PLACEHOLDER) or field in PRECOMPUTED:
            raise ConfigError(NAME_KEY, name, f"{where}[{field!r}] holds precomputed model inputs; plait tokenizes "
                                              "raw_prompt itself (as verl 0.9's agent loops do) and would drop them")
    messages, images = split_media(name, where, item["raw_prompt"])
    extra = dict(item.get("extra_info") or {})
    for field in ("tools_kwargs", "interaction_kwargs"):
        if item.get(field):
            extra[field] = item[field]
    row = {prompt_key: messages, "extra_info": extra, "agent_name": item.get("agent_name"),
           **{k: item[k] for k in (reward_fn_key, "reward_model") if k in item}}
    if images:
        row[image_key] = images
    return row


def split_media(name: str, where: str, messages: Any) -> tuple[Any, list]:
    """`messages` with each list content turned back into text, an image part into an `<image>`
    placeholder, and the images in order (verl's RLHFDataset makes the parts from the placeholders)."""
    if not isinstance(messages, (list, tuple)):
        return messages, []
    out, images = [], []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, (list, tuple)):
            out.append(message)
            continue
        text = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text.append(part.get("text", ""))
            elif kind == "image":
                text.append("<image>")
                images.append(part.get("image") if part.get("image") is not None else
                              {k: v for k, v in part.items() if k != "type"})
            else:
                raise ConfigError(NAME_KEY, name, f"{where}['raw_prompt'] has a {kind!r} content part; plait trains on "
                                                  "text and images (videos and audio are not implemented)")
        out.append({**message, "content": "".join(text)})
    return out, images
