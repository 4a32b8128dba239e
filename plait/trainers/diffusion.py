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
the lifecycle's, not here; nor are the model, conditions and reward resolved for a run
(plait/build.py), the sampler and update (plait/workers/diffusion.py), the math
(plait/algorithms/flow_grpo.py) or the conditions and rewards (plait/data/images.py).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Callable

import torch
from torch import Tensor

from plait.algorithms.flow_grpo import group_advantages
from plait.config import PlaitConfig
from plait.configtree import ConfigError
from plait.data.images import IMAGE_REWARDS, PROMPT_IMAGE_REWARDS
from plait.data.prompts import PromptRow
from plait.trainers.lifecycle import StageTimer, StepResult
from plait.workers.diffusion import DiffusionActor, DiffusionRef

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

    def held(self):
        return contextlib.nullcontext()  # one thread

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

