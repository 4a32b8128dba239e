"""Actor -> rollout weight sync: the only way new weights reach the rollout, versioned.

In-process (local backend) with `share` the rollout takes the actor's own tensors wherever dtype
and device agree: zero copies, and the rollout reads the actor's live weights. That is right only
when the rollout never generates while the actor updates (sync mode: gen, then update, then sync);
the async modes generate during updates, so they copy. Tensors of another dtype or device are
always copied. Across processes the state dict travels through the backend (Ray's object store on
CPU); a collective (NCCL broadcast) belongs here too when the rollout runs on its own GPUs.
"""

from __future__ import annotations

from plait.workers.actor import Actor
from plait.workers.rollout import Rollout


def sync_weights(actor_group, rollout_group, version: int, share: bool = False) -> None:
    state = actor_group.call(Actor.state_dict)
    rollout_group.call(Rollout.load_weights, state, version, share)
