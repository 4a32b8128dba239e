"""Checks of a config against this machine that need neither torch nor transformers: data files exist,
model paths are directories (a hub id gets how to download it), loggers are installed and logged in.

`driver.preflight` runs them with the checks that load things (model dirs' contents, the reward
function, the device); when the config tree itself has errors, the CLI runs these on the rest of
the tree (`ConfigError.partial`) so that one pass reports both, and a typo still fails in about a
second. Left out: anything that imports or loads a model.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from plait.configtree import ConfigError, ConfigErrors, raise_all
from plait.modes import MODES

BUILTIN_MODEL_NAMES = ("smollm2-135m-instruct", "tiny-qwen2-vl-demo", "demo-grpo-teacher")  # builtin_models.BUILTIN_MODELS:
# built from an installed package (SmolLM2), from a config plus a warm start (the vl_demo preset's, plait/vl_demo.py)
# or by a run of the demo (the opd_demo preset's teacher)
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "swanlab": "swanlab"}


def check_data_files(cfg) -> None:
    if cfg.data.custom_cls.path:  # the user's class reads them as it likes (folders, hub names): verl hands it the paths
        return
    raise_all([ConfigError(key, path, "no such file (parquet or JSONL rows in verl's format)")
               for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files))
               for path in files or [] if not os.path.isfile(path)])


def model_dirs_exist(cfg) -> None:
    """The model paths that must be directories and are not (a built-in model name is not a path)."""
    model, rm = cfg.actor_rollout_ref.model, cfg.reward.reward_model
    paths = (("actor_rollout_ref.model.path", model.path if MODES[cfg.trainer.mode].lm and model.path not in BUILTIN_MODEL_NAMES else None),
             ("critic.model.path", cfg.critic.model.path if cfg.critic.enable else None),
             ("actor_rollout_ref.model.lora_adapter_path", model.lora_adapter_path if model.lora_rank else None),
             ("reward.reward_model.model_path", rm.model_path if rm.enable and rm.model_path not in BUILTIN_MODEL_NAMES else None))
    raise_all([ConfigError(key, path, not_a_directory(path)) for key, path in paths
               if path is not None and not os.path.isdir(path)])


def light_errors(cfg) -> list[ConfigError]:
    """Every error these checks find in `cfg`."""
    return collect_errors((lambda: check_data_files(cfg), lambda: model_dirs_exist(cfg),
                           lambda: check_loggers(cfg.trainer.logger)))


def collect_errors(rules) -> list[ConfigError]:
    """Every rule run, and what each raised gathered: one pass of errors, not the first one."""
    errors = []
    for rule in rules:
        try:
            rule()
        except ConfigErrors as err:
            errors += err.errors
        except ConfigError as err:
            errors.append(err)
    return errors


def not_a_directory(path: str | Path) -> str:
    """Why a model path is refused, with how to get a local copy when it looks like a hub id (org/name)."""
    text = str(path)
    parts = text.split("/")
    if len(parts) == 2 and all(parts) and not text.startswith((".", "~")):
        return (f"not a local directory; plait never downloads: it looks like a Hugging Face hub id, so download "
                f"it to a folder first (huggingface-cli download {text} --local-dir models/{parts[1]}, or "
                f"huggingface_hub.snapshot_download('{text}', local_dir='models/{parts[1]}')) and pass that folder")
    return "not a directory; give a local Hugging Face model directory"


def check_loggers(loggers: list[str]) -> None:
    """A logger whose package is missing, or W&B without a login, is a config error at start (train and
    config show alike), not wandb.init's traceback after the models loaded."""
    for name in loggers:
        if name in PACKAGES and importlib.util.find_spec(PACKAGES[name]) is None:
            raise ConfigError("trainer.logger", name, f"needs the {PACKAGES[name]} package: pip install {PACKAGES[name]}")
        if name == "wandb" and not wandb_logged_in(dict(os.environ), os.path.expanduser("~/.netrc")):
            raise ConfigError("trainer.logger", name, "W&B has no login here: run `wandb login`, or set WANDB_API_KEY, "
                                                      "or WANDB_MODE=offline (logs under ./wandb, `wandb sync` later)")


def wandb_logged_in(env: dict[str, str], netrc_path: str) -> bool:
    """What wandb.init reads before asking for a key: WANDB_API_KEY, an offline/disabled mode, or the
    key `wandb login` wrote to ~/.netrc for the API host (WANDB_BASE_URL's, default api.wandb.ai)."""
    import netrc
    from urllib.parse import urlparse
    if env.get("WANDB_API_KEY") or env.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(netrc_path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


