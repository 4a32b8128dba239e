"""Actor -> rollout weight sync: the only way new weights reach the rollout, versioned.

In-process (local backend) with `share` the rollout takes the actor's own tensors wherever dtype
and device agree: zero copies, and the rollout reads the actor's live weights. That is right only
when the rollout never generates while the actor updates (sync mode: gen, then update, then sync);
the async modes generate during updates, so they copy. Tensors of another dtype or device are
always copied. Across processes the backend's `pipe` moves it without the driver in the path: on
Ray, in-process when the rollout lives on the actor's rank-0 process (colocated), else a broadcast
over a process group of actor rank 0 and the rollout (gloo on CPU, NCCL on GPUs); either way it
ends in the rollout's `load_weights(state, version)`, whatever the engine.

`SyncCheck` then asks whether the weights arrived (a sync that silently does nothing, such as a LoRA
adapter that never reaches the engine, trains a policy the rollout never samples from): the trainer and
the engine each compute the log-probs of one fixed probe sequence, and after a sync the engine must sit
closer to the trainer's new policy than to the policy it held before. Scale-free: a no-op sync leaves the
engine exactly where it was, at the update's whole distance from the trainer; a working one lands within
the engines' numerical gap (measured at start, when both hold the same weights), however small the update.
"""

from __future__ import annotations

import sys
import time

from plait.errors import RunError
from plait.workers.actor import Actor
from plait.workers.rollout import Rollout


def sync_weights(actor_group, rollout_group, version: int, share: bool = False) -> None:
    actor_group.pipe(Actor.state_dict, rollout_group, Rollout.load_weights, version, share)


PROBE_TEXT = "The quick brown fox jumps over the lazy dog; 12 + 7 = 19, and 3 * 4 = 12."
PROBE_TOKENS = 24   # a forward of this many tokens on each side per sync: milliseconds on the SmolLM2 preset
FLOOR_FACTOR = 4    # the numerical gap measured at start, with room for its drift as the weights move
FLOOR_MIN = 1e-6    # log-prob units: float32 rounding of two forwards of the same weights stays below it


class SyncCheck:
    """After each weight sync, the engine's probe log-probs against the trainer's (see the module docstring).
    `after_sync` raises RunError naming the role and the step on a sync that did not take."""

    def __init__(self, actor_group, rollout_group, tokenizer):
        self.actor, self.rollout = actor_group, rollout_group
        self.ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)[:PROBE_TOKENS]
        self.floor: float | None = None   # None until start; stays None when the engine cannot answer
        self.engine_before: list[float] | None = None

    def start(self) -> None:
        """Both sides hold the same weights now (the model's, or a resumed checkpoint's): the numerical gap."""
        engine = self.rollout.call(Rollout.probe_logprobs, self.ids)
        if engine is None:
            print("plait: the rollout engine cannot compute log-probs of a given sequence: the weight-sync check "
                  "is off for this run", file=sys.stderr)
            return
        trainer = self.actor.call(Actor.probe_logprobs, self.ids)
        self.floor = max(FLOOR_FACTOR * gap(trainer, engine), FLOOR_MIN)
        self.engine_before = engine

    def after_sync(self, step: int) -> dict[str, float]:
        """The check after the sync that made policy version `step`; its metrics."""
        if self.floor is None:
            return {}
        start = time.perf_counter()
        trainer = self.actor.call(Actor.probe_logprobs, self.ids)
        engine = self.rollout.call(Rollout.probe_logprobs, self.ids)
        moved, off = gap(trainer, self.engine_before), gap(trainer, engine)
        if off > max(self.floor, moved / 2):
            stuck = gap(engine, self.engine_before) <= self.floor
            raise RunError(f"weight sync of step {step}: the rollout engine does not hold the actor's new weights: its "
                           f"log-probs of a fixed probe are {off:.3g} from the actor's"
                           + (" and did not change at all" if stuck else "") + f" (the update moved the actor "
                           f"{moved:.3g}; the engines agree within {self.floor:.2g}); the rollout would sample from "
                           "another policy than the one trained (trainer.check_weight_sync=false skips this check)")
        self.engine_before = engine
        return {"training/weight_sync_probe_diff": off, "perf/weight_sync_check_s": time.perf_counter() - start}


def gap(a: list[float], b: list[float]) -> float:
    """The largest difference between two probes' log-probs."""
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
