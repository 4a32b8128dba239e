"""Actor -> rollout weight sync: the only way new weights reach the rollout, versioned.

In-process (local backend) this copies tensors; across processes the state dict travels through
the backend (Ray's object store on CPU); a collective (NCCL broadcast) belongs here too when the
rollout runs on its own GPUs.
"""

from __future__ import annotations

from plait.workers.actor import Actor
from plait.workers.rollout import Rollout


def sync_weights(actor_group, rollout_group, version: int) -> None:
    state = actor_group.call(Actor.state_dict)
    rollout_group.call(Rollout.load_weights, state, version)
