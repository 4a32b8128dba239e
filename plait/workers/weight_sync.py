"""Actor -> rollout weight sync: the only way new weights reach the rollout, versioned.

In-process (local backend) with `share` the rollout takes the actor's own tensors wherever dtype
and device agree: zero copies, and the rollout reads the actor's live weights. That is right only
when the rollout never generates while the actor updates (sync mode: gen, then update, then sync);
the async modes generate during updates, so they copy. Tensors of another dtype or device are
always copied. Across processes the backend's `pipe` moves it without the driver in the path: on
Ray, in-process when the rollout lives on the actor's rank-0 process (colocated), else a broadcast
over a process group of actor rank 0 and the rollout (gloo on CPU, NCCL on GPUs); either way it
ends in the rollout's `load_weights(state, version)`, whatever the engine.
"""

from __future__ import annotations

from plait.workers.actor import Actor
from plait.workers.rollout import Rollout


def sync_weights(actor_group, rollout_group, version: int, share: bool = False) -> None:
    actor_group.pipe(Actor.state_dict, rollout_group, Rollout.load_weights, version, share)
