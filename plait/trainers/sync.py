"""Synchronous PPO/GRPO for language models: generate with version N-1, update to version N.

One step, each stage one call (timed by the lifecycle, annotated in the workers):

    gen ─▶ reward ─▶ old_log_prob ─▶ ref ─▶ values ─▶ adv ─▶ update_critic ─▶ update_actor ─▶ update_weights

Everything from reward to update_actor is the shared LM pipeline (`plait/trainers/lm.py`); this
mode adds only where the batch comes from (generated now, with the current weights) and the
weight push after the update. Idle is measured as in the async modes, and here it is the other
side's stages: `trainer/idle_ratio` is gen's share of the step, and with the rollout on workers of
its own (placement=separated) `rollouter/idle_ratio` the training stages' share; colocated, no
rollouter exists and the metric is not logged.
"""

from __future__ import annotations

from plait.trainers.lifecycle import StageTimer
from plait.trainers.lm import LMTrainer
from plait.types import RolloutBatch
from plait.workers.rollout import Rollout


class SyncTrainer(LMTrainer):
    def next_batch(self, step: int, timer: StageTimer) -> RolloutBatch:
        """Sync: generate this step's batch now, with the current weights."""
        prompts = self.cursor.next()
        with timer.stage("gen"):
            return self.client.produce(Rollout.generate, prompts, self.sampling, self.sample_seed(step), epoch=self.cursor.epoch)

    def after_update(self, step: int, timer: StageTimer) -> dict[str, float]:
        """Sync: push the new weights to the rollout; they are policy version `step`. Returns the mode's metrics."""
        with timer.stage("update_weights"):
            # Nothing generates until the next step's gen: the rollout may read the actor's own tensors.
            checked = self.client.push(step, share=True)
        self.version = step
        # One waits while the other works: the trainer while the rollout generates, the rollout through
        # every training stage; update_weights is work for both (the step's outer "step" is still open).
        busy = sum(t for name, t in timer.times.items() if name != "step") or 1.0
        gen = timer.times.get("gen", 0.0)
        if self.cfg.trainer.placement == "colocated":  # one set of workers does both: no rollouter to sit idle
            return {"trainer/idle_ratio": gen / busy, **checked}
        return {"trainer/idle_ratio": gen / busy, **checked,
                "rollouter/idle_ratio": (busy - gen - timer.times.get("update_weights", 0.0)) / busy}
