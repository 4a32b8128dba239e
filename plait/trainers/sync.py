"""Synchronous PPO/GRPO for language models: generate with version N-1, update to version N.

One step, each stage one call (timed by the lifecycle, annotated in the workers):

    gen ─▶ reward ─▶ old_log_prob ─▶ ref ─▶ values ─▶ adv ─▶ update_critic ─▶ update_actor ─▶ update_weights

Everything from reward to update_actor is the shared LM pipeline (`plait/trainers/lm.py`); this
mode adds only where the batch comes from (generated now, with the current weights) and the
weight push after the update.
"""

from __future__ import annotations

from plait.trainers.lifecycle import StageTimer
from plait.trainers.lm import LMTrainer
from plait.types import RolloutBatch
from plait.workers.rollout import Rollout
from plait.workers.weight_sync import sync_weights


class SyncTrainer(LMTrainer):
    def next_batch(self, step: int, timer: StageTimer) -> RolloutBatch:
        """Sync: generate this step's batch now, with the current weights."""
        prompts = self.cursor.next()
        with timer.stage("gen"):
            return self.roles.rollout.call(Rollout.generate, prompts, self.sampling, self.sample_seed(step))

    def after_update(self, step: int, timer: StageTimer) -> dict[str, float]:
        """Sync: push the new weights to the rollout; they are policy version `step`. Returns the mode's metrics."""
        with timer.stage("update_weights"):
            # Nothing generates until the next step's gen: the rollout may read the actor's own tensors.
            sync_weights(self.roles.actor, self.roles.rollout, step, share=True)
        self.version = step
        return {}
