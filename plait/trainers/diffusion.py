"""Diffusion mode: Flow-GRPO for a flow-matching image policy, on the shared step lifecycle.

One step, each stage one call (timed by the lifecycle's timer, annotated in the workers):

    gen ─▶ reward ─▶ old_log_prob ─▶ ref ─▶ adv ─▶ update_actor

`gen` samples data.train_batch_size conditions x actor_rollout_ref.rollout.n images with the SDE
sampler; `ref` runs only when diffusion.actor.kl_loss_coef > 0. The sampler is the actor's own
model (rollout is colocated in the actor), so there is no weight sync and no update_weights
stage: the parameters after update N are policy version N. Step N's conditions and noise are
functions of N alone (a generator seeded with seed * 1_000_003 + N), so a resumed run repeats
the next step of an uninterrupted one. Validation samples the deterministic ODE on held-out
conditions from the same noise every time, so its reward moves only with the policy.

With a text-to-image pipeline (diffusion.model_path holds model_index.json) the conditions are
prompt rows from data.train_files (data.val_files, else the first data.val_size training prompts,
for validation); the actor encodes them, samples with classifier-free guidance and decodes with
the VAE inside `gen`, and the reward is `fn(images, prompts, metadata)`. Validation also writes a
grid of its images to <output dir>/val_images/step_<N>.png, and to TensorBoard when that logger
is on.

A "token" in the throughput metrics is one denoising-step latent: StepResult.num_tokens counts
the transitions trained (samples x window steps), response_tokens the ones generated (samples x
num_inference_steps). Profiling, timing, checkpoint layout, validation schedule and logging are
the lifecycle's, not here; nor are the sampler and update (plait/workers/diffusion.py), the math
(plait/algorithms/flow_grpo.py) or the conditions and rewards (plait/data/images.py).
"""

from __future__ import annotations

import json
import os
from typing import Callable

import torch
from torch import Tensor

from plait.algorithms.flow_grpo import group_advantages
from plait.config import PlaitConfig
from plait.configtree import ConfigError
from plait.data.images import IMAGE_REWARDS, PROMPT_IMAGE_REWARDS, clip_score, condition_split
from plait.data.prompts import PromptRow, load_prompts
from plait.data.rewards import load_custom_reward
from plait.trainers.lifecycle import StageTimer, StepResult
from plait.workers.diffusers_policy import is_diffusers_policy
from plait.workers.diffusion import DiffusionActor, DiffusionRef, policy_config, pretrain_flow_model
from plait.workers.diffusion_pipeline import check_pipeline_folder, pipeline_class

Conditions = Tensor | list[PromptRow]  # class ids [N], or a pipeline's prompt rows


class DiffusionTrainer:
    def __init__(self, cfg: PlaitConfig, actor, ref, reward_name: str, reward_fn: Callable, train_conds: Conditions,
                 val_conds: Conditions, targets):
        """`ref`: the ref role for full fine-tuning with a KL, else None (with LoRA the actor is its own reference)."""
        self.cfg, self.actor, self.ref, self.targets = cfg, actor, ref, targets
        self.reward_name, self.reward_fn = reward_name, reward_fn
        self.train_conds, self.val_conds = train_conds, val_conds
        self.prompted = isinstance(train_conds, list)
        size = cfg.data.train_batch_size
        self.batches_per_epoch = len(train_conds) // size
        if self.batches_per_epoch == 0:
            raise ConfigError("data.train_batch_size", size, f"must be <= the {len(train_conds)} training conditions")
        self.version = 0
        self.writer = None  # TensorBoard writer for validation images, opened at the first validation

    # -- the Trainer protocol -------------------------------------------------------------------

    def total_steps(self) -> int:
        return self.cfg.total_steps(self.batches_per_epoch)

    def start(self) -> None:
        pass

    def train_step(self, step: int, timer: StageTimer) -> StepResult:
        n = self.cfg.actor_rollout_ref.rollout.n
        batch = self.conditions(step)
        # A condition's n samples side by side: [B*n] ids or B*n rows.
        cond = [row for row in batch for _ in range(n)] if self.prompted else batch.repeat_interleave(n)
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed * 1_000_003 + step)
        with timer.stage("gen"):
            traj = self.actor.call(DiffusionActor.generate, self.actor_input(cond), generator)
        with timer.stage("reward"):
            scores = self.score(self.reward_fn, traj, cond)  # [B*n]
        with timer.stage("old_log_prob"):
            old_logp = self.actor.call(DiffusionActor.compute_logprobs, traj)  # [B*n, K]
        ref_mean = None
        if self.cfg.diffusion.actor.kl_loss_coef > 0:
            with timer.stage("ref"):  # [B*n, K, C, H, W]
                ref_mean = (self.actor.call(DiffusionActor.compute_ref_means, traj) if self.ref is None
                            else self.ref.call(DiffusionRef.compute_means, traj))
        with timer.stage("adv"):
            group_ids = torch.arange(len(cond), device=scores.device) // n  # [B*n]
            advantages = group_advantages(scores, group_ids)  # [B*n]
        with timer.stage("update_actor"):
            metrics = self.actor.call(DiffusionActor.update, traj, advantages, old_logp, ref_mean)
        self.version = step
        for name, values in (("score", scores), ("rewards", scores), ("advantages", advantages)):
            metrics |= {f"critic/{name}/mean": values.mean().item(), f"critic/{name}/max": values.max().item(),
                        f"critic/{name}/min": values.min().item()}
        # The actor recomputes what the sampler recorded; a gap means sampling and training disagree.
        metrics["training/rollout_logprob_diff_mean"] = (old_logp - traj.window_log_probs).abs().mean().item()
        steps = self.cfg.diffusion.actor.num_inference_steps
        return StepResult(metrics, num_tokens=old_logp.numel(), response_tokens=len(cond) * steps)

    def validate(self) -> dict[str, float]:
        """Rewards of ODE samples on the held-out conditions, always from the same noise."""
        size = self.cfg.data.val_batch_size or len(self.val_conds)
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed)
        trajs = [self.actor.call(DiffusionActor.generate, self.actor_input(self.val_conds[start:start + size]),
                                 generator, ode=True) for start in range(0, len(self.val_conds), size)]
        scores = {self.reward_name: torch.cat([self.score(self.reward_fn, traj, self.val_conds[i * size:][:size])
                                               for i, traj in enumerate(trajs)])}
        # The other built-in rewards show what the trained one is bought with (reward hacking).
        for name, fn in (PROMPT_IMAGE_REWARDS if self.prompted else IMAGE_REWARDS).items():
            if name != self.reward_name:
                scores[name] = torch.cat([self.score(fn, traj, self.val_conds[i * size:][:size])
                                          for i, traj in enumerate(trajs)])
        if self.prompted:
            self.save_images(torch.cat([traj.images for traj in trajs]).cpu())
        return {f"val-{'core' if name == self.reward_name else 'aux'}/{name}/reward/mean": values.mean().item()
                for name, values in scores.items()}

    def actor_input(self, cond: Conditions) -> Tensor | list[str]:
        """What DiffusionActor.generate takes: the class ids, or the rows' prompts."""
        return [row.prompt for row in cond] if self.prompted else cond

    def score(self, fn: Callable, traj, cond: Conditions) -> Tensor:
        """fn(images, prompts, metadata) for prompt rows, else fn(images, class ids).  # [B] float"""
        if self.prompted:
            return torch.as_tensor(fn(traj.images, [r.prompt for r in cond], [r.metadata for r in cond])).float().cpu()
        return fn(traj.images, traj.cond).float().cpu()

    def save_images(self, images: Tensor) -> None:
        """The validation images as one grid: <output dir>/val_images/step_<N>.png, and TensorBoard."""
        from PIL import Image

        grid = image_grid(images)  # [C, H', W'] in [0, 1]
        folder = os.path.join(self.cfg.output_dir, "val_images")
        os.makedirs(folder, exist_ok=True)
        pixels = (grid * 255).round().to(torch.uint8)
        Image.fromarray(pixels[0].numpy() if len(pixels) == 1 else pixels.permute(1, 2, 0).numpy()).save(
            os.path.join(folder, f"step_{self.version}.png"))
        if "tensorboard" in self.cfg.trainer.logger:
            if self.writer is None:
                from torch.utils.tensorboard import SummaryWriter
                self.writer = SummaryWriter(os.path.join(self.cfg.output_dir, "tensorboard"))
            self.writer.add_image("val/images", grid, self.version)
            self.writer.flush()

    def save_checkpoint(self, path: str, step: int) -> None:
        os.makedirs(path, exist_ok=True)
        self.actor.call(DiffusionActor.save_checkpoint, os.path.join(path, "actor"))
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            json.dump({"step": step, "version": self.version}, f)

    def load_checkpoint(self, path: str, step: int) -> None:
        self.actor.call(DiffusionActor.load_checkpoint, os.path.join(path, "actor"))
        with open(os.path.join(path, "trainer_state.json")) as f:
            self.version = json.load(f)["version"]

    def profile_targets(self):
        return self.targets

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def conditions(self, step: int) -> Conditions:
        """Step `step`'s data.train_batch_size conditions: consecutive slices, epoch after epoch.  # [B]"""
        size = self.cfg.data.train_batch_size
        start = (step - 1) % self.batches_per_epoch * size
        return self.train_conds[start:start + size]


def image_grid(images: Tensor, pad: int = 2) -> Tensor:
    """Images [N, C, H, W] in [0, 1] tiled into a near-square grid with white gaps.  # [C, H', W']"""
    n, c, h, w = images.shape
    cols = max(1, round(n**0.5))
    rows = -(-n // cols)
    grid = torch.ones(c, rows * (h + pad) + pad, cols * (w + pad) + pad)
    for i, image in enumerate(images):
        top, left = pad + i // cols * (h + pad), pad + i % cols * (w + pad)
        grid[:, top:top + h, left:left + w] = image
    return grid


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


def build_diffusion_trainer(cfg: PlaitConfig, backend, device: str) -> DiffusionTrainer:
    """Model, conditions, reward and the roles (actor; ref for a full fine-tune with a KL), handed to the trainer."""
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
