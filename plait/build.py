"""From a config to a trainer: one flat table of modes (`MODES`, at the bottom), each row the function
that builds that mode's trainer from (config, backend, device, tracker).

    driver.build ─▶ MODES[trainer.mode](cfg, backend, device, tracker) ─▶ a Trainer for the lifecycle
                     sync · one_step_off · fully_async: trainers/lm.build_lm_trainer with the mode's class
                     diffusion: build_diffusion_trainer below (flow model, conditions, image reward)

The language-model modes' model and data resolution (resolve_model, resolve_data) is still in
plait/trainers/lm.py; the diffusion mode's is here. A new mode is a row here and its name in
TrainerConfig.mode (plait/config.py).
"""

from __future__ import annotations

import os
from functools import partial
from typing import Callable

from plait.config import PlaitConfig
from plait.configtree import ConfigError
from plait.data.images import IMAGE_REWARDS, PROMPT_IMAGE_REWARDS, clip_score, condition_split
from plait.data.prompts import load_prompts
from plait.data.rewards import load_custom_reward
from plait.trainers.diffusion import Conditions, DiffusionTrainer
from plait.trainers.fully_async import FullyAsyncTrainer
from plait.trainers.lm import build_lm_trainer
from plait.trainers.one_step_off import OneStepOffTrainer
from plait.trainers.sync import SyncTrainer
from plait.workers.diffusers_policy import is_diffusers_policy
from plait.workers.diffusion import DiffusionActor, DiffusionRef, policy_config, pretrain_flow_model
from plait.workers.diffusion_pipeline import check_pipeline_folder, pipeline_class


def resolve_flow_model(cfg: PlaitConfig) -> str:
    """The policy's starting weights: the user's folder, or the built-in model pre-trained once and cached."""
    d = cfg.diffusion
    if d.model_path is not None and pipeline_class(d.model_path) is not None:
        try:
            check_pipeline_folder(d.model_path)
        except ValueError as err:
            raise ConfigError("diffusion.model_path", d.model_path, str(err)) from None
        return d.model_path
    if d.model_path is not None and is_diffusers_policy(d.model_path):
        return d.model_path
    if d.lora.enable:
        raise ConfigError("diffusion.lora.enable", True, "needs diffusion.model_path to be a diffusers policy "
                          "or pipeline folder")
    if d.model_path is not None:
        if not os.path.isfile(os.path.join(d.model_path, "settings.json")):
            raise ConfigError("diffusion.model_path", d.model_path, "not a folder saved by pretrain_flow_model "
                              "(settings.json, model.pt), a diffusers policy (plait_diffusers_policy.json) or a "
                              "diffusers pipeline (model_index.json)")
        return d.model_path
    out = os.path.join(cfg.output_dir, "demo_model", "flow")
    return str(pretrain_flow_model(d.model, d.pretrain_steps, d.pretrain_batch_size, d.pretrain_lr,
                                   cfg.trainer.seed, out))


def resolve_conditions(cfg: PlaitConfig, model_path: str) -> tuple[Conditions, Conditions]:
    """(training, validation) conditions: prompt rows for a pipeline, else class-id splits."""
    data = cfg.data
    if pipeline_class(model_path) is None:
        num_classes = policy_config(model_path).num_classes
        return condition_split("train", data.train_size, num_classes), condition_split("val", data.val_size, num_classes)
    if not data.train_files:
        raise ConfigError("data.train_files", data.train_files, "a prompt file (parquet/JSONL rows with "
                          f"{data.prompt_key!r}) is needed to train the pipeline in diffusion.model_path")
    try:
        train = load_prompts(data.train_files, data.prompt_key)
        val = load_prompts(data.val_files, data.prompt_key) if data.val_files else train[:data.val_size]
    except ValueError as err:
        raise ConfigError("data.train_files", data.train_files, str(err)) from None
    media = (data.image_key, data.video_key, data.audio_key)
    refuse_media("data.train_files", data.train_files, train, media)
    refuse_media("data.val_files" if data.val_files else "data.train_files", data.val_files or data.train_files, val, media)
    return train, val


def refuse_media(key: str, files, rows: list, columns: tuple[str, ...]) -> None:
    """A prompt row holding images, videos or audio is a ConfigError: a text-to-image pipeline generates from
    the prompt alone and would drop them without a word."""
    for i, row in enumerate(rows):
        held = [c for c in columns if row.metadata.get(c) not in (None, [], {}, "")]
        if held:
            raise ConfigError(key, files, f"prompt row {i}: column {held[0]!r} holds media; trainer.mode=diffusion "
                              "generates from the text prompt alone and would drop it: remove the column's values")


def resolve_image_reward(cfg: PlaitConfig, prompted: bool) -> tuple[str, Callable]:
    """The reward's name and function: the user's file, or a built-in of the kind the model needs."""
    d, custom = cfg.diffusion, cfg.reward.custom_reward_function
    if custom.path:
        return custom.name, load_custom_reward(custom.path, custom.name)
    builtins = [*PROMPT_IMAGE_REWARDS, "clip_score"] if prompted else list(IMAGE_REWARDS)
    if d.reward not in builtins:
        kind = "a text-to-image pipeline" if prompted else "a class-conditioned model"
        raise ConfigError("diffusion.reward", d.reward, f"with {kind} one of {', '.join(builtins)}")
    if d.reward == "clip_score":
        return d.reward, clip_score(d.reward_model_path)
    return d.reward, (PROMPT_IMAGE_REWARDS if prompted else IMAGE_REWARDS)[d.reward]


def build_diffusion_trainer(cfg: PlaitConfig, backend, device: str, tracker) -> DiffusionTrainer:
    """Model, conditions, reward and the roles (actor; ref for a full fine-tune with a KL), handed to the
    trainer. `tracker` is not used: validation images go to the trainer's own files and TensorBoard writer."""
    if cfg.algorithm.adv_estimator != "grpo":
        raise ConfigError("algorithm.adv_estimator", cfg.algorithm.adv_estimator,
                          "must be grpo with trainer.mode=diffusion (Flow-GRPO's group advantages)")
    d = cfg.diffusion
    model_path = resolve_flow_model(cfg)
    train_conds, val_conds = resolve_conditions(cfg, model_path)
    reward_name, reward_fn = resolve_image_reward(cfg, isinstance(train_conds, list))
    actor = backend.spawn("actor", DiffusionActor, model_path, d.actor, device=device, lora=d.lora, pipeline=d.pipeline)
    ref = None
    if d.actor.kl_loss_coef > 0 and not d.lora.enable:
        ref = backend.spawn("ref", DiffusionRef, model_path, device=device, pipeline=d.pipeline)
    return DiffusionTrainer(cfg, actor, ref, reward_name, reward_fn, train_conds, val_conds, backend.profile_targets())


MODES = {
    "sync": partial(build_lm_trainer, mode=SyncTrainer),
    "one_step_off": partial(build_lm_trainer, mode=OneStepOffTrainer),
    "fully_async": partial(build_lm_trainer, mode=FullyAsyncTrainer),
    "diffusion": build_diffusion_trainer,
}
