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
from plait.data.images import IMAGE_REWARDS, condition_split
from plait.data.rewards import load_custom_reward
from plait.trainers.lifecycle import StageTimer, StepResult
from plait.workers.diffusers_policy import is_diffusers_policy
from plait.workers.diffusion import DiffusionActor, DiffusionRef, policy_config, pretrain_flow_model


class DiffusionTrainer:
    def __init__(self, cfg: PlaitConfig, actor, ref, reward_name: str, reward_fn: Callable, num_classes: int,
                 targets):
        self.cfg, self.actor, self.ref, self.targets = cfg, actor, ref, targets
        self.reward_name, self.reward_fn = reward_name, reward_fn
        d = cfg.data
        self.train_conds = condition_split("train", d.train_size, num_classes)  # [train_size]
        self.val_conds = condition_split("val", d.val_size, num_classes)  # [val_size]
        self.batches_per_epoch = d.train_size // d.train_batch_size
        if self.batches_per_epoch == 0:
            raise ConfigError("data.train_batch_size", d.train_batch_size, f"must be <= data.train_size={d.train_size}")
        self.version = 0

    # -- the Trainer protocol -------------------------------------------------------------------

    def total_steps(self) -> int:
        t = self.cfg.trainer
        return t.total_training_steps or t.total_epochs * self.batches_per_epoch

    def start(self) -> None:
        pass

    def train_step(self, step: int, timer: StageTimer) -> StepResult:
        n = self.cfg.actor_rollout_ref.rollout.n
        cond = self.conditions(step).repeat_interleave(n)  # [B*n]; a condition's samples side by side
        generator = torch.Generator().manual_seed(self.cfg.trainer.seed * 1_000_003 + step)
        with timer.stage("gen"):
            traj = self.actor.call(DiffusionActor.generate, cond, generator)
        with timer.stage("reward"):
            scores = self.reward_fn(traj.images, traj.cond).float()  # [B*n]
        with timer.stage("old_log_prob"):
            old_logp = self.actor.call(DiffusionActor.compute_logprobs, traj)  # [B*n, K]
        ref_mean = None
        if self.ref is not None:
            with timer.stage("ref"):
                ref_mean = self.ref.call(DiffusionRef.compute_means, traj)  # [B*n, K, C, H, W]
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
        images, conds = [], []
        for start in range(0, len(self.val_conds), size):
            traj = self.actor.call(DiffusionActor.generate, self.val_conds[start:start + size], generator, ode=True)
            images.append(traj.images)
            conds.append(traj.cond)
        images, cond = torch.cat(images), torch.cat(conds)  # [V, C, H, W], [V]
        out = {f"val-core/{self.reward_name}/reward/mean": self.reward_fn(images, cond).float().mean().item()}
        # The other built-in rewards show what the trained one is bought with (reward hacking).
        for name, fn in IMAGE_REWARDS.items():
            if name != self.reward_name:
                out[f"val-aux/{name}/reward/mean"] = fn(images, cond).mean().item()
        return out

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
        pass

    def conditions(self, step: int) -> Tensor:
        """Step `step`'s data.train_batch_size condition labels: consecutive slices, epoch after epoch.  # [B]"""
        size = self.cfg.data.train_batch_size
        start = (step - 1) % self.batches_per_epoch * size
        return self.train_conds[start:start + size]


def resolve_flow_model(cfg: PlaitConfig) -> str:
    """The policy's starting weights: the user's folder, or the built-in model pre-trained once and cached."""
    d = cfg.diffusion
    if d.model_path is not None and is_diffusers_policy(d.model_path):
        return d.model_path
    if d.lora.enable:
        raise ConfigError("diffusion.lora.enable", True, "needs diffusion.model_path to be a diffusers policy folder")
    if d.model_path is not None:
        if not os.path.isfile(os.path.join(d.model_path, "settings.json")):
            raise ConfigError("diffusion.model_path", d.model_path, "not a folder saved by pretrain_flow_model "
                              "(settings.json, model.pt) or a diffusers policy (plait_diffusers_policy.json)")
        return d.model_path
    out = os.path.join(cfg.output_dir, "demo_model", "flow")
    return str(pretrain_flow_model(d.model, d.pretrain_steps, d.pretrain_batch_size, d.pretrain_lr,
                                   cfg.trainer.seed, out))


def build_diffusion_trainer(cfg: PlaitConfig, backend, device: str) -> DiffusionTrainer:
    """Model, reward and the two roles (actor, and ref when the KL is on), handed to the trainer."""
    if cfg.algorithm.adv_estimator != "grpo":
        raise ConfigError("algorithm.adv_estimator", cfg.algorithm.adv_estimator,
                          "must be grpo with trainer.mode=diffusion (Flow-GRPO's group advantages)")
    d, custom = cfg.diffusion, cfg.custom_reward_function
    model_path = resolve_flow_model(cfg)
    reward_name, reward_fn = d.reward, IMAGE_REWARDS[d.reward]
    if custom.path:
        reward_name, reward_fn = custom.name, load_custom_reward(custom.path, custom.name)
    actor = backend.spawn("actor", DiffusionActor, model_path, d.actor, device=device, lora=d.lora)
    ref = backend.spawn("ref", DiffusionRef, model_path, device=device) if d.actor.kl_loss_coef > 0 else None
    return DiffusionTrainer(cfg, actor, ref, reward_name, reward_fn, policy_config(model_path).num_classes,
                            backend.profile_targets())
