"""build(config) -> a ready lifecycle; run() trains. The single controller's wiring, nothing more.

It resolves the model (a local Hugging Face directory, or the built-in demo model with its cached
warm start), loads data and the reward function, refuses a profiler tool that cannot run here
(before any training work), spawns the worker groups on the chosen backend and hands the trainer
mode to the lifecycle.
"""

from __future__ import annotations

import os
import sys

import torch
import transformers

from plait.config import PlaitConfig
from plait.configtree import ConfigError, to_dict
from plait.data.dataset import PromptDataset, load_rows
from plait.data.rewards import default_compute_score, load_custom_reward
from plait.data.tasks import write_task_files
from plait.models import create_tiny_model, load_tokenizer
from plait.profiler import validate_environment
from plait.trainers.lifecycle import Lifecycle, LifecycleConfig
from plait.trainers.tracking import Tracker

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(cfg: PlaitConfig) -> str:
    device = cfg.trainer.device
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device", device, "CUDA is not available on this machine; use cpu or auto")
    return device


def resolve_model(cfg: PlaitConfig) -> str:
    """The policy's starting weights: the user's directory, or the demo model warm-started once and cached."""
    path = cfg.actor_rollout_ref.model.path
    if path is not None:
        if not os.path.isdir(path):
            raise ConfigError("actor_rollout_ref.model.path", path, "not a directory; give a local Hugging Face model directory")
        return path
    from plait.data.warmstart import sft_warmstart
    demo = cfg.demo
    cache = os.path.join(cfg.output_dir, "demo_model")
    base = create_tiny_model(os.path.join(cache, f"init_{demo.model_size}"), size=demo.model_size, seed=cfg.trainer.seed)
    if demo.warmstart_steps == 0:
        return base
    return sft_warmstart(base, cfg.data.task, os.path.join(cache, "warmstart"), steps=demo.warmstart_steps,
                         batch_size=demo.warmstart_batch_size, lr=demo.warmstart_lr, seed=cfg.trainer.seed)


def resolve_data(cfg: PlaitConfig) -> tuple[list[str], list[str] | None]:
    d = cfg.data
    if d.train_files is not None:
        return d.train_files, d.val_files
    train, val = write_task_files(d.task, os.path.join(cfg.output_dir, "data"), d.train_size, d.val_size, d.seed)
    return [train], [val]


def resolve_reward(cfg: PlaitConfig):
    custom = cfg.custom_reward_function
    if not custom.path:
        return default_compute_score
    try:
        return load_custom_reward(custom.path, custom.name)
    except FileNotFoundError:
        raise ConfigError("custom_reward_function.path", custom.path, "no such file") from None
    except AttributeError as err:
        raise ConfigError("custom_reward_function.name", custom.name, str(err)) from None


def check_data_files(cfg: PlaitConfig) -> None:
    for key, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files)):
        for path in files or []:
            if not os.path.isfile(path):
                raise ConfigError(key, path, "no such file (parquet or JSONL rows in verl's format)")


def build(cfg: PlaitConfig, progress: bool = True) -> Lifecycle:
    validate_environment(cfg.global_profiler, role_profilers(cfg))
    check_data_files(cfg)  # bad input is refused before any training work
    reward_fn = resolve_reward(cfg)
    transformers.utils.logging.disable_progress_bar()  # per-load weight bars drown the step lines
    if cfg.trainer.num_threads:
        torch.set_num_threads(cfg.trainer.num_threads)
    t = cfg.trainer
    tracker = Tracker(cfg.output_dir, t.logger, t.project_name, t.experiment_name or t.mode, to_dict(cfg), progress=progress)
    backend = make_backend(cfg)
    try:
        if t.mode == "diffusion":
            from plait.trainers.diffusion import build_diffusion_trainer
            trainer = build_diffusion_trainer(cfg, backend, resolve_device(cfg))
        else:
            trainer = build_lm_trainer(cfg, backend, reward_fn)
    except BaseException:
        backend.shutdown()
        raise
    lc = LifecycleConfig(output_dir=cfg.output_dir, test_freq=t.test_freq, save_freq=t.save_freq,
                         val_before_train=t.val_before_train, resume_mode=t.resume_mode,
                         resume_from_path=t.resume_from_path, max_ckpt_to_keep=t.max_ckpt_to_keep)
    return Lifecycle(lc, trainer, cfg.global_profiler, tracker, shutdown=backend.shutdown)


def role_profilers(cfg: PlaitConfig) -> dict:
    arr = cfg.actor_rollout_ref
    return {"actor": arr.actor.profiler, "rollout": arr.rollout.profiler, "ref": arr.ref.profiler,
            "critic": cfg.critic.profiler}


def make_backend(cfg: PlaitConfig):
    from plait.backends import make_backend as backend_for
    return backend_for(cfg, role_profilers(cfg), resolve_device(cfg))


def build_lm_trainer(cfg: PlaitConfig, backend, reward_fn):
    """Model, data, reward and the four language-model roles, handed to the trainer mode."""
    from plait.trainers import MODES
    from plait.trainers.lm import Roles
    from plait.workers.actor import Actor
    from plait.workers.critic import Critic
    from plait.workers.ref import Ref
    from plait.workers.rollout import Rollout

    device = resolve_device(cfg)
    dtype = DTYPES[cfg.actor_rollout_ref.model.dtype]
    model_path = resolve_model(cfg)
    tokenizer = load_tokenizer(model_path)
    train_files, val_files = resolve_data(cfg)
    d = cfg.data
    make = lambda files: PromptDataset(load_rows(files), tokenizer, prompt_key=d.prompt_key,  # noqa: E731
                                       max_prompt_length=d.max_prompt_length, truncation=d.truncation)
    train_data = make(train_files)
    val_data = make(val_files) if val_files else None
    arr = cfg.actor_rollout_ref
    temp, n = arr.rollout.temperature or 1.0, arr.rollout.n
    roles = Roles(
        actor=backend.spawn("actor", Actor, model_path, arr.actor, n, temp, device=device, dtype=dtype, seed=cfg.trainer.seed),
        rollout=backend.spawn("rollout", Rollout, model_path, d.max_response_length, tokenizer, device=device, dtype=dtype,
                              ignore_eos=arr.rollout.ignore_eos),
        ref=backend.spawn("ref", Ref, model_path, arr.ref, temp, device=device, dtype=dtype) if cfg.uses_ref else None,
        critic=(backend.spawn("critic", Critic, cfg.critic.model.path or model_path, cfg.critic, n, device=device, dtype=dtype)
                if cfg.critic.enable else None))
    return MODES[cfg.trainer.mode](cfg, roles, tokenizer, train_data, val_data, reward_fn, backend.profile_targets())


def run(cfg: PlaitConfig, progress: bool = True) -> dict[str, float]:
    os.makedirs(cfg.output_dir, exist_ok=True)
    print(f"plait: outputs in {cfg.output_dir}", file=sys.stderr)
    return build(cfg, progress=progress).run()
